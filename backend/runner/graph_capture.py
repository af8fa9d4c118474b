"""Capturing one CUDA graph per padded size, for the decode graphs (`backend.runner.decode_graphs`)
and the graphs of steps with prompt tokens (`backend.runner.mixed_graphs`)."""

from __future__ import annotations

from typing import Callable

import torch


def capture_largest_first(
    sizes: list[int], forward: Callable[[int], torch.Tensor]
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """size -> (graph, output of `forward(size)` in it). Largest first, sharing one memory pool
    (smaller graphs reuse the larger one's memory); each size runs once outside the capture so
    its kernels compile first. Call under inference mode."""
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            forward(size)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a tensor-parallel group's NCCL watchdog thread may query its events
            # while this thread captures the group's collectives.
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                out = forward(size)
            graphs[size] = (graph, out)
    torch.cuda.current_stream().wait_stream(stream)
    return graphs
