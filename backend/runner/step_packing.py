"""One step's chunks packed into the host arrays the model reads.

The engine schedules chunks (prefill chunks and decodes together); `pack_step` lays them out as
one batch: token ids, positions, cache slots, query offsets, sequence lengths, block tables and
the rows whose logits are sampled. No Python loop over requests beyond reading their lists: at
batch 256 this runs every step, so block tables are filled with one masked numpy assignment from
all block ids chained together. With several KV cache groups the slots and block tables hold each
group's in turn (rows g * n .. of the tables, g * T .. of the slots).

A decode with drafts (speculative decoding) packs its newest token and its drafts, and its 1 + d
last rows are sampled: the target's token after the newest token and after each draft.

An in-flight token (overlap scheduling, `backend.engine.step`) is a chunk of its own: every other
token of its request is computed. Its input id is a stand-in here; the model runner replaces it on
the device with the id sampled by the step in flight (`PackedStep.in_flight` says from which row).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from backend.request import Chunk

_request, _start, _num_tokens, _samples, _block_ids = (
    attrgetter(name) for name in ("request", "start", "num_tokens", "samples", "block_ids")
)
_STAND_IN = [0]  # the input id of an in-flight token until the device replaces it


@dataclass
class PackedStep:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T * groups] int64: each token's cache slot, group by group
    query_start_loc: np.ndarray  # [n + 1] int64
    seq_lens: np.ndarray  # [n] int64: tokens in the cache once the step is done
    block_tables: np.ndarray  # [n * groups, width] int64, group by group
    samples: np.ndarray  # [n] bool: the chunk's last token is sampled
    # rows of the last token of each sampling chunk (of a decode with d drafts: its last 1 + d)
    logits_indices: np.ndarray
    in_flight: np.ndarray | None  # [n]: the row of the in-flight ids a chunk reads, -1 if none
    has_drafts: bool = False  # some decode carries drafts (its logits take several rows)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.size


def pack_step(
    chunks: list[Chunk], tokens_per_block: int, max_seq_len: int, num_groups: int
) -> PackedStep:
    if not chunks:
        raise ValueError("execute() needs at least one chunk")
    n = len(chunks)
    requests = list(map(_request, chunks))  # map + attrgetter: C-speed gathers
    block_lists = list(map(_block_ids, requests))
    query_lens = np.fromiter(map(_num_tokens, chunks), dtype=np.int64, count=n)
    starts = np.fromiter(map(_start, chunks), dtype=np.int64, count=n)
    seq_lens = starts + query_lens
    if query_lens.min() < 1:
        raise ValueError("every chunk needs at least one token")
    if seq_lens.max() > max_seq_len:
        raise ValueError(f"sequence of {seq_lens.max()} tokens exceeds max_seq_len {max_seq_len}")
    query_start_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_blocks = -(-seq_lens // tokens_per_block)
    held = np.fromiter(map(len, block_lists), dtype=np.int64, count=n)
    short = np.flatnonzero(held < num_blocks)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"chunk {i} covers {seq_lens[i]} tokens but has only "
            f"{held[i]} blocks of {tokens_per_block}"
        )
    block_tables = block_table(block_lists, held, num_blocks)
    # Per token: which chunk it belongs to, its position and its cache slot.
    seq_of_token = np.repeat(np.arange(n), query_lens)
    total = int(query_start_loc[-1])
    positions = starts[seq_of_token] + np.arange(total) - query_start_loc[seq_of_token]
    block_of_token, offset = positions // tokens_per_block, positions % tokens_per_block
    slots = block_tables[seq_of_token, block_of_token] * tokens_per_block + offset
    if num_groups > 1:  # each group's tables and slots in turn
        tables = [block_tables] + [
            block_table([_group_table(r, g) for r in requests], held, num_blocks)
            for g in range(1, num_groups)
        ]
        block_tables = np.concatenate(tables)
        slots = np.concatenate(
            [t[seq_of_token, block_of_token] * tokens_per_block + offset for t in tables]
        )
    samples = np.fromiter(map(_samples, chunks), dtype=bool, count=n)
    in_flight_rows = [r.in_flight_row for r in requests]
    token_lists = [
        r.tokens(c.start, c.start + c.num_tokens) if row is None else _STAND_IN
        for c, r, row in zip(chunks, requests, in_flight_rows)
    ]
    logits_indices = (query_start_loc[1:] - 1)[samples]
    num_drafts = np.fromiter((len(c.draft_ids) for c in chunks), dtype=np.int64, count=n)
    if num_drafts.any():
        token_lists = [_drafted(c) if c.draft_ids else ids for ids, c in zip(token_lists, chunks)]
        logits_indices = drafted_rows(query_start_loc[1:][samples], num_drafts[samples])
    in_flight = None
    if in_flight_rows.count(None) < n:
        in_flight = np.array([-1 if row is None else row for row in in_flight_rows], np.int64)
    return PackedStep(
        input_ids=np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total),
        positions=positions,
        slots=slots,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        samples=samples,
        logits_indices=logits_indices,
        in_flight=in_flight,
        has_drafts=bool(num_drafts.any()),
    )


def _drafted(chunk: Chunk) -> list[int]:
    """A decode's input ids with its drafts: the newest token, then the drafts."""
    end = chunk.start + chunk.num_tokens - len(chunk.draft_ids)
    return chunk.request.tokens(chunk.start, end) + list(chunk.draft_ids)


def drafted_rows(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The rows whose logits sampling chunks need: each one's last token and, for a decode with
    drafts, the d rows before it too (its newest token and each draft but the last)."""
    counts = num_drafts + 1
    first = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return first + offsets


def block_table(block_lists: list[list[int]], held: np.ndarray, num_blocks: np.ndarray):
    """Row i: the first num_blocks[i] ids of block_lists[i] (held[i] long), zeros after and for
    FREED entries (outside every window)."""
    columns = np.arange(max(int(held.max()), 1))
    table = np.zeros((len(block_lists), columns.size), dtype=np.int64)
    table[columns < held[:, None]] = np.fromiter(
        chain.from_iterable(block_lists), dtype=np.int64, count=int(held.sum())
    )
    width = int(num_blocks.max())
    block_tables = table[:, :width]
    block_tables[columns[:width] >= num_blocks[:, None]] = 0
    np.maximum(block_tables, 0, out=block_tables)
    return block_tables


def _group_table(request, group: int) -> list[int]:
    """The request's block table in KV cache group `group` (1..); a bare sequence
    (`Chunk.of_sequence`) has the same block ids in every group's pool."""
    return request.group_block_ids[group - 1] if request.group_block_ids else request.block_ids
