"""Engine configuration: one frozen dataclass, names as in TensorRT-LLM where one exists.

It is checked when made, so no part of the engine sees a bad value, and it cannot change after.
The served repository's settings (ensemble/settings.py) inherit its fields, defaults and checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.validation import check_fields, check_int
from backend.weight_formats import QUANTIZATIONS, check_lm_head

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# What the paged KV cache stores (backend/attention/kv_dtype.py): "auto" = the model dtype; fp8
# (e4m3) and int8 = quantized values with a dynamic scale per token and kv head beside them.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# Speculative decoding (backend/speculative/): "ngram" drafts by prompt lookup; a draft model
# is issue 54's next slice.
SPECULATIVE_METHODS = (None, "ngram")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = "default"  # "default", a model name, a HF directory, a .gguf file, a preset
    tokenizer_dir: str | None = None  # defaults to the model directory
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = 64  # running-request cap
    max_num_tokens: int = 2048  # token budget per step
    max_seq_len: int | None = None  # prompt + generated; None = the model's limit
    tokens_per_block: int | None = None  # None = 32 on GPU, 16 on CPU
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    max_queue_size: int = 0  # 0 = unbounded
    attention_backend: str = "auto"  # "auto" = triton on GPU, torch on CPU
    cuda_graphs: bool = True  # replay CUDA graphs on GPU (steps of decodes only, and ...)
    # ... steps with prompt tokens of up to this many tokens, padded (0: decode-only graphs)
    cuda_graph_max_tokens: int = 8192
    quantization: str = "none"  # one of QUANTIZATIONS (backend/weight_formats.py: the table)
    # Comma-separated fragments of module names ("layers.0.,layers.29.", "down_proj") whose
    # projections stay in the model dtype when float weights are quantized at load.
    quantization_exclude: str | None = None
    # Quantize the lm_head too (into the format's at-load form; a tied one gets its own copy, the
    # embedding stays dense): off by default, as TensorRT-LLM's and vLLM's recipes leave it.
    quantize_lm_head: bool = False
    # `fp8` GEMMs of many rows (torch's scaled GEMM) keep their sums in the tensor cores' own
    # accumulator, fewer bits than float32, instead of promoting them: faster, as other engines'
    # FP8 GEMMs commonly run; off by default (docs/weight-formats.md, "FP8 fast accumulation").
    fp8_fast_accumulation: bool = False
    seed: int = 0  # engine-wide generator for unseeded sampling
    # Ranks the model is split across (backend/distributed/tensor_parallel.py): processes on this
    # host, gloo on CPU, NCCL on CUDA; `gpu_device_ids` ("0,1") picks each rank's GPU (else GPU i).
    tensor_parallel_size: int = 1
    gpu_device_ids: str | None = None
    # Overlap host work (scheduling, packing, stop checks, delivery) with the device's step;
    # None = on for CUDA, off on CPU (nothing to overlap with). True forces it on (tests on CPU).
    overlap_scheduling: bool | None = None
    # Attention windows in tokens, comma-separated, repeated over the layers ("4096" = every
    # layer, "4096,32768" = alternating); None = the model's own (e.g. Mistral's sliding_window).
    max_attention_window_size: str | None = None
    sink_token_length: int = 0  # first tokens that windowed layers always see
    # A streamed request's outputs after its first carry at least this many new tokens (its last
    # may carry fewer): fewer outputs for the host to build, send and answer at high concurrency.
    stream_interval: int = 1
    # While requests wait to start, a prompt's chunk is first cut to this many tokens so they
    # start in the same step (the budget they leave goes back to it): a long prompt does not hold
    # new requests back. None = max_num_tokens // 4; 0 = no cut. vLLM's name.
    long_prefill_token_threshold: int | None = None
    # LoRA adapters served by name (backend/lora/): "NAME=DIR" pairs, separated by commas or
    # spaces, each a Hugging Face PEFT directory read at start; a request picks one by
    # `lora_name`. At most `max_loras` of them, each of rank at most `max_lora_rank`.
    lora_modules: str | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    # Speculative decoding: None (off) or "ngram" (prompt lookup: drafts copied from where the
    # request's last tokens occurred before, verified exactly in one step; greedy requests only,
    # docs/configuration.md). Up to num_speculative_tokens drafts a step, from the longest
    # suffix n-gram of prompt_lookup_max down to prompt_lookup_min tokens. vLLM's names.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def prefill_chunk_cap(self) -> int:
        """`long_prefill_token_threshold` resolved: the most tokens a prompt chunk takes while
        requests wait behind it (max_num_tokens where there is no cut)."""
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_tokens // 4)
        return self.long_prefill_token_threshold or self.max_num_tokens

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and the rule it breaks."""
        check_fields(self)
        for name, low in _LOWEST.items():
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=low)
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ValueError(
                "kv_cache_free_gpu_mem_fraction must be in (0, 1], "
                f"got {self.kv_cache_free_gpu_mem_fraction!r}"
            )
        self.attention_windows()
        self.excluded_modules()
        if self.quantize_lm_head:
            check_lm_head(self.quantization)
        if self.fp8_fast_accumulation and self.quantization not in ("fp8", "auto"):
            raise ValueError(
                "fp8_fast_accumulation applies to fp8 weights (quantization fp8, or auto on an "
                f"FP8 checkpoint), got quantization {self.quantization!r}"
            )
        if self.gpu_device_ids is not None:
            ids = self.gpu_device_ids.split(",")
            if not all(i.strip().isdigit() for i in ids) or len(ids) != self.tensor_parallel_size:
                raise ValueError(
                    "gpu_device_ids must list one GPU index per rank, comma-separated "
                    f"(tensor_parallel_size {self.tensor_parallel_size}), "
                    f"got {self.gpu_device_ids!r}"
                )
        adapters = self.lora_adapters()
        if len(adapters) > self.max_loras:
            raise ValueError(
                f"lora_modules registers {len(adapters)} adapters; max_loras is {self.max_loras}"
            )
        self._check_speculation()
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    def _check_speculation(self) -> None:
        if self.speculative_method == "draft_model":
            raise ValueError(
                "speculative_method 'draft_model' is not supported yet (issue 54); "
                "use 'ngram' or leave speculative_method unset"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                f"got {self.prompt_lookup_max}"
            )
        if self.speculative_method is not None and self.overlap_scheduling:
            # The proposer reads each request's newest token on the host before the next step
            # is scheduled; overlap schedules that step while the token is still on the device.
            raise ValueError(
                "overlap_scheduling must be off (false or unset) with speculative_method "
                f"{self.speculative_method!r}: drafts are proposed from the newest token"
            )

    def excluded_modules(self) -> tuple[str, ...]:
        """`quantization_exclude` as its fragments, () when unset."""
        if self.quantization_exclude is None:
            return ()
        fragments = tuple(part.strip() for part in self.quantization_exclude.split(","))
        if not all(fragments):
            raise ValueError(
                "quantization_exclude must be fragments of module names separated by commas, "
                f"got {self.quantization_exclude!r}"
            )
        return fragments

    def lora_adapters(self) -> dict[str, str]:
        """`lora_modules` as adapter name -> directory, in order ({} when unset)."""
        if self.lora_modules is None:
            return {}
        adapters = {}
        for pair in self.lora_modules.replace(",", " ").split():
            name, _, path = pair.partition("=")
            if not name or not path or name in adapters:
                raise ValueError(
                    "lora_modules must be NAME=DIR pairs with distinct names, separated by "
                    f"commas or spaces, got {self.lora_modules!r}"
                )
            adapters[name] = path
        return adapters

    def attention_windows(self) -> tuple[int, ...] | None:
        """`max_attention_window_size` as integers, None when unset."""
        text = self.max_attention_window_size
        if text is None:
            return None
        try:
            windows = tuple(int(part) for part in text.split(","))
        except ValueError:
            windows = ()
        if not windows or min(windows) < 1:
            raise ValueError(
                "max_attention_window_size must be positive integers separated by commas, "
                f"got {text!r}"
            )
        return windows


# The least value of each integer field (types are checked from the annotations).
_LOWEST = {
    "max_batch_size": 1,
    "max_num_tokens": 1,
    "max_seq_len": 1,
    "tokens_per_block": 1,
    "max_tokens_in_paged_kv_cache": 1,
    "max_queue_size": 0,
    "seed": 0,
    "sink_token_length": 0,
    "tensor_parallel_size": 1,
    "stream_interval": 1,
    "cuda_graph_max_tokens": 0,
    "long_prefill_token_threshold": 0,
    "max_loras": 1,
    "max_lora_rank": 1,
    "num_speculative_tokens": 1,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 1,
}
CHOICES = {
    "batch_scheduler_policy": SCHEDULER_POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "quantization": QUANTIZATIONS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "speculative_method": SPECULATIVE_METHODS,
}
