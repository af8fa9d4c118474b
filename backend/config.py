"""Engine configuration: one dataclass, names as in TensorRT-LLM where one exists."""
from __future__ import annotations

from dataclasses import dataclass

from backend.validation import check_int

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    model_path: str = "default"           # "default", a HF directory, a .gguf file or a preset name
    tokenizer_dir: str | None = None      # defaults to the model directory
    device: str = "auto"                  # "auto" = cuda when available, else cpu
    dtype: str = "auto"                   # "auto" = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = 64              # running-request cap
    max_num_tokens: int = 2048            # token budget per step
    max_seq_len: int | None = None        # prompt + generated; None = the model's limit
    tokens_per_block: int | None = None   # None = 32 on GPU, 16 on CPU
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    max_queue_size: int = 0               # 0 = unbounded
    attention_backend: str = "auto"       # "auto" = triton on GPU, torch on CPU
    cuda_graphs: bool = True              # decode-only steps on GPU
    seed: int = 0                         # engine-wide generator for unseeded sampling
    # Overlap host work (scheduling, packing, stop checks, delivery) with the device's step;
    # None = on for CUDA, off on CPU (nothing to overlap with). True forces it on (tests on CPU).
    overlap_scheduling: bool | None = None

    def validate(self) -> None:
        for name in ("max_batch_size", "max_num_tokens"):
            check_int(name, getattr(self, name), low=1)
        for name in ("max_seq_len", "tokens_per_block", "max_tokens_in_paged_kv_cache"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        fraction = self.kv_cache_free_gpu_mem_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction!r}")
        if self.batch_scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"batch_scheduler_policy must be one of {SCHEDULER_POLICIES}, "
                             f"got {self.batch_scheduler_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        for name in ("max_queue_size", "seed"):
            check_int(name, getattr(self, name), low=0)
