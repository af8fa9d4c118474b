"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; at small batch sizes launching them from
Python costs more than running them. So decode-only steps (every request computes one token) are
captured once per padded batch size and replayed: the step's inputs are copied from the host
straight into the graph's input buffer (`stage`), and the graph fills the placeholder input ids
from the previous step's sampled ids (`backend.kernels.placeholders`), runs forward + logits and
takes each row's argmax (what greedy sampling picks) into a static id buffer. The first `n` rows
of logits and ids are the answer. Between two replays the device then runs only the copies of the
ids to the host and of the next inputs to the device: no kernel of its own.

The id buffer is also where the next replay's fill reads the previous ids. When the previous
step's ids came from elsewhere (sampling with temperature or logits processors, an eager step),
`stage` copies them in first. A replay overwrites the ids at its end, after its fill read them;
the host copy of the previous ids is queued before it.

Padded rows have slot -1 (the KV write skips them) and context length 0 (attention writes zeros
for them); their logits are computed and ignored. The attention kernels size their grids from the
captured `max_seq_len`, and divide each request's context among the splits at run time, so one
graph serves every context length.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata

try:   # GPU only; the input buffer and staging also run on CPU tensors (tests)
    from backend.kernels.argmax import argmax_rows
    from backend.kernels.placeholders import fill_placeholders
except ImportError:
    argmax_rows = fill_placeholders = None

log = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch_size: int, max_seq_len: int,
                 tokens_per_block: int):
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len
        self.sizes = capture_sizes(max_batch_size)
        n, blocks = max_batch_size, -(-max_seq_len // tokens_per_block)
        # Every per-step input lives in one device buffer, so that a step's inputs arrive in one
        # host-to-device copy (`stage`): separate small device-to-device copies into the graph's
        # inputs cost ~12 us of GPU time each on H200, 6% of a batch-1 step of Llama-3.2-1B.
        # The block table comes last: a step copies only its own rows of it.
        fields = [("input_ids", torch.int64, (n,)), ("positions", torch.int64, (n,)),
                  ("slot_mapping", torch.int64, (n,)), ("fill_src", torch.int64, (n,)),
                  ("seq_lens", torch.int32, (n,)), ("block_tables", torch.int32, (n, blocks))]
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in fields]
        aligned = [-(-size // 16) * 16 for size in sizes]         # every field starts 16-aligned
        self.offsets = {name: sum(aligned[:i]) for i, (name, _, _) in enumerate(fields)}
        self.buffer = torch.zeros(sum(aligned), dtype=torch.uint8, device=device)
        for (name, dtype, shape), size in zip(fields, sizes):
            start = self.offsets[name]
            setattr(self, name, self.buffer[start:start + size].view(dtype).view(shape))
        self.slot_mapping.fill_(-1)
        self.fill_src.fill_(-1)
        self.sampled_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        """The padded batch size (captured graph) that runs n rows."""
        return next(s for s in self.sizes if s >= n)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[0] * size)

    def _forward(self, size: int) -> torch.Tensor:
        fill_placeholders(self.input_ids[:size], self.fill_src[:size], self.sampled_ids)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._meta(size))
        logits = self.model.compute_logits(hidden)
        argmax_rows(logits, out=self.sampled_ids[:size])
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, sharing one memory pool (smaller graphs reuse the larger one's memory)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # compile kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(size)
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def stage(self, staging, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              seq_lens: np.ndarray, block_tables: np.ndarray, fill_rows: np.ndarray,
              fill_src: np.ndarray, prev_sampled: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy one decode step of n rows into the graph's inputs through `staging` (a
        `StagingBuffer`), padded to the graph size: padded rows get slot -1 (the KV write skips
        them) and context length 0 (attention writes zeros for them); their logits are ignored.
        `fill_rows`/`fill_src`: rows whose input id is the previous step's sampled id at
        `fill_src` of `prev_sampled` (filled by the graph). Returns the input ids (as staged,
        before the fill), positions and metadata, as views."""
        n, size = len(input_ids), self.size_for(len(input_ids))
        if len(fill_rows) and prev_sampled.data_ptr() != self.sampled_ids.data_ptr():
            self.sampled_ids[:len(prev_sampled)].copy_(prev_sampled)

        def padded(a: np.ndarray, value: int, dtype) -> np.ndarray:
            out = np.full((size,) + a.shape[1:], value, dtype=dtype)
            out[:n] = a
            return out

        table = np.zeros((size, self.block_tables.shape[1]), dtype=np.int32)
        table[:n, :block_tables.shape[1]] = block_tables
        row_src = np.full(size, -1, dtype=np.int64)
        row_src[fill_rows] = fill_src
        placed = [(self.offsets["input_ids"], padded(input_ids, 0, np.int64)),
                  (self.offsets["positions"], padded(positions, 0, np.int64)),
                  (self.offsets["slot_mapping"], padded(slots, -1, np.int64)),
                  (self.offsets["fill_src"], row_src),
                  (self.offsets["seq_lens"], padded(seq_lens, 0, np.int32)),
                  (self.offsets["block_tables"], table)]
        staging.to_device_at(placed, self.buffer)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n], block_tables=self.block_tables[:n, :block_tables.shape[1]],
            max_query_len=1, max_seq_len=int(seq_lens.max()), query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens.tolist())
        return self.input_ids[:n], self.positions[:n], meta

    def replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the staged step (n rows) in the smallest graph that fits: float32 logits
        [n, vocab] and each row's argmax [n] (views of the graph's outputs, valid until the next
        replay)."""
        graph, logits = self.graphs[self.size_for(n)]
        graph.replay()
        return logits[:n], self.sampled_ids[:n]
