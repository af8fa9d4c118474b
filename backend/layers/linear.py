"""Linear layers: the one place a projection's weights are read, so quantized weights plug in here
(a quantized layer keeps this interface and brings its own kernels).

Quantized, a layer holds a `backend.quantization.QuantizedWeight` (`quantized`: GGUF blocks,
int8, int4 or fp8) instead of `weight`; its `matmul` runs the product (the format's kernels on
GPU, de-quantize then matmul on CPU) and `dense_weight` de-quantizes it.

Steps of several tokens run torch's GEMM (or the format's). One-token steps on GPU run the
weight-streaming GEMV (`backend.kernels.gemv`) with the neighbouring work fused in: an RMSNorm or
silu·mul prologue, a residual-add epilogue, split attention merged as it is read, or (the qkv
projection) rotary and the KV-cache write (`backend.kernels.qkv_rope`); int8, e4m3 and 4-bit
weights stream through the same kernels, de-quantized in registers (`StreamedWeight`).

Tensor parallel (`backend.distributed.tensor_parallel`): a column-parallel layer holds its rank's
output rows (of each fused projection), a row-parallel one its input columns and all-reduces its
partial sums before adding the bias; `shard_of` cuts a full checkpoint tensor down to the rank's
part.

LoRA (`backend.lora`): a layer given adapter slots (`lora`) adds, in a step with adapter rows, each
row's adapter product to its output; such steps run eagerly (no one-token kernels, no e4m3 rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.distributed.tensor_parallel import TensorParallel
from backend.kernels.gemv_weight import StreamedWeight
from backend.kernels.split_partials import SplitPartials
from backend.layers.norm import RMSNorm
from backend.lora.linear_lora import LinearLora
from backend.quantization import E4m3Rows, GGUFWeight, QuantizedWeight

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
        self.quantized: QuantizedWeight | None = None  # in place of `weight` when quantized
        self.tp = TensorParallel()
        self.parallel: str | None = None  # "column" | "row" across the ranks of `tp`
        # column: each projection's first row in its full tensor; row: the first input column
        self.full_start: dict[str | None, int] | int = 0
        # column, from a fused checkpoint tensor: (first row, rows) of each of its parts
        self.fused_parts: list[tuple[int, int]] | None = None
        self.lora: LinearLora | None = None  # adapter slots, where LoRA is served

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
        fused: bool = False,
    ) -> "Linear":
        """A column-parallel layer of the projections `parts` (Hugging Face name -> (first row,
        rows) of this rank's part of its full tensor), fused in order. `fused`: the checkpoint
        stores the parts as one tensor (Phi-3), their first rows counted in it."""
        sizes = {name: rows for name, (_, rows) in parts.items()}
        if fused:
            layer = cls(in_features, sum(sizes.values()), bias)
        else:
            layer = cls.merged(in_features, sizes, bias)
        if tp.enabled:
            layer.tp, layer.parallel = tp, "column"
            layer.full_start = {name: first for name, (first, _) in parts.items()}
            if fused:
                layer.fused_parts = list(parts.values())
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
        if self.parallel == "column" and self.fused_parts is not None:
            return torch.cat([full.narrow(0, first, rows) for first, rows in self.fused_parts])
        if self.parallel == "column":
            rows = self.shards[projection][1] if self.shards else self.out_features
            return full.narrow(0, self.full_start[projection], rows)
        if self.parallel == "row" and kind == "weight":
            return full.narrow(1, self.full_start, self.in_features)
        return full

    def set_quantized(self, quantized: QuantizedWeight) -> None:
        """Hold `quantized` (of this layer's shape) in place of the weight from now on."""
        assert (quantized.out_features, quantized.in_features) == (
            self.out_features,
            self.in_features,
        )
        self.weight = None
        self.quantized = quantized

    def keep_quantized(self, quant_type: str, qweight: torch.Tensor | None = None) -> None:
        """Hold the weight as GGUF `quant_type` blocks: `qweight` (shared, e.g. a tied
        embedding's), else a new uninitialised uint8 [out_features, row bytes] to be filled."""
        device = (self.weight if self.quantized is None else self.qweight).device
        shape = (self.out_features, self.in_features)
        self.set_quantized(GGUFWeight(*shape, quant_type, qweight, device=device))

    @property
    def quant_type(self) -> str | None:
        """The GGUF block type of a layer keeping GGUF blocks."""
        return self.quantized.quant_type if isinstance(self.quantized, GGUFWeight) else None

    @property
    def qweight(self) -> torch.Tensor:
        return self.quantized.qweight

    def tie_to(self, embedding) -> None:
        """Share the weight of `embedding` (an `Embedding`), quantized or not."""
        if embedding.quant_type is None:
            self.weight = embedding.weight
            self.quantized = None
        else:
            self.keep_quantized(embedding.quant_type, embedding.qweight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a [out_features, in_features] tensor (de-quantized into `dtype`)."""
        if self.quantized is None:
            return self.weight
        return self.quantized.dequantize(dtype)

    def forward(self, x: torch.Tensor | E4m3Rows) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]; x may be rows its producer quantized for this
        layer's scaled GEMM (where `takes_e4m3_rows`)."""
        if isinstance(x, E4m3Rows):  # never with LoRA slots (`takes_e4m3_rows`)
            return self.quantized.matmul_e4m3(x.values, x.scales, self.bias, x.dtype)
        if self.parallel == "row":  # the bias once, after the partial sums
            y = self.tp.matmul_all_reduce(x, self.dense_weight(x.dtype))
            y = y if self.bias is None else y + self.bias
        elif self.quantized is not None:
            y = self.quantized.matmul(x, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_to(y, x)

    def takes_e4m3_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward` would quantize x's rows to e4m3 (an `fp8` weight's scaled GEMM), so
        the producer of x may hand them over quantized instead (`E4m3Rows`)."""
        return (
            self.parallel != "row"
            and self.lora is None  # the adapters' product reads x itself
            and self.quantized is not None
            and self.quantized.takes_e4m3_rows(x)
        )

    def streamed(self) -> StreamedWeight | None:
        """The weight as the one-token kernels stream it (None: a format they do not read)."""
        return StreamedWeight(self.weight) if self.quantized is None else self.quantized.streamed()

    def takes_one_token(self, x: torch.Tensor) -> bool:
        """Whether `one_token` runs for x: one half-precision row on GPU, K in 64-wide tiles, a
        weight the kernels stream (half precision, int8, e4m3 or 4-bit)."""
        streamed = self.streamed()
        return (
            gemv is not None
            and x.is_cuda
            and streamed is not None
            and self.parallel != "row"  # its residual epilogue would add partial sums
            and (self.lora is None or self.lora.context.batch is None)  # adapters: eager
            and gemv.supports(x, streamed)
        )

    def merges_splits(self, head_dim: int) -> bool:
        """Whether `one_token` can take split attention partials with heads of `head_dim`."""
        return gemv.takes_partials(self.streamed(), head_dim)

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
            return gemv.gemv(
                None, self.streamed(), self.bias, partials=x, residual=residual, out=out
            )
        return gemv.gemv(
            x,
            self.streamed(),
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
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The qkv projection of norm(x) for one row, q and k rotated (`rotation`, this step's
        positions and cos/sin cache), the new keys and values stored at `slot_mapping` (unless
        the caches are None), in one kernel -> qkv [1, (heads + 2 kv_heads) * head_dim]."""
        return qkv_rope_gemv(
            x,
            self.streamed(),
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
