"""CUDA graphs for steps with prompt tokens (prefill chunks, alone or beside decodes).

An eager step launches about nine kernels per layer from Python, and on a GPU host that costs
more than the kernels of a few hundred tokens take to run (benchmarks/README.md, "Where a step's
time goes"). So the model's body (embedding to the last residual) is captured once per padded
token count (`token_sizes`, up to `cuda_graph_max_tokens`) and a step of up to that many tokens
replays the smallest graph that fits; longer steps run eagerly.

The graphs read one device buffer, filled from a ring of two pinned host slots by one copy per
step (`stage`): a slot is rewritten once its copy from two steps ago has run. Padding:
- requests: a graph attends over `max_batch_size` requests; those past the step's own have no
  query rows and context 0, so the prefill kernel's programs for them exit at once;
- tokens: those past the step's own belong to no request (slot -1: the KV write skips them;
  attention leaves their rows unwritten). Every kernel of the body works row by row, so what
  those rows compute is never read.
The logits of the sampled rows are computed after the replay, eagerly: their count varies.

An in-flight token's input id (overlap scheduling) is written into the buffer on the device after
the copy, from the sampled ids of the step in flight, as in an eager step.

With several KV cache groups the slots and block tables hold each group's in turn (rows g * n ..,
as `backend.runner.step_packing` lays them out), at fixed strides: group g's slots start at g * T,
its block-table rows at g * max_batch_size.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata
from backend.runner.graph_capture import capture_largest_first
from backend.runner.step_packing import PackedStep
from backend.staging import RingedFields

log = logging.getLogger(__name__)


def token_sizes(max_tokens: int) -> list[int]:
    """The padded token counts captured: powers of two to 256, then every 256 (a few hundred
    tokens is the usual step with one prompt chunk; padding costs at most 256 rows of GEMM)."""
    limit = -(-max_tokens // 16) * 16
    sizes = [s for s in (16, 32, 64, 128, 256) if s < limit]
    sizes += range(512, limit, 256)
    return sorted(set(sizes) | {limit})


class MixedGraphs:
    def __init__(
        self,
        model,
        kv_cache: torch.Tensor | tuple,
        max_batch_size: int,
        max_tokens: int,
        max_seq_len: int,
        tokens_per_block: int,
        kv_scales: torch.Tensor | tuple | None = None,
        num_kv_groups: int = 1,
    ):
        device = kv_cache[0].device
        self.model = model
        self.kv_cache = kv_cache
        self.kv_scales = {} if kv_scales is None else {"kv_scales": kv_scales}
        self.max_seq_len = max_seq_len
        self.sizes = token_sizes(max_tokens)
        self.max_tokens = t = self.sizes[-1]
        self.max_requests = s = max_batch_size
        self.num_kv_groups = g = num_kv_groups
        width = -(-max_seq_len // tokens_per_block)
        fields = [  # the block tables last: a step copies only its requests' rows of them
            ("input_ids", torch.int64, (t,)),
            ("positions", torch.int64, (t,)),
            ("logits_indices", torch.int64, (s,)),
            ("fill_rows", torch.int64, (s,)),  # in-flight tokens' rows in input_ids
            ("fill_from", torch.int64, (s,)),  # ... and their rows in the in-flight ids
            ("slot_mapping", torch.int64, (g * t,)),
            ("query_start_loc", torch.int32, (s + 1,)),
            ("seq_lens", torch.int32, (s,)),
            ("block_tables", torch.int32, (g * s, width)),
        ]
        RingedFields(fields, device).attach(self)
        self.row_bytes = width * 4
        for slot in (0, 1):
            self.host_fields[slot]["slot_mapping"][:] = -1
        self.slot_mapping.fill_(-1)
        self.metas = {size: self._meta(size) for size in self.sizes}  # views of the buffer
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._staged = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.hidden: torch.Tensor | None = None  # the graphs' shared output, from `capture`

    def size_for(self, num_tokens: int, num_requests: int) -> int | None:
        """The padded token count whose graph runs such a step, None if none fits."""
        if num_tokens > self.max_tokens or num_requests > self.max_requests:
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def _meta(self, size: int) -> AttentionMetadata:
        """Group 0's metadata over `size` tokens of the buffer, the other groups' in `groups`.
        max_query_len > 1 sends every step to the prefill kernel, which sizes its grid from
        the tensors' shapes only."""
        metas = [
            AttentionMetadata(
                slot_mapping=self.slot_mapping[g * self.max_tokens :][:size],
                query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens,
                block_tables=self.block_tables[g * self.max_requests :][: self.max_requests],
                max_query_len=size,
                max_seq_len=self.max_seq_len,
                query_lens_cpu=[],  # read by the torch reference only, which graphs do not run
                seq_lens_cpu=[],
            )
            for g in range(self.num_kv_groups)
        ]
        metas[0].groups = tuple(metas[1:])
        return metas[0]

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache,
            self.metas[size],
            **self.kv_scales,
        )
        return hidden if self.hidden is None else self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per token count (`capture_largest_first`); with nothing staged no token has
        a slot or a request, so the capture writes no cache."""
        began = time.perf_counter()
        # Every graph copies its output into the rows of one buffer (a few µs): graphs that kept
        # their own would hold a [size, hidden] array for each captured size.
        self.hidden = self._forward(self.max_tokens)
        self.graphs.update(capture_largest_first(self.sizes, self._forward))
        torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs for steps with prompt tokens: %d sizes, 16 to %d tokens, "
            "in %.1f s",
            len(self.sizes),
            self.max_tokens,
            time.perf_counter() - began,
        )

    def stage(
        self, packed: PackedStep, size: int, in_flight_ids: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """Queue the copy of one packed step, for the graph of `size` tokens (`size_for`), into
        the buffer (and the in-flight ids into it) -> its metadata over the buffer."""
        n, total = packed.seq_lens.size, packed.num_tokens
        slot = self._staged % 2
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        host, t, s = self.host_fields[slot], self.max_tokens, self.max_requests
        groups = self.num_kv_groups
        host["input_ids"][:total] = packed.input_ids
        host["input_ids"][total:size] = 0
        host["positions"][:total] = packed.positions
        host["positions"][total:size] = 0
        by_group = host["slot_mapping"].reshape(groups, t)
        by_group[:, :total] = packed.slots.reshape(groups, total)
        by_group[:, total:size] = -1
        host["query_start_loc"][: n + 1] = packed.query_start_loc
        host["query_start_loc"][n + 1 :] = total
        host["seq_lens"][:n] = packed.seq_lens
        host["seq_lens"][n:] = 0
        width = packed.block_tables.shape[1]
        tables = host["block_tables"].reshape(groups, s, -1)
        tables[:, :n, :width] = packed.block_tables.reshape(groups, n, width)
        sampled = packed.logits_indices.size
        host["logits_indices"][:sampled] = packed.logits_indices
        fills = None
        if packed.in_flight is not None:
            chunks = np.flatnonzero(packed.in_flight >= 0)
            fills = chunks.size
            host["fill_rows"][:fills] = (packed.query_start_loc[1:] - 1)[chunks]
            host["fill_from"][:fills] = packed.in_flight[chunks]
        end = self.offsets["block_tables"] + ((groups - 1) * s + n) * self.row_bytes
        self.buffer[:end].copy_(self.host_ring[slot, :end], non_blocking=True)
        if fills:
            ids = in_flight_ids[self.fill_from[:fills]]
            self.input_ids[self.fill_rows[:fills]] = ids.to(torch.int64)
        if self.buffer.is_cuda:
            done = self._copied[slot] = self._copied[slot] or torch.cuda.Event()
            done.record()
        self._staged += 1
        return self.metas[size]

    def replay(self, size: int) -> torch.Tensor:
        """Run the staged step in the graph of `size` tokens -> the last residual [size, hidden]
        (a view of the graph's output, valid until the next replay). Before `capture` (or on
        CPU) the graph's work runs eagerly."""
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
            return hidden
        return self._forward(size)
