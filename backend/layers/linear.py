"""Linear layers: the one place a projection's weights are read, so quantized weights plug in here
(a quantized layer keeps this interface and brings its own kernels).

Kept quantized (`keep_quantized`), a layer holds GGUF blocks (`qweight`, uint8 [out, row bytes],
`backend.gguf_blocks`) instead of `weight`; steps de-quantize them into the activations' dtype as
they run, the same values a de-quantized checkpoint holds.

Steps of several tokens run torch's GEMM. One-token steps on GPU run the weight-streaming GEMV
(`backend.kernels.gemv`) with the neighbouring work fused in: an RMSNorm or silu·mul prologue, a
residual-add epilogue, split attention merged as it is read, or (the qkv projection) rotary and
the KV-cache write (`backend.kernels.qkv_rope`).

Tensor parallel (`backend.tensor_parallel`): a column-parallel layer holds its rank's output rows
(of each fused projection), a row-parallel one its input columns and all-reduces its partial
sums before adding the bias; `shard_of` cuts a full checkpoint tensor down to the rank's part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.attention.split_partials import SplitPartials
from backend.gguf_blocks import BLOCK_TYPES, dequantize
from backend.layers.norm import RMSNorm
from backend.tensor_parallel import TensorParallel

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import gemv
    from backend.kernels.qkv_rope import qkv_rope_gemv
except ImportError:
    gemv = qkv_rope_gemv = None

# Wider models' decoder layers keep cuBLAS at one token: there it streams big weights faster than
# the GEMV (measurements in benchmarks/README.md, "The one-token path").
ONE_TOKEN_MAX_HIDDEN = 2048


class Linear(nn.Module):
    """y = x @ weight^T (+ bias). `shards`, for several projections of one input fused in one
    weight (q|k|v, gate|up): each Hugging Face projection name -> (first row, rows)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str, tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = shards
        self.quant_type: str | None = None  # a GGUF block type when kept quantized
        self.tp = TensorParallel()
        self.parallel: str | None = None  # "column" | "row" across the ranks of `tp`
        # column: each projection's first row in its full tensor; row: the first input column
        self.full_start: dict[str | None, int] | int = 0

    @classmethod
    def merged(cls, in_features: int, sizes: dict[str, int], bias: bool = False) -> "Linear":
        """One layer for the projections `sizes` (Hugging Face name -> output rows), in order."""
        shards, start = {}, 0
        for name, size in sizes.items():
            shards[name] = (start, size)
            start += size
        return cls(in_features, start, bias, shards)

    @classmethod
    def column(
        cls,
        in_features: int,
        parts: dict[str, tuple[int, int]],
        tp: TensorParallel,
        bias: bool = False,
    ) -> "Linear":
        """A column-parallel layer of the projections `parts` (Hugging Face name -> (first row,
        rows) of this rank's part of its full tensor), fused in order."""
        layer = cls.merged(in_features, {name: rows for name, (_, rows) in parts.items()}, bias)
        if tp.enabled:
            layer.tp, layer.parallel = tp, "column"
            layer.full_start = {name: first for name, (first, _) in parts.items()}
        return layer

    @classmethod
    def row(
        cls, in_features: int, out_features: int, tp: TensorParallel, bias: bool = False
    ) -> "Linear":
        """A row-parallel layer: this rank's `in_features` share of the input columns."""
        layer = cls(in_features // tp.size, out_features, bias)
        if tp.enabled:
            layer.tp, layer.parallel = tp, "row"
            layer.full_start = tp.part(in_features, "projection inputs")[0]
        return layer

    def shard_of(self, projection: str | None, kind: str, full: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor (`kind` "weight" or "bias" of `projection`, a
        name of `shards`) that this rank holds."""
        if self.parallel == "column":
            rows = self.shards[projection][1] if self.shards else self.out_features
            return full.narrow(0, self.full_start[projection], rows)
        if self.parallel == "row" and kind == "weight":
            return full.narrow(1, self.full_start, self.in_features)
        return full

    def keep_quantized(self, quant_type: str, qweight: torch.Tensor | None = None) -> None:
        """Hold the weight as `quant_type` blocks from now on: `qweight` (shared, e.g. a tied
        embedding's), else a new uninitialised uint8 [out_features, row bytes] to be filled."""
        device = (self.weight if self.quant_type is None else self.qweight).device
        if qweight is None:
            row_bytes = BLOCK_TYPES[quant_type].row_bytes(self.in_features)
            qweight = torch.empty(self.out_features, row_bytes, dtype=torch.uint8, device=device)
        self.weight = None
        self.register_buffer("qweight", qweight)
        self.quant_type = quant_type

    def tie_to(self, embedding) -> None:
        """Share the weight of `embedding` (an `Embedding`), quantized or not."""
        if embedding.quant_type is None:
            self.weight = embedding.weight
        else:
            self.keep_quantized(embedding.quant_type, embedding.qweight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a [out_features, in_features] tensor (de-quantized into `dtype`)."""
        if self.quant_type is None:
            return self.weight
        return dequantize(self.qweight, self.quant_type).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row":  # the bias once, after the partial sums
            y = self.tp.all_reduce(F.linear(x, self.dense_weight(x.dtype)))
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def takes_one_token(self, x: torch.Tensor) -> bool:
        """Whether `one_token` runs for x: one half-precision row on GPU, K in 64-wide tiles."""
        return (
            gemv is not None
            and x.is_cuda
            and self.quant_type is None
            and self.parallel != "row"  # its residual epilogue would add partial sums
            and gemv.supports(x, self.weight)
        )

    def merges_splits(self, head_dim: int) -> bool:
        """Whether `one_token` can take split attention partials with heads of `head_dim`."""
        return gemv.takes_partials(self.weight, head_dim)

    def one_token(
        self,
        x: torch.Tensor | SplitPartials,
        *,
        norm: RMSNorm | None = None,
        silu_mul: bool = False,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This layer for one row in one kernel. x [1, K], or [1, 2K] gate | up with `silu_mul`
        (the operand is silu(gate) * up), or split attention partials (merged as read).
        `norm` (an RMSNorm): the operand is norm(x). `residual` [1, N]: added to the result;
        `out=residual` updates it in place. `out` may be float32 (logits)."""
        if isinstance(x, SplitPartials):
            return gemv.gemv(None, self.weight, self.bias, partials=x, residual=residual, out=out)
        return gemv.gemv(
            x,
            self.weight,
            self.bias,
            norm_weight=None if norm is None else norm.weight,
            eps=0.0 if norm is None else norm.eps,
            silu_mul=silu_mul,
            residual=residual,
            out=out,
        )

    def one_token_qkv(
        self,
        x: torch.Tensor,
        norm: RMSNorm,
        *,
        num_heads: int,
        num_kv_heads: int,
        rotation,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The qkv projection of norm(x) for one row, q and k rotated (`rotation`, this step's
        positions and cos/sin cache), the new keys and values stored at `slot_mapping`, in one
        kernel -> qkv [1, (heads + 2 kv_heads) * head_dim]."""
        return qkv_rope_gemv(
            x,
            self.weight,
            self.bias,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            cos_sin=rotation.cos_sin,
            positions=rotation.positions,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=slot_mapping,
            norm_weight=norm.weight,
            eps=norm.eps,
        )
