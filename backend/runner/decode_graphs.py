"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; at small batch sizes launching them from
Python costs more than running them. So decode-only steps (every request computes one token) are
captured once per padded batch size and replayed. The graph does the whole step, so that between
two replays the device runs nothing at all:

- the host packs the step's inputs into a slot of a ring of two in pinned host memory (`stage`),
  which the graph's first kernel copies into its device buffer, taking the input id of each
  in-flight token (`backend.engine.step`) from the previous replay's sampled ids
  (`backend.kernels.step_inputs`);
- forward and logits;
- each row's argmax (what greedy sampling picks), skipping the row's banned ids (the end ids of a
  request short of its min_tokens), into a static device buffer, where the next replay's first
  kernel finds it, and into the same slot of a pinned ring of ids, which the host reads once the
  replay's event has passed (`ReplayIds`).

The first `n` rows of logits and ids are the answer. When the previous step's ids came from
elsewhere (sampling with temperature or logits processors, an eager step), `stage` copies them
into the static buffer first.

A slot is reused two replays later: `stage` first waits for the replay that last used it and
keeps its ids (with overlap scheduling that replay is long finished and read by then: the engine
finishes step n-1 before it packs step n+1).

Padded rows have slot -1 (the KV write skips them) and context length 0 (attention writes zeros
for them); their logits are computed and ignored. The attention kernels size their grids from the
captured `max_seq_len`, and divide each request's context among the splits at run time, so one
graph serves every context length.

A model whose layers form several KV cache groups (`ModelConfig.kv_cache_groups`) has a slot and
a block-table row per group for each row: the buffer holds slot_mapping [groups * n] and
block_tables [groups * n, blocks], group g's at rows g * n .. (the layout of the step's arrays
from `ModelRunner.prepare`), and each group's metadata views its part.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata
from backend.runner.graph_capture import capture_largest_first
from backend.staging import RingedFields

try:  # GPU only; the input buffers and staging also run on CPU tensors (tests)
    from backend.kernels.argmax import argmax_rows
    from backend.kernels.step_inputs import load_step_inputs
except ImportError:
    argmax_rows = load_step_inputs = None

log = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class ReplayIds:
    """One replay's argmax ids, on their way to a slot of the pinned ring: `result()` waits for
    the replay (its event) and reads them. A ring slot is rewritten two replays later, after
    `keep()` has saved them."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None):
        self._host = host
        self._done = done
        self._ids: list[int] | None = None

    def result(self) -> list[int]:
        if self._ids is None:
            if self._done is not None:
                self._done.synchronize()
            self._ids = self._host.tolist()
        return self._ids

    keep = result


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        max_batch_size: int,
        max_seq_len: int,
        tokens_per_block: int,
        max_banned: int = 1,
        kv_scales: torch.Tensor | tuple | None = None,
        num_kv_groups: int = 1,
    ):
        """`kv_scales`: a quantized cache's scales, read and written by the graphs in place."""
        device = kv_cache[0].device  # a tensor, or per layer with several KV cache groups
        self.model = model
        self.kv_cache = kv_cache
        self.kv_scales = {} if kv_scales is None else {"kv_scales": kv_scales}
        self.max_seq_len = max_seq_len
        self.num_kv_groups = groups = num_kv_groups
        self.sizes = capture_sizes(max_batch_size)
        self.rows = max_batch_size  # of each group in slot_mapping and block_tables
        n, blocks = max_batch_size, -(-max_seq_len // tokens_per_block)
        # Every per-step input lives in one buffer, mirrored by each slot of the host ring: the
        # first kernel copies from `positions` on, up to the end of the graph's block-table rows
        # (the block tables come last, group by group); it writes the input ids itself (in-flight
        # ones resolved).
        fields = [
            ("input_ids", torch.int64, (n,)),
            ("in_flight_rows", torch.int64, (n,)),
            ("table_width", torch.int32, (1,)),  # the step's block-table columns
            ("positions", torch.int64, (n,)),
            ("slot_mapping", torch.int64, (groups * n,)),
            ("seq_lens", torch.int32, (n,)),
            ("banned_ids", torch.int64, (n, max_banned)),
            ("block_tables", torch.int32, (groups * n, blocks)),
        ]
        RingedFields(fields, device).attach(self)
        pinned = device.type == "cuda"
        self.sampled_ring = torch.zeros(2, n, dtype=torch.int64, pin_memory=pinned)  # argmax ids
        for slot in (0, 1):
            self.host_fields[slot]["slot_mapping"][:] = -1
            self.host_fields[slot]["in_flight_rows"][:] = -1
            self.host_fields[slot]["banned_ids"][:] = -1
        self.sampled_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.replays = torch.zeros(1, dtype=torch.int64, device=device)  # run so far (device)
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)  # this replay's slot
        self._replayed = 0  # queued so far (host)
        self._ids_out: list[ReplayIds | None] = [None, None]  # per slot, the last replay's
        self.logits: torch.Tensor | None = None  # the graphs' shared output, from `capture`
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        """The padded batch size (captured graph) that runs n rows."""
        return next(s for s in self.sizes if s >= n)

    def _meta(self, size: int) -> AttentionMetadata:
        return self._group_metas(size, self.max_seq_len, [0] * size)

    def _group_metas(
        self, n: int, max_seq_len: int, seq_lens: list[int], width: int | None = None
    ) -> AttentionMetadata:
        """Group 0's metadata of n rows over the device buffer, the other groups' in `groups`."""
        first = [g * self.rows for g in range(self.num_kv_groups)]
        metas = [
            AttentionMetadata(
                slot_mapping=self.slot_mapping[row : row + n],
                query_start_loc=self.query_start_loc[: n + 1],
                seq_lens=self.seq_lens[:n],
                block_tables=self.block_tables[row : row + n, :width],
                max_query_len=1,
                max_seq_len=max_seq_len,
                query_lens_cpu=[1] * n,
                seq_lens_cpu=seq_lens,
            )
            for row in first
        ]
        metas[0].groups = tuple(metas[1:])
        return metas[0]

    def load_inputs(self, size: int) -> None:
        """The graph's first kernel: host slot `replays % 2` into the device buffer, up to the
        last group's first `size` block-table rows."""
        rows = (self.num_kv_groups - 1) * self.rows + size
        row_bytes = self.block_tables.shape[1] * self.block_tables.element_size()
        end = self.offsets["block_tables"] + rows * row_bytes
        offsets = self.offsets
        load_step_inputs(
            self.buffer,
            self.host_ring,
            offsets["input_ids"],
            offsets["in_flight_rows"],
            offsets["positions"],
            end,
            size,
            self.sampled_ids,
            self.replays,
            self.slot,
            table_from=offsets["block_tables"],
            table_row_bytes=row_bytes,
            width_offset=offsets["table_width"],
        )

    def _forward(self, size: int) -> torch.Tensor:
        self.load_inputs(size)
        hidden = self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache,
            self._meta(size),
            **self.kv_scales,
        )
        out = None if self.logits is None else self.logits[:size]
        logits = self.model.compute_logits(hidden, out=out)
        argmax_rows(
            logits,
            out=self.sampled_ids[:size],
            to_host=(self.sampled_ring, self.slot, self.replays),
            banned=self.banned_ids[:size],
        )
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per batch size (`capture_largest_first`). Every graph writes its logits
        into the rows of one buffer, the largest size's: graphs that kept their own outputs
        would hold a [size, vocab] float32 array for each captured size, in memory the KV cache
        sizing never counted."""
        self.logits = self._forward(self.sizes[-1])
        self.graphs.update(capture_largest_first(self.sizes, self._forward))
        self.replays.zero_()  # the warm-up runs counted; the host has queued none
        self.sampled_ids.zero_()
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def stage(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        in_flight_rows: np.ndarray | None = None,
        in_flight_ids: torch.Tensor | None = None,
        banned_ids: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """Write one decode step of n rows into the host slot of the next replay, padded to the
        graph size: padded rows get slot -1 (the KV write skips them) and context length 0
        (attention writes zeros for them); their logits are ignored. `in_flight_rows` [n]: for
        a row whose input is an in-flight token, its row in `in_flight_ids` (the previous step's
        sampled ids; the graph reads them), else -1; None: no row is. `banned_ids`
        [n, <= max_banned]: ids each row's argmax skips (-1 = none; None: no bans). `slots`
        [groups * n] and `block_tables` [groups * n, width]: each KV cache group's in turn.
        Returns the step's attention metadata: views of the device buffer, which hold the step
        once `replay` has run its first kernel."""
        n, size = len(input_ids), self.size_for(len(input_ids))
        if in_flight_rows is not None and in_flight_ids.data_ptr() != self.sampled_ids.data_ptr():
            self.sampled_ids[: len(in_flight_ids)].copy_(in_flight_ids)
        slot = self._replayed % 2
        previous = self._ids_out[slot]
        if previous is not None:  # its replay read this slot: wait for it, keep its ids
            previous.keep()
            self._ids_out[slot] = None
        host = self.host_fields[slot]
        for name, values, pad in (
            ("input_ids", input_ids, 0),
            ("positions", positions, 0),
            ("seq_lens", seq_lens, 0),
        ):
            host[name][:n] = values
            host[name][n:size] = pad
        by_group = host["slot_mapping"].reshape(self.num_kv_groups, self.rows)
        by_group[:, :n] = slots.reshape(self.num_kv_groups, n)
        by_group[:, n:size] = -1
        host["in_flight_rows"][:size] = -1
        if in_flight_rows is not None:
            host["in_flight_rows"][:n] = in_flight_rows
        host["banned_ids"][:size] = -1
        if banned_ids is not None:
            host["banned_ids"][:n, : banned_ids.shape[1]] = banned_ids
        # Only the step's columns travel (the first kernel copies `table_width` of each row);
        # attention reads no page past a request's context, so the stale columns stay unread.
        table, width = host["block_tables"], block_tables.shape[1]
        table = table.reshape(self.num_kv_groups, self.rows, -1)
        table[:, :n, :width] = block_tables.reshape(self.num_kv_groups, n, width)
        table[:, n:size, :width] = 0
        host["table_width"][0] = width
        return self._group_metas(n, int(seq_lens.max()), seq_lens.tolist(), width)

    def replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor, ReplayIds]:
        """Run the staged step (n rows) in the smallest graph that fits: float32 logits
        [n, vocab] and each row's argmax [n] on the device (views of the graph's outputs, valid
        until the next replay), and the same ids on their way to the host. Before `capture` (or
        on CPU) the graph's work runs eagerly."""
        size = self.size_for(n)
        slot = self._replayed % 2
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        self._replayed += 1
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        ids = self._ids_out[slot] = ReplayIds(self.sampled_ring[slot, :n], done)
        return logits[:n], self.sampled_ids[:n], ids
