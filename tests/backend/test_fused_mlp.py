"""The one-token MLP kernel and the kernels that fold its pending fixed-point sum, against torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.backend.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.kernels import fixed_point  # noqa: E402
from backend.kernels.fused_mlp import fused_mlp  # noqa: E402
from backend.kernels.gemv import gemv  # noqa: E402
from backend.models.llama import RMSNorm  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got, expected, dtype):
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _norm(hidden, dtype, seed):
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator(DEVICE).manual_seed(seed))
    return norm.to(dtype)


def _mlp_reference(x, norm, gate_up_weight, down_weight):
    """The unfused path: RMSNorm, gate|up, silu·mul, down, each rounded to x's dtype."""
    dtype = x.dtype
    gate, up = F.linear(norm(x).float(), gate_up_weight.float()).to(dtype).chunk(2, dim=-1)
    activated = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    return F.linear(activated.float(), down_weight.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden,intermediate,transposed", [(128, 192, False), (128, 192, True), (256, 64, True)])
def test_fused_mlp_sum_is_the_unfused_mlp(dtype, hidden, intermediate, transposed):
    torch.manual_seed(0)
    x = (torch.randn(1, hidden, device=DEVICE) * 3).to(dtype)
    norm = _norm(hidden, dtype, seed=1)
    gate_up = (torch.randn(2 * intermediate, hidden, device=DEVICE) / hidden ** 0.5).to(dtype)
    down = (torch.randn(hidden, intermediate, device=DEVICE) / intermediate ** 0.5).to(dtype)
    if transposed:                       # [hidden, I] as a view of an [I, hidden] tensor
        down = down.t().contiguous().t()
    expected = _mlp_reference(x, norm, gate_up, down)
    config = dict(BLOCK_J=16, BLOCK_K=64, BLOCK_H=64, PREFETCH_K=64, num_warps=4)
    for prefetch in (64, 0):             # the first gate|up columns read before the loop, or none
        sums = fixed_point.zeros(hidden, DEVICE)
        run = dict(config, PREFETCH_K=prefetch)
        assert fused_mlp(x, norm.weight.detach(), 1e-5, gate_up, down, sums, config=run) is sums
        _close(fixed_point.to_float(sums).to(dtype), expected, dtype)
        # A second output adds to what is pending; integer sums: exactly twice, whatever the order.
        once = sums.clone()
        fused_mlp(x, norm.weight.detach(), 1e-5, gate_up, down, sums, config=run)
        assert torch.equal(sums, 2 * once)


def test_fixed_point_round_trip_is_exact_for_multiples_of_its_step():
    values = torch.tensor([[0.0, 1.5, -3.25, 2.0 ** -32, -(2.0 ** 20), 12345.678]])
    step = 2.0 ** -fixed_point.FRACTION_BITS
    sums = (values.double() / step).round().long()
    assert torch.equal(fixed_point.to_float(sums), values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_residual_epilogue_folds_and_clears_the_pending_sum(dtype):
    """o projection: out = round(x @ W^T) + round(round(pending) + residual); the sum is cleared."""
    torch.manual_seed(2)
    n, k = 64, 128
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    residual = torch.randn(1, n, device=DEVICE).to(dtype)
    pending_value = (torch.randn(1, n, device=DEVICE) * 2).to(dtype)
    sums = (pending_value.double() * 2.0 ** fixed_point.FRACTION_BITS).long()
    folded = (pending_value.float() + residual.float()).to(dtype)
    expected = (F.linear(x.float(), weight.float()).to(dtype).float() + folded.float()).to(dtype)
    got = gemv(x, weight, residual=residual, out=residual, pending=sums)
    assert got.data_ptr() == residual.data_ptr()
    _close(got, expected, dtype)
    assert not sums.any()
    # The first layer of a step: nothing is pending, whatever the buffer holds; it is cleared.
    sums.fill_(12345)
    residual = torch.randn(1, n, device=DEVICE).to(dtype)
    expected = (F.linear(x.float(), weight.float()).to(dtype).float() + residual.float()).to(dtype)
    _close(gemv(x, weight, residual=residual.clone(), pending=sums, fold_pending=False), expected, dtype)
    assert not sums.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_prologue_reads_the_stream_plus_the_pending_sum(dtype):
    torch.manual_seed(3)
    n, k = 32, 128
    stream = torch.randn(1, k, device=DEVICE).to(dtype)
    pending_value = torch.randn(1, k, device=DEVICE).to(dtype)
    sums = (pending_value.double() * 2.0 ** fixed_point.FRACTION_BITS).long()
    norm = _norm(k, dtype, seed=4)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    folded = (pending_value.float() + stream.float()).to(dtype)
    expected = F.linear(norm(folded).float(), weight.float()).to(dtype)
    got = gemv(stream, weight, norm_weight=norm.weight.detach(), eps=1e-5, pending=sums,
               config=dict(BLOCK_N=8, BLOCK_K=64, PREFETCH_K=64))
    _close(got, expected, dtype)
    assert sums.any(), "only the residual epilogue clears the sum"
