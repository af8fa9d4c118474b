"""One typed settings object for a served model repository.

Every `config.pbtxt` of the repository is rendered from a `ServeSettings` (see `render.py`), so a
value is set in one place: the engine parameters of the `tensorrt_llm` model (names as in
TensorRT-LLM where one exists), the Triton-side knobs of the five models and the server ports.

`None` for an engine field means "the engine decides" (e.g. `max_seq_len` = the model's limit,
`tokens_per_block` = 32 on GPU / 16 on CPU, KV cache sized from `kv_cache_free_gpu_mem_fraction`);
such parameters are rendered with the value "auto" and read back as unset.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from backend.config import EngineConfig  # plain dataclasses: importing them loads no engine code
from backend.validation import check_int

# The engine's fields, rendered as `parameters` of the `tensorrt_llm` model in this order.
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))


@dataclass(frozen=True)
class ServeSettings(EngineConfig):
    """EngineConfig's fields (the `tensorrt_llm` parameters: same names, defaults and checks,
    inherited so that a new engine knob is served without another edit), then the repository's."""

    # ---- request defaults --------------------------------------------------------------------
    default_max_tokens: int = 64  # when a request has no max_tokens/request_output_len
    exclude_input_in_output: bool = True  # default of the per-request input of the same name
    add_special_tokens: bool = True  # preprocessing: tokenizer.encode(add_special_tokens=)
    # preprocessing: wrap text_input as one user message in the model's chat template (the
    # per-request input apply_chat_template overrides it); off by default as in tensorrtllm_backend
    apply_chat_template: bool = False
    skip_special_tokens: bool = True  # postprocessing: decode(skip_special_tokens=)
    # ---- Triton side ---------------------------------------------------------------------------
    triton_max_batch_size: int = 64  # max_batch_size of every config (requests' batch dim)
    # tensorrt_llm and tensorrt_llm_bls decoupled (streaming; gRPC stream, generate_stream) or not
    # (one response per request; plain infer() over HTTP/gRPC); the ensemble follows tensorrt_llm
    decoupled_mode: bool = True
    preprocessing_instance_count: int = 2
    # Stub processes of tensorrt_llm sharing its one engine: each answers its share of requests
    llm_instance_count: int = 1
    # Responses a second that tensorrt_llm aims at (its instances together) when many streams
    # run: beyond it a stream's responses carry several tokens each (first and last never wait);
    # fewer round trips in every hop after it. 0: each token as soon as it can be sent
    response_rate_limit: int = 0
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
        super().validate()
        for name, low in _LOWEST.items():
            check_int(name, getattr(self, name), low=low)
        ports = [getattr(self, name) for name in _PORTS]
        for name, port in zip(_PORTS, ports):
            if port > 65535:
                raise ValueError(f"{name} must be <= 65535, got {port}")
        if len({p for p in ports if p}) != len([p for p in ports if p]):
            raise ValueError(f"http_port, grpc_port and metrics_port must differ, got {ports}")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS})

    def engine_parameters(self) -> dict[str, str]:
        """The `tensorrt_llm` parameters as config.pbtxt string values."""
        return {name: to_param(getattr(self, name)) for name in ENGINE_FIELDS}


_PORTS = ("http_port", "grpc_port", "metrics_port")  # 0 = the port is not used
# The least value of each of the repository's integers (EngineConfig checks its own).
_LOWEST = {
    "default_max_tokens": 1,
    "triton_max_batch_size": 1,
    "preprocessing_instance_count": 1,
    "llm_instance_count": 1,
    "response_rate_limit": 0,
    "postprocessing_instance_count": 1,
    "bls_instance_count": 1,
    "max_queue_delay_microseconds": 0,
    "cancellation_check_period_ms": 1,
    "stats_check_period_ms": 1,
    **{name: 0 for name in _PORTS},
}


def to_param(value) -> str:
    """Render a value as a config.pbtxt `string_value` ("auto" for unset)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
