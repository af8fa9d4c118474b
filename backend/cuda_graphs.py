"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; at small batch sizes launching them from
Python costs more than running them. So decode-only steps (every request computes one token) are
captured once per padded batch size and replayed: the step's inputs are copied into static
buffers, the graph runs forward + logits, and the first `n` logit rows are the answer.

Padded rows have slot -1 (the KV write skips them) and context length 0 (attention writes zeros
for them); their logits are computed and ignored. The attention kernels size their grids from the
captured `max_seq_len`, and divide each request's context among the splits at run time, so one
graph serves every context length.
"""
from __future__ import annotations

import logging

import torch

from backend.attention.metadata import AttentionMetadata

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
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[0] * size)

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._meta(size))
        return self.model.compute_logits(hidden)

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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that fits; returns float32 logits [n, vocab]."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        graph, logits = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        graph.replay()
        return logits[:n]
