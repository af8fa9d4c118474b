"""Linear layers over 4-bit weights with a scale and zero point per group of input channels
(W4A16, `backend.quantization.int4.Int4Weight`'s layout), for steps of several rows: out = x @ W^T
with W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]. One-row steps stream the weight
through the one-token GEMV (`backend.kernels.gemv`) instead.

As the FP8 GEMM (`backend.kernels.fp8_gemm`), a program computes a tile of out^T = W x^T: a
[BLOCK_N, BLOCK_K] weight tile, unpacked in registers (low nibble: input channel 2j, high: 2j + 1),
is the dot's first operand, the step's rows the narrow side; K may be split over programs
(`split_k`). A K tile never straddles two groups (BLOCK_K divides the group size).

Compiled for a CUDA GPU with bfloat16 rows (BF16X2), each byte becomes both its weights'
(q - zero) * scale in one bfloat16 pair by four lines of inline PTX, so the tensor cores add every
K tile into one accumulator and run while the next tile is unpacked. The zero point and the scale
come in one word per row and group (`Int4Weight.scale_zero`), which the load pipeline copies
ahead like the weights. The scale is rounded to bfloat16 (a no-op for a bfloat16 model's, which
`Int4Weight.prepare_for` rounds at load), so each weight is exactly its de-quantized bfloat16
value. The interpreter runs no PTX and keeps a float32 path: q - zero in float32, each K tile's
sum times its scale.
Launch configs per device and shape: `tuning/int4_gemm.json`, from `python -m
benchmarks.quantized_matmul --formats int4_wo --sweep --write-tuning`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from backend.kernels.split_k import SwappedGemmConfig, split_launch, store_tile
from backend.kernels.tuning import compiles_for_gpu, device_name, lookup, rows_bucket, shape_key

Int4GemmConfig = SwappedGemmConfig

# A byte's two nibbles as bfloat16 128 + q (0x4300 | q, exact), both in one word (the byte
# times 0x1001 puts the high nibble at bit 16, one LOP3 masks and ORs), one paired subtraction
# of 128 + z (q - z exactly), one paired multiply by the scale: two weights an instruction each.
_BYTE_TO_BF16X2 = tl.constexpr(
    """{
.reg .b32 t;
mul.lo.u32 t, $2, 4097;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 t, t, $3;
mul.rn.bf16x2 t, t, $4;
mov.b32 {$0, $1}, t;
}"""
)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    scale_zero_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    stride_xm,
    per_split,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16X2: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows and columns past the edge read row 0 (never stored), so the loads need no mask.
    n_in = tl.where(n < N, n, 0).to(tl.int64)
    q_rows = q_ptr + n_in[:, None] * (K // 2)
    x_rows = x_ptr + tl.where(m < M, m, 0).to(tl.int64)[:, None] * stride_xm
    groups = K // GROUP
    k_start = tl.program_id(1) * per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + per_split, K), BLOCK_K):
        packed = tl.load(q_rows + (k0 // 2 + tl.arange(0, HALF))[None, :]).to(tl.int32)
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :])  # [BLOCK_M, BLOCK_K]
        word = tl.load(scale_zero_ptr + n_in * groups + k0 // GROUP)  # `Int4Weight.scale_zero`
        zero = word & 0xFF
        scale = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        if BF16X2:
            bf16 = scale.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            low, high = tl.inline_asm_elementwise(
                _BYTE_TO_BF16X2,
                "=h,=h,r,r,r",
                [packed, ((0x4300 + zero) * 0x10001)[:, None], (bf16 | bf16 << 16)[:, None]],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=1,
            )
            acc = tl.dot(tl.join(low, high).reshape(BLOCK_N, BLOCK_K), tl.trans(x), acc)
        else:
            # No int-to-float conversion per weight: q | 0x4B000000 bitcast is exactly 2^23 + q.
            zf = (zero | 0x4B000000).to(tl.float32, bitcast=True)[:, None]
            low = ((packed & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True) - zf
            high = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - zf
            w = tl.join(low, high).reshape(BLOCK_N, BLOCK_K).to(x.dtype)  # channels 2j, 2j + 1
            acc += scale.to(tl.float32)[:, None] * tl.dot(w, tl.trans(x))
    store_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, m, n, M, N, HAS_BIAS, SPLIT)


def config_key(n: int, k: int, group_size: int, m: int) -> str:
    return shape_key(n=n, k=k, group=group_size, rows=rows_bucket(m))


@functools.lru_cache(maxsize=None)
def _tuned(device: str | None, key: str) -> Int4GemmConfig | None:
    entry = lookup("int4_gemm", key, device)
    return Int4GemmConfig(**entry) if entry is not None else None


def default_config(m: int, n: int, group_size: int) -> Int4GemmConfig:
    """Where the device's table has no entry: narrow projections split K over four programs, so
    their few output tiles still spread over the SMs."""
    return Int4GemmConfig(
        block_m=min(64, rows_bucket(m)), block_k=min(group_size, 128), split=4 if n <= 4096 else 1
    )


def _check(x, qweight, scale_zero, group_size, block_k) -> None:
    n, k = qweight.shape[0], qweight.shape[1] * 2
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1
    assert scale_zero.shape == (n, k // group_size) and scale_zero.dtype == torch.int32
    assert scale_zero.is_contiguous()
    assert group_size % block_k == 0, "a K tile must not straddle two groups"
    assert block_k >= 16, "K tiles are dot operands of 16 or more"


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale_zero: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: Int4GemmConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] -> x @ W^T (+ bias) [M, N] in x's dtype, or written into `out` (contiguous, any
    float dtype: float32 logits skip a rounding and a cast). Config: the given one, the device's
    tuned one, else `default_config`. qweight and scale_zero: `Int4Weight`'s."""
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    key = config_key(n, k, group_size, m)
    c = config or _tuned(device_name(x.device), key) or default_config(m, n, group_size)
    _check(x, qweight, scale_zero, group_size, c.block_k)
    launch = split_launch("int4_gemm", k, c.split, c.block_k, n, c.block_n, x.device, m, c.block_m)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.is_contiguous()
    _int4_gemm_kernel[launch.grid](
        x,
        qweight,
        scale_zero,
        bias if bias is not None else x,
        out,
        *launch.buffers(out),
        m,
        n,
        k,
        x.stride(0),
        launch.per_split,
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BF16X2=compiles_for_gpu(x.device) and x.dtype == torch.bfloat16,
        **c.launch_args(launch.split),
    )
    return out
