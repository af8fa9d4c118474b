"""A model's weights straight from a GGUF file, its quantized blocks kept as they are stored.

Each GGUF tensor is named for its Hugging Face counterpart (`hf_name`). A layer whose tensors are
all blocks of one type in `backend.gguf_blocks` keeps them (`Linear.keep_quantized`,
`Embedding.keep_quantized`); q|k|v and gate|up fuse by stacking rows of blocks. Everything else
(norms, other block types, layers whose parts differ in type) is de-quantized into the model's
dtype, as the cached float32 conversion would hold it.

llama.cpp stores a Llama's q and k projections with the rows of each head interleaved (its
converter's permutation, which transformers undoes when it reads a GGUF); the permutation moves
whole rows, so it is undone on rows of blocks as well as on values. It stores Gemma's norm
weights as 1 + w; they are read back as w (as transformers does), which our norms add 1 to.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from backend.gguf_blocks import BLOCK_TYPES, dequantize
from backend.layers import Embedding, Linear
from backend.model_config import ModelConfig

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
}
_NORM_AFTER_BLOCKS = {  # Gemma 2/3: a norm before and after attention and feed-forward
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES = {"gemma2": _NORM_AFTER_BLOCKS, "gemma3": _NORM_AFTER_BLOCKS}
_UNIT_OFFSET_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_IGNORED = ("rope_freqs.weight",)  # llama3 rope factors: computed from the config instead
_PERMUTED_ARCHITECTURES = ("llama",)  # as transformers reads them


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """A GGUF tensor name of `architecture` -> the Hugging Face name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); ValueError for a name this engine does not know."""
    parts = gguf_name.split(".")
    layer = _LAYER_NAMES.get(architecture, _LAYER)
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for this model")


@dataclass
class GGUFTensor:
    name: str  # the Hugging Face name
    quant_type: str  # "F32", "F16", "Q4_1", ...
    data: np.ndarray  # as stored: values, or uint8 [rows, row bytes] of blocks
    shape: tuple[int, ...]  # the Hugging Face shape (rows first)
    heads: int | None  # q/k of a permuting architecture: the heads whose rows to un-permute
    offset: float = 0.0  # added to the values (-1 for Gemma's norms, stored as 1 + w)

    @property
    def kept(self) -> bool:
        """Whether its blocks can be kept as they are."""
        return self.quant_type in BLOCK_TYPES and len(self.shape) == 2

    def blocks(self) -> torch.Tensor:
        """uint8 [rows, row bytes], in Hugging Face row order."""
        return _unpermute(torch.from_numpy(np.array(self.data)), self.heads)

    def values(self) -> torch.Tensor:
        """The de-quantized float32 values, in Hugging Face order and shape."""
        if self.quant_type in BLOCK_TYPES:
            values = dequantize(torch.from_numpy(np.array(self.data)), self.quant_type)
        else:
            import gguf  # F32, F16, BF16 and the block types decoded only by the package

            raw = gguf.quants.dequantize(
                np.array(self.data), gguf.GGMLQuantizationType[self.quant_type]
            )
            values = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.float32))
        values = _unpermute(values.reshape(self.shape), self.heads)
        return values + self.offset if self.offset else values


def _unpermute(rows: torch.Tensor, heads: int | None) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, its first half of rows and its second
    half were interleaved."""
    if heads is None:
        return rows
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def read_gguf(path: str, config: ModelConfig) -> list[GGUFTensor]:
    """The tensors of the GGUF at `path`, named and shaped for Hugging Face (memory-mapped)."""
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    permuted = architecture in _PERMUTED_ARCHITECTURES
    unit_offset = architecture in _UNIT_OFFSET_ARCHITECTURES
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    tensors = []
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        tensors.append(
            GGUFTensor(
                hf_name(t.name, architecture),
                t.tensor_type.name,
                t.data,
                tuple(int(n) for n in reversed(t.shape)),
                heads.get(kind) if permuted else None,
                -1.0 if unit_offset and t.name.endswith("norm.weight") else 0.0,
            )
        )
    return tensors


Targets = dict[str, tuple[str, tuple[int, int] | None]]


def keep_quantized(
    model: nn.Module, tensors: list[GGUFTensor], dtype: torch.dtype, targets: Targets
) -> Counter:
    """On the model built on the meta device: make each layer whose tensors are all kept blocks of
    one type hold blocks. `targets`: `weight_targets(model)` from before (a layer that keeps
    blocks has no weight parameter). Returns how many layers keep each type."""
    sources = defaultdict(list)
    for t in tensors:
        if t.name in targets:
            sources[targets[t.name][0]].append(t)
    kept = Counter()
    for param_name, parts in sources.items():
        module_name, _, kind = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        types = {t.quant_type for t in parts}
        if kind != "weight" or len(types) != 1 or not all(t.kept for t in parts):
            continue
        (quant_type,) = types
        if isinstance(module, Embedding):
            module.keep_quantized(quant_type, dtype)
        elif isinstance(module, Linear):
            module.keep_quantized(quant_type)
        else:
            continue
        kept[quant_type] += 1
    return kept


def load_gguf_weights(
    model: nn.Module, tensors: list[GGUFTensor], targets: Targets, ignored: tuple[str, ...] = ()
) -> None:
    """Fill the model (on its device, after `keep_quantized` with the same `targets`) from the
    GGUF tensors: blocks into layers that keep them, de-quantized values into the rest. Names in
    `ignored` are skipped. Raises ValueError on an unknown or missing tensor or a wrong shape."""
    loaded = set()
    for t in tensors:
        if t.name in ignored:
            continue
        if t.name not in targets:
            raise ValueError(f"unexpected weight {t.name!r} for this model")
        param_name, rows = targets[t.name]
        module_name, _, kind = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        if kind == "weight" and getattr(module, "quant_type", None) is not None:
            dst, src = module.qweight, t.blocks()
        else:
            dst, src = getattr(module, kind).data, t.values()
        if rows is not None:
            dst = dst.narrow(0, *rows)
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(
                f"weight {t.name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(src)
        loaded.add(t.name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"missing weights: {', '.join(missing[:8])}")
