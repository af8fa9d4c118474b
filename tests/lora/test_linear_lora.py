"""The batched product of a projection's adapter slots against each row computed alone: rows of
several adapters and of none, ranks that differ by slot and by slice of a fused layer."""

from __future__ import annotations

import numpy as np
import torch

from backend.lora.linear_lora import LinearLora
from backend.lora.lora_batch import LoraBatch, LoraContext
from backend.lora.peft_adapter import LoraWeights

SLICES = {"q_proj": (0, 12), "k_proj": (12, 4), "v_proj": (16, 4)}  # a fused q|k|v layer
RANKS = {0: {"q_proj": 2, "k_proj": 4, "v_proj": 4}, 1: {"q_proj": 8}, 2: {"v_proj": 1}}


def test_rows_grouped_by_adapter_equal_each_row_alone():
    generator = torch.Generator().manual_seed(0)
    in_features, max_rank = 16, 8
    context = LoraContext()
    lora = LinearLora(in_features, SLICES, 4, max_rank, context, torch.float32, torch.device("cpu"))
    weights = {}
    for slot, ranks in RANKS.items():
        for name, r in ranks.items():
            rows = SLICES[name][1]
            w = LoraWeights(
                torch.randn(r, in_features, generator=generator),
                torch.randn(rows, r, generator=generator),
            )
            lora.load(slot, name, w)
            weights[slot, name] = w
    token_slots = np.array([1, -1, 0, 2, 0, 3, 1, -1, 2, 0], np.int64)  # slot 3: loaded nothing
    x = torch.randn(len(token_slots), in_features, generator=generator)
    base = torch.randn(len(token_slots), 20, generator=generator)
    expected = base.clone()
    for row, slot in enumerate(token_slots):
        for name, (first, size) in SLICES.items():
            if (slot, name) in weights:
                w = weights[slot, name]
                expected[row, first : first + size] += w.b @ (w.a @ x[row])
    context.batch = LoraBatch.of_tokens(token_slots, torch.device("cpu"))
    got = lora.add_to(base.clone(), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    adapted = [i for i, s in enumerate(token_slots) if s in RANKS]
    assert not torch.allclose(got[adapted], base[adapted])  # the product is not vacuous
    torch.testing.assert_close(got[[1, 5, 7]], base[[1, 5, 7]], rtol=0, atol=0)  # untouched


def test_one_adapter_for_every_row_and_none():
    context = LoraContext()
    lora = LinearLora(8, {"o_proj": (0, 8)}, 2, 4, context, torch.float32, torch.device("cpu"))
    w = LoraWeights(torch.randn(4, 8), torch.randn(8, 4))
    lora.load(1, "o_proj", w)
    x, base = torch.randn(5, 8), torch.randn(5, 8)
    assert LoraBatch.of_tokens(np.full(5, -1), torch.device("cpu")) is None
    context.batch = None
    assert torch.equal(lora.add_to(base.clone(), x), base)
    context.batch = LoraBatch.of_tokens(np.full(5, 1), torch.device("cpu"))
    assert context.batch.groups[0][1] is None  # every row: no gather
    torch.testing.assert_close(lora.add_to(base.clone(), x), base + x @ w.a.t() @ w.b.t())
    lora.clear(1)
    assert torch.equal(lora.add_to(base.clone(), x), base)
