"""The LoRA shrink/expand kernels (Triton language; interpreted on CPU) against the torch product
(`backend.lora.linear_lora`): rows of several adapters and of none, tiles of one slot split at
BLOCK_M, ranks that differ by slot and by slice, a slot loaded with nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")
from backend.kernels.lora_shrink_expand import BLOCK_M, expand_add, shrink, tile_plan  # noqa: E402
from backend.lora.linear_lora import LinearLora  # noqa: E402
from backend.lora.lora_batch import LoraBatch, LoraContext  # noqa: E402
from backend.lora.peft_adapter import LoraWeights  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpretable_triton_language")

SLICES = {"q_proj": (0, 70), "k_proj": (70, 20), "v_proj": (90, 20)}
RANKS = {0: {"q_proj": 8, "k_proj": 16, "v_proj": 16}, 1: {"q_proj": 32}, 2: {"v_proj": 1}}


def test_kernels_equal_the_torch_product():
    generator = torch.Generator().manual_seed(0)
    in_features, max_rank, device = 48, 32, torch.device(DEVICE)
    context = LoraContext()
    lora = LinearLora(in_features, SLICES, 4, max_rank, context, torch.float32, device)
    for slot, ranks in RANKS.items():
        for name, r in ranks.items():
            a = torch.randn(r, in_features, generator=generator)
            lora.load(
                slot, name, LoraWeights(a, torch.randn(SLICES[name][1], r, generator=generator))
            )
    rng = np.random.default_rng(0)
    token_slots = rng.choice([-1, 0, 1, 2, 3], size=3 * BLOCK_M + 5, p=[0.2, 0.4, 0.2, 0.1, 0.1])
    x = torch.randn(token_slots.size, in_features, generator=generator).to(device)
    base = torch.randn(token_slots.size, 110, generator=generator).to(device)
    context.batch = LoraBatch.of_tokens(token_slots, device)
    expected = lora.add_to(base.clone(), x)

    plan = tile_plan(token_slots, device)
    assert (plan.tile_count <= BLOCK_M).all() and int(plan.tile_count.sum()) == (
        token_slots >= 0
    ).sum()
    got = base.clone()
    for name, (first, _) in SLICES.items():
        ranks = torch.tensor(lora.ranks[name], dtype=torch.int32, device=device)
        shrunk = shrink(x, lora.a[name], ranks, plan)
        expand_add(got, shrunk, lora.b[name], ranks, first, plan)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    untouched = token_slots < 0
    assert torch.equal(
        got[torch.from_numpy(untouched).to(device)], base[torch.from_numpy(untouched).to(device)]
    )
