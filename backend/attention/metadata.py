"""Per-step attention inputs, built once by the model runner and shared by every layer.

KV cache layout (one tensor for the whole model, or with several KV cache groups one per group,
indexed by layer all the same):
    kv_cache[layer, 0 | 1, block, offset_in_block, kv_head, head_dim]   (0 = K, 1 = V)
A token's cache slot is `block_id * tokens_per_block + offset_in_block` (block ids of the
layer's group).

The new tokens of all scheduled requests are packed along one axis (T tokens). Request b owns
query rows `query_start_loc[b] : query_start_loc[b + 1]`; they sit at the last positions of its
context, whose full length after this step is `seq_lens[b]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, used by the torch reference
    seq_lens_cpu: list[int]
    # A model whose layers form several KV cache groups (`ModelConfig.kv_cache_groups`): the
    # metadata of groups 1.. (their own slot_mapping and block_tables, the rest shared); this
    # object is group 0's. Empty with one group.
    groups: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group `group` attends with."""
        return self if group == 0 else self.groups[group - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
