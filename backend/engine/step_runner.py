"""What the engine needs of a model runner (`backend.runner.model_runner.ModelRunner` is the
one; a test may hand the executor another): the model's limits, the KV pool's shape, one step,
and the tensor-parallel failure hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from backend.distributed.tensor_parallel import TensorParallelError
from backend.model_config import ModelConfig
from backend.request import Chunk
from backend.runner.model_runner import StepLogits


@runtime_checkable  # isinstance checks the members are there (tests)
class StepRunner(Protocol):
    model_dir: str
    model_config: ModelConfig
    device: torch.device
    max_seq_len: int
    tokens_per_block: int
    kv_group_blocks: list[int]  # blocks of each KV cache group's pool
    # Set by the executor: called from another thread when the runner cannot compute again.
    on_fatal: Callable[[str], None]

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    def execute(
        self,
        chunks: list[Chunk],
        in_flight_ids: torch.Tensor | None = None,
        banned_ids: np.ndarray | None = None,
        prompt_logprobs: bool = False,
    ) -> StepLogits:
        """Queue one packed step on the device; the logits of its sampling chunks."""
        ...

    def explain(self, exc: TensorParallelError) -> TensorParallelError:
        """A failed collective, named after the rank that died when one did."""
        ...

    def release(self) -> None:
        """Hand the model's and the KV cache's device memory back; unusable afterwards."""
        ...
