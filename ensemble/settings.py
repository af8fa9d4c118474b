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

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

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
    model_path: str = "default"            # "default", a HF directory, a .gguf file or a preset
    tokenizer_dir: str | None = None       # None = the model's own tokenizer
    device: str = "auto"                   # "auto" = cuda when available, else cpu
    dtype: str = "auto"                    # "auto" = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = 64               # engine running-request cap (in-flight batch)
    max_num_tokens: int = 2048             # engine token budget per step
    max_seq_len: int | None = None         # prompt + generated tokens; None = model limit
    tokens_per_block: int | None = None
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    max_queue_size: int = 0                # engine waiting-queue cap; 0 = unbounded
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    seed: int = 0                          # engine-wide generator for unseeded sampling
    # ---- request defaults --------------------------------------------------------------------
    default_max_tokens: int = 64           # when a request has no max_tokens/request_output_len
    exclude_input_in_output: bool = True   # default of the per-request input of the same name
    add_special_tokens: bool = True        # preprocessing: tokenizer.encode(add_special_tokens=)
    skip_special_tokens: bool = True       # postprocessing: decode(skip_special_tokens=)
    # ---- Triton side ---------------------------------------------------------------------------
    triton_max_batch_size: int = 64        # max_batch_size of every config (requests' batch dim)
    preprocessing_instance_count: int = 1
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
        positive = ("max_batch_size", "max_num_tokens", "default_max_tokens",
                    "triton_max_batch_size", "preprocessing_instance_count", "bls_instance_count",
                    "cancellation_check_period_ms", "stats_check_period_ms")
        for name in positive:
            _check_int(name, getattr(self, name), low=1)
        for name in ("max_seq_len", "tokens_per_block", "max_tokens_in_paged_kv_cache"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=1)
        for name in ("max_queue_size", "max_queue_delay_microseconds", "seed"):
            _check_int(name, getattr(self, name), low=0)
        for name in ("http_port", "grpc_port", "metrics_port"):
            _check_int(name, getattr(self, name), low=0)
            if getattr(self, name) > 65535:
                raise ValueError(f"{name} must be <= 65535, got {getattr(self, name)}")
        fraction = self.kv_cache_free_gpu_mem_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction!r}")
        if self.batch_scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"batch_scheduler_policy must be one of {SCHEDULER_POLICIES}, "
                             f"got {self.batch_scheduler_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
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


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
