"""A step's inputs on the model device: from the host arrays of an eager step (`EagerStep`, packed
by rank 0 or received by a worker) to the token ids, positions and attention metadata the model
reads, in one staged copy (`backend.staging`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from backend.attention import AttentionMetadata
from backend.distributed.tensor_parallel import TensorParallel
from backend.distributed.tp_workers import EagerStep
from backend.runner.step_packing import PackedStep
from backend.staging import StagingTurns


@dataclass
class StepInputs:
    """One packed step, on the model device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int, rows of the last token of each sampling chunk
    in_graph: bool = False  # staged for a decode CUDA graph, which reads it when replayed
    graph_tokens: int = 0  # staged for the mixed-step CUDA graph of this many tokens (0: eager)


def eager_step(packed: PackedStep) -> EagerStep:
    """The host arrays of a step run eagerly (what rank 0 sends its workers)."""
    step = EagerStep(
        packed.input_ids,
        packed.positions,
        packed.slots,
        packed.query_start_loc.astype(np.int32),
        packed.seq_lens.astype(np.int32),
        packed.block_tables.astype(np.int32),
        packed.logits_indices,
    )
    if packed.in_flight is not None:
        chunks_in_flight = np.flatnonzero(packed.in_flight >= 0)
        step.in_flight_rows = (packed.query_start_loc[1:] - 1)[chunks_in_flight]
        step.in_flight_sources = packed.in_flight[chunks_in_flight]
    return step


def eager_inputs(
    step: EagerStep,
    staging: StagingTurns,
    num_groups: int,
    tp: TensorParallel,
    in_flight_ids: torch.Tensor | None = None,
) -> StepInputs:
    """`step` on the device. The ids of the rows in flight come from `in_flight_ids` (by
    `in_flight_sources`), or from rank 0 when tensor parallel (a worker has no sources)."""
    sources = [] if step.in_flight_sources is None else [step.in_flight_sources]
    ids_d, pos_d, slots_d, qsl_d, seq_d, bt_d, li_d, *fill = staging.to_device(
        step.arrays() + sources
    )
    total, n = step.input_ids.size, step.seq_lens.size
    if step.in_flight_rows is not None:
        if sources:
            filled = in_flight_ids[fill[1]].to(torch.int64)
        else:  # a worker
            filled = torch.empty(fill[0].shape, dtype=torch.int64, device=ids_d.device)
        if tp.enabled:
            tp.broadcast(filled)
        ids_d[fill[0]] = filled
    query_lens = np.diff(step.query_start_loc)
    seq_lens = step.seq_lens
    meta = AttentionMetadata(
        slot_mapping=slots_d[:total],
        query_start_loc=qsl_d,
        seq_lens=seq_d,
        block_tables=bt_d[:n],
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    meta.groups = tuple(
        replace(
            meta,
            slot_mapping=slots_d[g * total : (g + 1) * total],
            block_tables=bt_d[g * n : (g + 1) * n],
        )
        for g in range(1, num_groups)
    )
    return StepInputs(ids_d, pos_d, meta, li_d)
