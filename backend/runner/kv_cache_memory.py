"""The paged KV cache's memory: a block's bytes, the budget of blocks, how it is shared among the
KV cache groups, and the tensors that hold them.

The tensors: kv_cache[layer, 0 | 1, block, offset, kv_head, head_dim] (0 = K, 1 = V), in the
model dtype, or quantized (`kv_cache_dtype` fp8 / int8) with their scales beside them in
kv_scales[layer, 0 | 1, block, offset, kv_head]; a model with several KV cache groups has a
tensor per group, `kv_cache` then indexed by layer through a tuple of views, and a block table
per group in each step (`AttentionMetadata.for_group`).

A block holds `tokens_per_block` tokens of every layer: keys and values of each kv head, in the
model dtype or quantized with a scale per token and kv head beside them
(`backend.attention.kv_dtype`). A model mixing global and windowed layers has one tensor per group
(`ModelConfig.kv_cache_groups`, each group its own block ids); a budget counted in blocks of every
layer is shared in proportion to each group's layers times the blocks a request of max_seq_len
holds at once in it (fewer for windowed layers), so every group's pool holds as many such
requests.

Blocks are counted from their real bytes, scales included, so a quantized cache holds more of
them in the same memory. The budget (`pick_group_blocks`): `max_tokens_in_paged_kv_cache` when
set; on CUDA otherwise `kv_cache_free_gpu_mem_fraction` of the memory left free after a warm-up
step of `max_num_tokens` tokens (its peak activations set aside); on CPU enough for
`max_batch_size` sequences of `max_seq_len` tokens (at most CPU_KV_CACHE_SEQ_LEN each), at most
CPU_KV_CACHE_CAP_BYTES.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.attention.kv_dtype import KV_SCALE_DTYPE, is_scaled, vector_bytes
from backend.config import EngineConfig
from backend.model_config import ModelConfig
from backend.request import Chunk
from backend.scheduling.kv_cache_group import max_blocks_held

log = logging.getLogger(__name__)

CPU_KV_CACHE_SEQ_LEN = 8192  # a CPU pool holds max_batch_size sequences of at most this
CPU_KV_CACHE_CAP_BYTES = 4 << 30
# (the largest step's chunks, each group's blocks): run them on a temporary cache of that many
# blocks, with the logits of a full decode batch, then drop the cache.
WarmUp = Callable[[list[Chunk], list[int]], None]


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


def pick_group_blocks(
    layout: KVCacheLayout,
    config: EngineConfig,
    max_seq_len: int,
    warm_up: WarmUp,
    graph_pool: bool,
) -> list[int]:
    """Each KV cache group's blocks (`KVCacheLayout.share`) from the budget in blocks of every
    layer (the module docstring). `graph_pool`: the mixed-step graphs will keep a step's
    activations in a pool of their own."""
    per_block = layout.tokens_per_block
    if config.max_tokens_in_paged_kv_cache is not None:
        budget = -(-config.max_tokens_in_paged_kv_cache // per_block)
    elif layout.device.type == "cuda":
        budget = blocks_from_free_memory(layout, config, max_seq_len, warm_up, graph_pool)
    else:
        per_seq = -(-min(max_seq_len, CPU_KV_CACHE_SEQ_LEN) // per_block)
        cap = CPU_KV_CACHE_CAP_BYTES // layout.block_bytes()
        budget = min(config.max_batch_size * per_seq, cap)
    return layout.share(budget, max_seq_len, config.max_num_tokens)


def blocks_from_free_memory(
    layout: KVCacheLayout,
    config: EngineConfig,
    max_seq_len: int,
    warm_up: WarmUp,
    graph_pool: bool,
) -> int:
    """Warm up at max_num_tokens with a temporary cache, then size the real one."""
    device, per_block = layout.device, layout.tokens_per_block
    total = min(config.max_num_tokens, config.max_batch_size * max_seq_len)
    lengths = [max_seq_len] * (total // max_seq_len)
    if total % max_seq_len:
        lengths.append(total % max_seq_len)
    chunks, next_block = [], 0
    for n in lengths:
        blocks = list(range(next_block, next_block + -(-n // per_block)))
        chunks.append(Chunk.of_sequence([0] * n, blocks))
        next_block += len(blocks)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    warmup_cache_bytes = next_block * layout.block_bytes()
    warm_up(chunks, [next_block] * len(layout.model_config.kv_cache_groups))
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base - warmup_cache_bytes
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    # The mixed-step graphs keep a step's activations in a pool of their own: set aside twice.
    reserved = activations * (2 if graph_pool else 1)
    budget = (free - reserved) * config.kv_cache_free_gpu_mem_fraction
    log.info(
        "warm-up: %.2f GiB peak activations, %.2f GiB free, %.2f GiB for the KV cache",
        activations / 2**30,
        free / 2**30,
        budget / 2**30,
    )
    return int(budget // layout.block_bytes())
