"""The pool of KV cache block ids: reference counts, free lists and the prefix-hash index.

The model runner owns the cache tensors; this module only decides which block id holds what.
A block is *used* while at least one request holds it (ref_count > 0) and *free* otherwise.
Free blocks come in two kinds:

- plain: no reusable content; handed out first.
- evictable: a full block whose content is identified by a prefix hash. It stays findable
  through the hash index so a later request with the same prefix can take it back without
  recomputing, until a fresh allocation runs out of plain blocks and evicts it (least recently
  freed first; eviction forgets the hash).

So `num_free == num_plain + num_evictable` and `num_free + num_used == num_blocks`, always.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Chained hash of one full block: identifies the block's tokens *and* everything before them.

    Chaining matters because a block's KV values depend on the whole prefix, not only on its own
    tokens: the same tokens after a different prefix are different cache content.
    blake2b is stable across processes and collision resistant, unlike Python's `hash`.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def root_hash(lora_name: str | None) -> BlockHash | None:
    """The parent of a sequence's first block: None under the base model, else the adapter's
    own, so blocks computed under a LoRA adapter (other K and V values) are reused only under
    the same adapter name."""
    if lora_name is None:
        return None
    return hashlib.blake2b(b"lora\0" + lora_name.encode(), digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set while the block is findable in the hash index


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._plain: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self._index: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count == 0

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, in use or evictable, or None."""
        return self._index.get(block_hash)

    def allocate(self) -> int:
        """Take a free block for fresh content (ref_count 1). Plain blocks first, then evict."""
        if self._plain:
            block_id = self._plain.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._index[block.block_hash]
            block.block_hash = None
        else:
            raise RuntimeError("no free KV cache block")
        self.blocks[block_id].ref_count = 1
        return block_id

    def take(self, block_id: int) -> None:
        """Share a block found through the index: one more holder; revives it if evictable."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if block.block_hash is None:
                raise RuntimeError(f"block {block_id} is free and has no content to share")
            del self._evictable[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One holder fewer. At zero the block becomes free: evictable if hashed, else plain."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV cache block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._plain.append(block_id)

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a just-filled block findable by its hash.

        When another block already holds the same content (two requests computed the same prefix
        at once) the index keeps the first one; this block stays unindexed and becomes plain
        when released.
        """
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise RuntimeError(f"cannot register free block {block_id}")
        if block.block_hash is None and block_hash not in self._index:
            self._index[block_hash] = block_id
            block.block_hash = block_hash
