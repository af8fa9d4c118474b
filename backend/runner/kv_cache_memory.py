"""The paged KV cache's memory: a block's bytes, how a budget of blocks is shared among the KV
cache groups, and the tensors that hold them.

A block holds `tokens_per_block` tokens of every layer: keys and values of each kv head, in the
model dtype or quantized with a scale per token and kv head beside them
(`backend.attention.kv_dtype`). A model mixing global and windowed layers has one tensor per group
(`ModelConfig.kv_cache_groups`, each group its own block ids); a budget counted in blocks of every
layer is shared in proportion to each group's layers times the blocks a request of max_seq_len
holds at once in it (fewer for windowed layers), so every group's pool holds as many such
requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backend.attention.kv_dtype import KV_SCALE_DTYPE, is_scaled, vector_bytes
from backend.model_config import ModelConfig
from backend.scheduling.kv_cache_group import max_blocks_held

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    model_config: ModelConfig
    tokens_per_block: int
    num_kv_heads: int  # of this tensor-parallel rank
    dtype: torch.dtype  # what the cache stores
    device: torch.device

    def block_bytes(self) -> int:
        """One block of every layer (of every group together), scales included."""
        mc = self.model_config
        vectors = mc.num_layers * 2 * self.tokens_per_block * self.num_kv_heads
        return vectors * vector_bytes(mc.head_dim, self.dtype)

    def share(self, budget: int, max_seq_len: int, max_num_tokens: int) -> list[int]:
        """Each group's blocks from `budget` blocks of every layer (see the module docstring)."""
        mc, per_block = self.model_config, self.tokens_per_block
        sinks = -(-mc.sink_token_length // per_block)
        held = [
            max_blocks_held(
                max_seq_len,
                per_block,
                g.window,
                sinks if g.window is not None else 0,
                max_num_tokens,
            )
            for g in mc.kv_cache_groups
        ]
        shares = sum(len(g.layers) * h for g, h in zip(mc.kv_cache_groups, held))
        blocks = [budget * mc.num_layers * h // shares for h in held]
        if min(blocks) < 1:
            raise ValueError("no memory left for the KV cache")
        if any(b < h for b, h in zip(blocks, held)):
            log.warning(
                "the KV cache (%s blocks) cannot hold one sequence of max_seq_len %d",
                " + ".join(map(str, blocks)),
                max_seq_len,
            )
        return blocks

    def allocate(self, group_blocks: list[int]) -> tuple:
        """(cache, scales): per group a [layers, K|V, blocks, offset, kv_head, head_dim] tensor,
        with several groups each layer's view in layer order; the scales of a quantized cache
        alike, without head_dim (else None)."""
        mc = self.model_config
        block = (self.tokens_per_block, self.num_kv_heads, mc.head_dim)
        # Zeroed on the host too: the pages are committed now, so a cache too large fails at
        # start and the process does not grow under load as blocks are first touched.
        caches, scales = [], []
        for group, n in zip(mc.kv_cache_groups, group_blocks):
            shape = (len(group.layers), 2, n, *block)
            if not is_scaled(self.dtype):
                caches.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                continue
            # one-byte values, zeroed as bytes (fill has no float8 kernels everywhere)
            raw = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            caches.append(raw.view(self.dtype))
            scales.append(torch.zeros(shape[:-1], dtype=KV_SCALE_DTYPE, device=self.device))
        return self._by_layer(caches), self._by_layer(scales)

    def _by_layer(self, tensors: list[torch.Tensor]):
        """One group's tensor as it is; several groups' as each layer's view, in layer order."""
        if not tensors:
            return None
        if len(tensors) == 1:
            return tensors[0]
        groups = self.model_config.kv_cache_groups
        per_layer = {
            layer: t[j] for g, t in zip(groups, tensors) for j, layer in enumerate(g.layers)
        }
        return tuple(per_layer[layer] for layer in range(self.model_config.num_layers))
