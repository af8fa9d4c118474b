"""A decode CUDA graph step's inputs, read by the graph itself from mapped host memory.

Two device copies between replays of a decode graph (the sampled ids to the host, the next step's
inputs to the device) would each leave the GPU idle for a few microseconds. Instead the host
writes a step's packed inputs into pinned host memory, which the GPU can address, and the graph's
first kernel (this one) reads them into the graph's device buffer; the graph's last kernel writes
the sampled ids into pinned memory too (`backend.kernels.argmax`). Replays then follow each other
with nothing in between (what that gains: benchmarks/README.md, "Kernel choices").

The host memory is a ring of two slots, so that step n+1 can be packed while step n runs: the
replay reads slot `replays % 2`, where `replays` (a device counter) counts the replays run so
far; the argmax advances it. This kernel copies `replays % 2` to `slot` for the argmax to write
the ids in the same slot.

It also resolves the input ids of in-flight tokens (overlap scheduling, `backend.engine.step`): row
i takes sampled[in_flight_rows[i]], an id the previous replay left on the device, where
in_flight_rows[i] >= 0.
Program 0 does that and the slot; the others copy the rest of the slot, from `copy_from` on,
CHUNK 32-bit words each. The block tables come last, rows of the graph's full width (the
capacity's blocks); of each row only the step's width (a word of the slot) is copied, so a step
moves what its contexts hold, not what max_seq_len allows.

Kernels later in the step read step inputs (positions, slots, context lengths, block tables)
before they wait for their predecessor (programmatic dependent launch, `backend.kernels.pdl`), so
none of them may start before this kernel has finished: it is launched without PDL and never lets
its dependents launch early, and the embedding lookup after it lets its own dependents launch only
once it has waited for it (`backend.kernels.embedding`). Each kernel declares this as its
`ORDERING`; `backend.kernels.pdl.check_step_input_reads` checks a recorded launch sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.pdl import Ordering, record

CHUNK = 1024
ORDERING = Ordering("load_step_inputs", releases="at_end", writes_step_inputs=True, pdl=False)


@triton.jit
def _load_step_kernel(
    dev_words,
    host_words,
    dev_ids,
    host_ids,
    in_flight_rows,
    sampled,
    replays,
    slot_out,
    n,
    slot_words,
    slot_ids,
    copy_from,
    copy_to,
    table_from,
    table_row_words,
    width_word,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    slot = tl.load(replays) % 2
    pid = tl.program_id(0)
    if pid == 0:
        rows = tl.arange(0, ROWS)
        in_range = rows < n
        ids = tl.load(host_ids + slot * slot_ids + rows, mask=in_range)
        src = tl.load(in_flight_rows + slot * slot_ids + rows, mask=in_range, other=-1)
        filled = in_range & (src >= 0)
        previous = tl.load(sampled + tl.where(filled, src, 0), mask=filled)
        tl.store(dev_ids + rows, tl.where(filled, previous, ids), mask=in_range)
        tl.store(slot_out, slot)
    else:
        words = copy_from + (pid - 1) * CHUNK + tl.arange(0, CHUNK)
        width = tl.load(host_words + slot * slot_words + width_word)
        column = (words - table_from) % table_row_words
        inside = (words < copy_to) & ((words < table_from) | (column < width))
        tl.store(
            dev_words + words,
            tl.load(host_words + slot * slot_words + words, mask=inside),
            mask=inside,
        )


def load_step_inputs(
    device_buffer: torch.Tensor,
    host_ring: torch.Tensor,
    ids_offset: int,
    in_flight_offset: int,
    copy_from: int,
    copy_to: int,
    n: int,
    sampled: torch.Tensor,
    replays: torch.Tensor,
    slot: torch.Tensor,
    table_from: int,
    table_row_bytes: int,
    width_offset: int,
) -> None:
    """Copy bytes [copy_from, copy_to) of host slot `replays % 2` into `device_buffer`, and the
    n input ids at byte `ids_offset` with the in-flight ones (rows at `in_flight_offset`)
    resolved from `sampled`; write the slot to `slot`. From byte `table_from` on, the range holds
    rows of `table_row_bytes` (int32 words) of which only the first `width` words are copied,
    width being the int32 of the slot at byte `width_offset`.

    device_buffer: uint8 [B]; host_ring: uint8 [2, B] (pinned on CUDA); ids and in-flight rows are
    int64 [n] at their offsets, 8-byte aligned; copy_from/copy_to are multiples of 4 and the
    copied range does not hold the ids; sampled: int64; replays, slot: int64 [1]."""
    width = host_ring.shape[1]
    assert host_ring.shape == (2, device_buffer.numel()) and width % 8 == 0
    assert (
        ids_offset % 8 == 0
        and in_flight_offset % 8 == 0
        and copy_from % 4 == 0
        and copy_to % 4 == 0
    )
    assert not (copy_from < ids_offset + 8 * n and ids_offset < copy_to)
    assert table_from % 4 == 0 and table_row_bytes % 4 == 0 and width_offset % 4 == 0
    dev_words, host_words = device_buffer.view(torch.int32), host_ring.view(torch.int32)
    dev_ids = device_buffer[ids_offset : ids_offset + 8 * n].view(torch.int64)
    host_longs = host_ring.view(torch.int64)
    host_ids = host_longs[:, ids_offset // 8 :]
    in_flight_rows = host_longs[:, in_flight_offset // 8 :]
    grid = (1 + triton.cdiv(copy_to - copy_from, 4 * CHUNK),)
    record(ORDERING)
    _load_step_kernel[grid](
        dev_words,
        host_words,
        dev_ids,
        host_ids,
        in_flight_rows,
        sampled,
        replays,
        slot,
        n,
        width // 4,
        width // 8,
        copy_from // 4,
        copy_to // 4,
        table_from // 4,
        table_row_bytes // 4,
        width_offset // 4,
        ROWS=triton.next_power_of_2(n),
        CHUNK=CHUNK,
    )
