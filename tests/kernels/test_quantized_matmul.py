"""The quantized linear kernels against the torch path (de-quantize, then matmul) within 1e-3
relative, under the interpreter on CPU: the W8A16 (int8 and e4m3 weights) and W4A16 (int4)
batched GEMMs and the FP8 W8A8 GEMM (of the per-token quantized activations) in float32; the
one-token GEMV streaming int8, e4m3 and 4-bit weights with its fusions, in half precision; the
FP8 row quantizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.kernels import fp8_gemm  # noqa: E402
from backend.kernels.arrivals import arrival_counters  # noqa: E402
from backend.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear  # noqa: E402
from backend.kernels.gemv import gemv, supports, takes_partials  # noqa: E402
from backend.kernels.int4_matmul import Int4GemmConfig, int4_gemm  # noqa: E402
from backend.kernels.split_partials import SplitPartials  # noqa: E402
from backend.kernels.w8a16_gemm import GemmConfig, w8a16_gemm  # noqa: E402
from backend.quantization import Fp8Weight, Int4Weight, Int8Weight  # noqa: E402
from backend.quantization.fp8 import quantize_rows  # noqa: E402
from backend.quantization.int4_packing import quantize_groups  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpretable_triton_language")


def _relative_close(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-3) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=rtol * scale)


def _int8(n: int, k: int, seed: int) -> Int8Weight:
    torch.manual_seed(seed)
    return Int8Weight.quantize(torch.randn(n, k)).to(DEVICE)


def _int4(n: int, k: int, group: int, seed: int, symmetric: bool = False) -> Int4Weight:
    torch.manual_seed(seed)
    q, z, scales = quantize_groups(torch.randn(n, k), group, symmetric)
    weight = Int4Weight(n, k, group)
    for name, value in Int4Weight.rows(q, z, scales).items():
        getattr(weight, name).copy_(value)
    return weight.to(DEVICE)


@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (33, 64, 64)])
@pytest.mark.parametrize("fmt", [Int8Weight, Fp8Weight])
def test_w8a16_gemm_is_dequantize_then_matmul(m, n, k, fmt):
    """int8 and e4m3 weights; default tiles, narrow tiles, and K split over 2 and 3 programs
    (k_per_split 64 / 32: the last split shorter or empty of whole tiles, K masked)."""
    torch.manual_seed(m)
    w = fmt.quantize(torch.randn(n, k)).to(DEVICE)
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    expected = F.linear(x, w.dequantize(torch.float32), bias)
    _relative_close(w8a16_gemm(x, w.qweight, w.scales, bias), expected)
    for config in (
        GemmConfig(block_m=16, block_n=16),
        GemmConfig(block_m=16, block_n=32, block_k=32, split=2),
        GemmConfig(block_m=32, block_n=16, block_k=32, split=3),
    ):
        _relative_close(w8a16_gemm(x, w.qweight, w.scales, bias, config), expected)
    _relative_close(w8a16_gemm(x, w.qweight, w.scales, None, config), expected - bias)


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("m", [3, 20])
def test_int4_gemm_is_dequantize_then_matmul(group, m):
    """Default tiles (K split over four programs), narrow tiles, K split over 3 (the last split
    shorter), columns and rows past the tiles' edges."""
    n, k = 48, 512
    w = _int4(n, k, group, seed=m)
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    expected = F.linear(x, w.dequantize(torch.float32), bias)
    args = (w.qweight, w.scale_zero, group, bias)
    _relative_close(int4_gemm(x, *args), expected)
    for config in (
        Int4GemmConfig(block_n=16, block_m=16, block_k=32),
        Int4GemmConfig(block_n=32, block_m=32, block_k=64, split=3),
    ):
        _relative_close(int4_gemm(x, *args, config), expected)
    assert not arrival_counters("int4_gemm", x.device, 64).any()  # ready for the next launch


@pytest.mark.skipif(DEVICE == "cpu", reason="inline PTX; the interpreter's bfloat16 dot is wrong")
@pytest.mark.parametrize("m", [3, 70])
def test_int4_gemm_of_bfloat16_rows_is_dequantize_then_matmul(m):
    """bfloat16 rows, which a GPU unpacks into bfloat16 pairs of (q - z) * scale (inline PTX):
    with the scales of a bfloat16 model (`prepare_for`), those are exactly the de-quantized
    bfloat16 weights, so only the order of the float32 sums differs from the matmul over them."""
    n, k, group = 40, 512, 128
    w = _int4(n, k, group, seed=m)
    w.prepare_for(torch.bfloat16)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    expected = F.linear(x.float(), w.dequantize(torch.bfloat16).float())
    got = int4_gemm(x, w.qweight, w.scale_zero, group)
    assert got.dtype == torch.bfloat16
    _relative_close(got, expected, rtol=2**-8)
    logits = torch.empty(m, n, dtype=torch.float32, device=DEVICE)  # no rounding to bfloat16
    assert int4_gemm(x, w.qweight, w.scale_zero, group, out=logits) is logits
    _relative_close(logits, expected, rtol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 48, 256), (70, 24, 128), (16, 64, 8192)])
def test_fp8_gemm_is_the_torch_path(m, n, k):
    """Masked rows, columns and K (96 < one 128-wide K tile); K split over 2 and 3 programs (the
    last split shorter), whose partial sums the last program of each tile to arrive adds; a long
    K (Llama-3.2-1B's down projection), whose sum on a GPU must not lose the tensor cores' bits."""
    torch.manual_seed(m)
    weight = Fp8Weight.quantize(torch.randn(n, k))
    x = torch.randn(m, k)
    x[0] *= 100  # per-token scales
    bias = torch.randn(n)
    expected = weight.matmul(x, bias)  # the CPU torch path
    weight, x, bias = weight.to(DEVICE), x.to(DEVICE), bias.to(DEVICE)
    xq, x_scales = quantize_rows(x)
    args = (xq, x_scales, weight.qweight, weight.scales, bias)
    _relative_close(fp8_linear(*args, out_dtype=x.dtype).cpu(), expected)
    for config in (
        Fp8GemmConfig(block_n=16, block_m=16, block_k=32),
        Fp8GemmConfig(block_n=64, block_m=16, block_k=32, split=2),
        Fp8GemmConfig(block_n=16, block_m=32, block_k=32, split=3),
    ):
        _relative_close(fp8_linear(*args, out_dtype=x.dtype, config=config).cpu(), expected)
    assert not arrival_counters("fp8_gemm", xq.device, 64).any()  # ready for the next launch
    out = torch.empty(m, n, device=DEVICE)
    assert fp8_linear(*args, out_dtype=out.dtype, out=out) is out
    _relative_close(out.cpu(), expected)
    # without a bias torch's scaled GEMM (on a GPU) writes `out` itself, as a float32 head does
    out = torch.empty(m, n, dtype=torch.float32, device=DEVICE)
    assert fp8_linear(*args[:4], out_dtype=torch.float32, out=out) is out
    _relative_close(out.cpu(), expected - bias.cpu())


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's scaled GEMM runs on a GPU")
def test_fp8_fast_accumulation_stays_within_the_rounding_of_the_output():
    """torch's scaled GEMM summing in the tensor cores' accumulator (`fp8_fast_accumulation`) at
    a long K: within a few bf16 roundings of the promoted sum, and not the same call."""
    torch.manual_seed(0)
    m, n, k = 256, 512, 14336
    weight = Fp8Weight.quantize(torch.randn(n, k)).to(DEVICE)
    xq, x_scales = quantize_rows(torch.randn(m, k, device=DEVICE))
    args = (xq, x_scales, weight.qweight, weight.scales, None)
    promoted = fp8_linear(*args, out_dtype=torch.bfloat16)
    fast = fp8_linear(*args, out_dtype=torch.bfloat16, fast_accumulation=True)
    _relative_close(fast, promoted, rtol=1e-2)
    assert not torch.equal(fast, promoted)


def test_every_tuned_fp8_gemm_config_is_the_torch_path():
    """Each distinct config of the devices' tables (tiles, K splits; stages and warps do not
    change the sum), on a product large enough for its tiles, with rows past the edge."""
    from backend.kernels import tuning

    tables = tuning.table("fp8_gemm").values()
    shapes = {
        (c["block_n"], c["block_m"], c["block_k"], c["split"])
        for table in tables
        for c in table["configs"].values()
    }
    assert shapes, "the table has entries"
    for block_n, block_m, block_k, split in sorted(shapes):
        n, k, m = block_n + 8, block_k * split * 2, block_m + 3
        weight, x = _fp8(n, k, seed=block_n), torch.randn(m, k, device=DEVICE)
        xq, x_scales = quantize_rows(x)
        expected = (xq.float() @ weight.qweight.float().t()) * x_scales * weight.scales
        config = Fp8GemmConfig(block_n, block_m, block_k, split)
        got = fp8_linear(
            xq, x_scales, weight.qweight, weight.scales, out_dtype=x.dtype, config=config
        )
        _relative_close(got, expected)


def test_every_tuned_int4_gemm_config_is_dequantize_then_matmul():
    """Each distinct config of the devices' 4-bit tables, as the fp8 test above."""
    from backend.kernels import tuning

    shapes = {
        (c["block_n"], c["block_m"], c["block_k"], c["split"])
        for table in tuning.table("int4_gemm").values()
        for c in table["configs"].values()
    }
    assert shapes, "the table has entries"
    for block_n, block_m, block_k, split in sorted(shapes):
        n, k, m = block_n + 8, block_k * split * 2, block_m + 3
        weight, x = _int4(n, k, block_k, seed=block_n), torch.randn(m, k, device=DEVICE)
        # One stage: float32 rows at the table's stages would overflow a GPU's shared memory.
        config = Int4GemmConfig(block_n, block_m, block_k, split, num_stages=1)
        got = int4_gemm(x, weight.qweight, weight.scale_zero, block_k, None, config)
        _relative_close(got, F.linear(x, weight.dequantize(torch.float32)))


def _fp8(n: int, k: int, seed: int) -> Fp8Weight:
    torch.manual_seed(seed)
    return Fp8Weight.quantize(torch.randn(n, k)).to(DEVICE)


# Each one-token format: (weight, its one-row product's reference: the de-quantized weight,
# activations unquantized; fp8's one row is W8A16).
ONE_TOKEN_FORMATS = {
    "int8": lambda n, k: _int8(n, k, seed=n),
    "fp8": lambda n, k: _fp8(n, k, seed=n),
    "int4g64": lambda n, k: _int4(n, k, 64, seed=n),
    "int4g32sym": lambda n, k: _int4(n, k, 32, seed=n, symmetric=True),
}


@pytest.mark.parametrize("fmt", ONE_TOKEN_FORMATS)
def test_one_token_gemv_streams_quantized_weights_with_its_fusions(fmt):
    """Plain with bias; RMSNorm prologue with the residual added in place; silu·mul prologue.
    40 rows: the last tile of 16 is masked."""
    n, k = 40, 128
    weight = ONE_TOKEN_FORMATS[fmt](n, k)
    streamed = weight.streamed()
    dense = weight.dequantize(torch.float32)
    torch.manual_seed(1)
    x = torch.randn(1, 2 * k, device=DEVICE).half()
    bias = torch.randn(n, device=DEVICE).half()
    assert supports(x[:, :k], streamed) and not supports(x[:, :k].float(), streamed)

    plain = gemv(x[:, :k], streamed, bias)
    assert plain.dtype == torch.float16
    _relative_close(plain, F.linear(x[:, :k].float(), dense, bias.float()))

    norm_w = torch.rand(k, device=DEVICE).half() + 0.5
    normed = x[:, :k].float() * torch.rsqrt(x[:, :k].float().pow(2).mean() + 1e-5) * norm_w
    residual = torch.randn(1, n, device=DEVICE).half()
    expected = F.linear(normed, dense) + residual.float()
    got = gemv(x[:, :k], streamed, norm_weight=norm_w, eps=1e-5, residual=residual, out=residual)
    assert got.data_ptr() == residual.data_ptr()
    _relative_close(got, expected, rtol=2e-3)  # two fp16 roundings: product, then the sum

    gate, up = x.float().chunk(2, dim=-1)
    activated = (F.silu(gate).half().float() * up).half().float()
    _relative_close(gemv(x, streamed, silu_mul=True), F.linear(activated, dense))


@pytest.mark.parametrize("group", [64, 128])
def test_one_token_gemv_sums_4bit_groups_over_k_tiles(group):
    """4-bit rows over several K tiles of one or more groups, at the tile shapes the sweep tries
    (rows a program up to 32, some of them masked), against de-quantize-then-matmul."""
    n, k = 72, 1024
    weight = _int4(n, k, group, seed=5)
    dense = weight.dequantize(torch.float32)
    torch.manual_seed(2)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    expected = F.linear(x.float(), dense)
    for block_n, block_k in ((8, 256), (32, 256), (16, 512), (16, 1024)):
        config = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
        _relative_close(gemv(x, weight.streamed(), config=config), expected, rtol=8e-3)


def test_one_token_gemv_4bit_operand_of_any_magnitude():
    """Operand columns from 1e-4 to 3e4, as outlier features make them (a compiled GPU sums each
    word's products in float16, its eight operand columns scaled by a power of two into range):
    still de-quantize-then-matmul, with and without the norm."""
    n, k = 40, 512
    weight = _int4(n, k, 128, seed=9)
    dense = weight.dequantize(torch.float32)
    torch.manual_seed(3)
    magnitude = 10.0 ** torch.empty(1, k).uniform_(-4, 4.5)
    x = (torch.randn(1, k) * magnitude).to(DEVICE).to(torch.bfloat16)
    _relative_close(gemv(x, weight.streamed()), F.linear(x.float(), dense), rtol=8e-3)
    norm_w = torch.rand(k, device=DEVICE).to(torch.bfloat16) + 0.5
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * norm_w.float()
    got = gemv(x, weight.streamed(), norm_weight=norm_w, eps=1e-5)
    _relative_close(got, F.linear(normed, dense), rtol=8e-3)


@pytest.mark.parametrize("split", [2, 3, 4])
def test_one_token_gemv_splits_4bit_k_over_programs(split):
    """K split over programs (3 leaves a shorter last split): the last program of a column block
    adds the partial sums and writes the result, residual added in place; the same with the
    silu·mul operand; and the arrival counters are back at zero for the next launch."""
    from backend.kernels.arrivals import arrival_counters

    n, k = 40, 1024
    weight = _int4(n, k, 128, seed=7)
    dense = weight.dequantize(torch.float32)
    torch.manual_seed(4)
    x = torch.randn(1, 2 * k, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn(1, n, device=DEVICE).to(torch.bfloat16)
    expected = F.linear(x[:, :k].float(), dense) + residual.float()
    config = dict(BLOCK_N=16, BLOCK_K=256, SPLIT=split)
    got = gemv(x[:, :k], weight.streamed(), residual=residual, out=residual, config=config)
    assert got.data_ptr() == residual.data_ptr()
    _relative_close(got, expected, rtol=1.6e-2)
    gate, up = x.float().chunk(2, dim=-1)
    activated = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
    _relative_close(
        gemv(x, weight.streamed(), silu_mul=True, config=config),
        F.linear(activated, dense),
        rtol=8e-3,
    )
    assert not arrival_counters("gemv", torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4g64", "int4g32sym"])
def test_one_token_gemv_merges_split_attention_into_quantized_rows(fmt):
    """The o projection at batch 1: split partials merged as the operand is read, rounded to the
    residual's dtype, then times the de-quantized weight (4-bit rows: K tiles of whole groups,
    also with K split over programs)."""
    heads, splits, head_dim, n = 4, 3, 32, 24
    k = heads * head_dim
    weight = ONE_TOKEN_FORMATS[fmt](n, k)
    torch.manual_seed(2)
    parts = torch.randn(1, heads, splits, head_dim, device=DEVICE)
    lse = torch.randn(1, heads, splits, device=DEVICE)
    lse[0, 1, 2] = float("-inf")  # a split without keys
    weights = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=-1)
    merged = (weights[..., None] * torch.nan_to_num(parts)).sum(2).reshape(1, k).half()
    residual = torch.randn(1, n, device=DEVICE).half()
    expected = F.linear(merged.float(), weight.dequantize(torch.float32)) + residual.float()
    configs = [dict(BLOCK_N=8, BLOCK_K=64, PREFETCH_K=64)]
    if fmt.startswith("int4"):
        configs += [dict(BLOCK_N=16, BLOCK_K=64, SPLIT=2), dict(BLOCK_N=8, BLOCK_K=128)]
    for config in configs:
        got = gemv(
            None,
            weight.streamed(),
            partials=SplitPartials(parts, lse),
            residual=residual.clone(),
            config=config,
        )
        _relative_close(got, expected, rtol=2e-3)
    assert takes_partials(weight.streamed(), head_dim)


@pytest.mark.parametrize("m,k", [(1, 96), (5, 2048), (3, 5000)])
def test_fp8_row_quantizer_is_the_torch_path(m, k):
    """One kernel per row against `quantize_rows`' torch code: the same scales, values within one
    e4m3 step (division may round differently at a tie). The values on a GPU only: the
    interpreter's float32 -> e4m3 conversion is wrong near 128 (-126.8 gives -64 in triton 3.6)."""
    torch.manual_seed(k)
    x = torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, m, device=DEVICE)[:, None]
    values, scales = fp8_gemm.quantize_rows(x)
    expected_values, expected_scales = quantize_rows(x)
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    if DEVICE == "cpu":
        return
    step = expected_values.float().abs() / 8  # e4m3 keeps 3 mantissa bits
    assert ((values.float() - expected_values.float()).abs() <= step + 2**-9).all()


def test_every_tuned_w8a16_config_computes_the_product():
    """The configs the sweeps wrote (`tuning/w8a16_gemm.json`), whatever device they are for,
    give the de-quantized product here too: a table entry cannot name a broken launch."""
    from backend.kernels.tuning import table

    configs = {
        tuple(sorted(entry.items()))
        for device in table("w8a16_gemm").values()
        for entry in device["configs"].values()
    }
    assert configs
    w = Fp8Weight.quantize(torch.randn(40, 96)).to(DEVICE)
    # The activations' dtype on a GPU (its shared memory holds bf16 tiles; float32 ones may not
    # fit), float32 under the interpreter.
    dtype = torch.bfloat16 if torch.device(DEVICE).type == "cuda" else torch.float32
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    expected = F.linear(x.float(), w.dequantize(torch.float32))
    for entry in configs:
        got = w8a16_gemm(x, w.qweight, w.scales, None, GemmConfig(**dict(entry)))
        _relative_close(got, expected, rtol=1e-3 if dtype == torch.float32 else 1e-2)
