"""The adapters a runner serves, by name: read at start, each in a slot of every adapted
projection, and the step's rows grouped by slot around the forward pass.

All registered adapters stay resident (at most `max_loras`); moving adapters between the device
and host memory as requests need them (LRU) is a later step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from backend.lora.linear_lora import LinearLora
from backend.lora.lora_batch import LoraBatch, LoraContext
from backend.lora.peft_adapter import load_peft_adapter
from backend.request import Chunk


@dataclass(frozen=True)
class LoraTarget:
    """Where a Hugging Face projection lives in the model: `layer` (a `backend.layers.Linear`,
    given a `lora` attribute) and its slice of the layer's output rows."""

    layer: torch.nn.Module
    projection: str
    first_row: int
    rows: int


class LoraManager:
    def __init__(
        self,
        adapters: dict[str, str],
        targets: dict[str, LoraTarget],
        max_rank: int,
        max_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """`adapters`: name -> PEFT directory; `targets`: Hugging Face module name -> where it is
        in the model (`backend.models.lora_targets`)."""
        if len(adapters) > max_loras:
            raise ValueError(
                f"lora_modules registers {len(adapters)} adapters but max_loras is {max_loras}"
            )
        self.device = device
        self.context = LoraContext()
        shapes = {name: (t.layer.in_features, t.rows) for name, t in targets.items()}
        loaded = [load_peft_adapter(n, p, max_rank, shapes) for n, p in adapters.items()]
        self.slot_of = {adapter.name: slot for slot, adapter in enumerate(loaded)}
        slices: dict[torch.nn.Module, dict[str, tuple[int, int]]] = {}
        for t in targets.values():
            slices.setdefault(t.layer, {})[t.projection] = (t.first_row, t.rows)
        for layer, layer_slices in slices.items():
            layer.lora = LinearLora(
                layer.in_features, layer_slices, len(loaded), max_rank, self.context, dtype, device
            )
        for slot, adapter in enumerate(loaded):
            for module, weights in adapter.modules.items():
                target = targets[module]
                target.layer.lora.load(slot, target.projection, weights)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slot_of)

    def token_slots(self, chunks: list[Chunk]) -> np.ndarray | None:
        """Each packed token's slot (-1: the base model), or None when no chunk has an adapter."""
        names = [c.request.sampling.lora_name for c in chunks]
        if names.count(None) == len(names):
            return None
        slots = [-1 if name is None else self.slot_of[name] for name in names]
        return np.repeat(np.array(slots, np.int64), [c.num_tokens for c in chunks])

    @contextmanager
    def step(self, token_slots: np.ndarray | None):
        """The adapted projections add their adapters' products while in this block."""
        self.context.batch = (
            None if token_slots is None else LoraBatch.of_tokens(token_slots, self.device)
        )
        try:
            yield
        finally:
            self.context.batch = None
