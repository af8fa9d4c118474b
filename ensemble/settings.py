"""One typed settings object for a served model repository.

Every `config.pbtxt` of the repository is rendered from a `ServeSettings` (see `render.py`), so a
value is set in one place: the engine parameters of the `tensorrt_llm` model (names as in
TensorRT-LLM where one exists), the Triton-side knobs of the five models and the server ports.

`None` for an engine field means "the engine decides" (e.g. `max_seq_len` = the model's limit,
`tokens_per_block` = 32 on GPU / 16 on CPU, KV cache sized from `kv_cache_free_gpu_mem_fraction`);
such parameters are rendered with the value "auto" and read back as unset.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from backend.config import EngineConfig  # plain dataclasses: importing them loads no engine code
from backend.validation import check_int

_ENGINE = EngineConfig()  # the engine's defaults are the repository's defaults

# Fields rendered as `parameters` of the `tensorrt_llm` model, in this order.
ENGINE_FIELDS = (
    "model_path", "tokenizer_dir", "device", "dtype", "max_batch_size", "max_num_tokens",
    "max_seq_len", "tokens_per_block", "max_tokens_in_paged_kv_cache",
    "kv_cache_free_gpu_mem_fraction", "enable_kv_cache_reuse", "enable_chunked_context",
    "batch_scheduler_policy", "max_queue_size", "attention_backend", "cuda_graphs", "seed",
)


@dataclass
class ServeSettings:
    # ---- engine (tensorrt_llm parameters) -----------------------------------------------------
    model_path: str = _ENGINE.model_path  # "default", a HF directory, a .gguf file or a preset
    tokenizer_dir: str | None = _ENGINE.tokenizer_dir  # None = the model's own tokenizer
    device: str = _ENGINE.device  # "auto" = cuda when available, else cpu
    dtype: str = _ENGINE.dtype  # "auto" = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = _ENGINE.max_batch_size  # engine running-request cap (in-flight batch)
    max_num_tokens: int = _ENGINE.max_num_tokens  # engine token budget per step
    max_seq_len: int | None = _ENGINE.max_seq_len  # prompt + generated tokens; None = model limit
    tokens_per_block: int | None = _ENGINE.tokens_per_block
    max_tokens_in_paged_kv_cache: int | None = _ENGINE.max_tokens_in_paged_kv_cache
    kv_cache_free_gpu_mem_fraction: float = _ENGINE.kv_cache_free_gpu_mem_fraction
    enable_kv_cache_reuse: bool = _ENGINE.enable_kv_cache_reuse
    enable_chunked_context: bool = _ENGINE.enable_chunked_context
    batch_scheduler_policy: str = _ENGINE.batch_scheduler_policy
    max_queue_size: int = _ENGINE.max_queue_size  # engine waiting-queue cap; 0 = unbounded
    attention_backend: str = _ENGINE.attention_backend
    cuda_graphs: bool = _ENGINE.cuda_graphs
    seed: int = _ENGINE.seed  # engine-wide generator for unseeded sampling
    # ---- request defaults --------------------------------------------------------------------
    default_max_tokens: int = 64           # when a request has no max_tokens/request_output_len
    exclude_input_in_output: bool = True   # default of the per-request input of the same name
    add_special_tokens: bool = True        # preprocessing: tokenizer.encode(add_special_tokens=)
    # preprocessing: wrap text_input as one user message in the model's chat template (the
    # per-request input apply_chat_template overrides it); off by default as in tensorrtllm_backend
    apply_chat_template: bool = False
    skip_special_tokens: bool = True       # postprocessing: decode(skip_special_tokens=)
    # ---- Triton side ---------------------------------------------------------------------------
    triton_max_batch_size: int = 64        # max_batch_size of every config (requests' batch dim)
    # tensorrt_llm and tensorrt_llm_bls decoupled (streaming; gRPC stream, generate_stream) or not
    # (one response per request; plain infer() over HTTP/gRPC); the ensemble follows tensorrt_llm
    decoupled_mode: bool = True
    preprocessing_instance_count: int = 2
    # Batching the streamed pieces in postprocessing (ragged windows, preserve_ordering) takes
    # more pieces per execute, but Triton's batcher then drops the pieces of a cancelled ensemble
    # request before postprocessing sees them, so the cancellation no longer reaches the engine.
    postprocessing_batching: bool = False
    postprocessing_instance_count: int = 1  # more only with postprocessing_batching (ordering)
    bls_instance_count: int = 1
    max_queue_delay_microseconds: int = 0  # dynamic batching delay of preprocessing/tensorrt_llm
    cancellation_check_period_ms: int = 100
    stats_check_period_ms: int = 200
    # ---- server ------------------------------------------------------------------------------
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002

    def validate(self) -> None:
        """Raise ValueError naming the field and the rule for the first invalid value."""
        EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS}).validate()
        positive = ("default_max_tokens", "triton_max_batch_size", "preprocessing_instance_count",
                    "postprocessing_instance_count", "bls_instance_count",
                    "cancellation_check_period_ms", "stats_check_period_ms")
        for name in positive:
            check_int(name, getattr(self, name), low=1)
        check_int("max_queue_delay_microseconds", self.max_queue_delay_microseconds, low=0)
        for name in ("http_port", "grpc_port", "metrics_port"):
            check_int(name, getattr(self, name), low=0)
            if getattr(self, name) > 65535:
                raise ValueError(f"{name} must be <= 65535, got {getattr(self, name)}")
        for name in ("model_path", "device", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        if len({p for p in ports if p}) != len([p for p in ports if p]):
            raise ValueError(f"http_port, grpc_port and metrics_port must differ, got {ports}")

    def engine_parameters(self) -> dict[str, str]:
        """The `tensorrt_llm` parameters as config.pbtxt string values."""
        return {name: to_param(getattr(self, name)) for name in ENGINE_FIELDS}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def to_param(value) -> str:
    """Render a value as a config.pbtxt `string_value` ("auto" for unset)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
