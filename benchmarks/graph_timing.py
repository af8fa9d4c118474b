"""GPU time of kernel calls, measured from replays of one CUDA graph (no host launch cost)."""

from __future__ import annotations

import torch


def graph_us_per_call(calls, replays: int = 20) -> float:
    """Mean GPU time of one call, in µs, from back-to-back replays of a CUDA graph that runs every
    one of `calls` in turn (so each replay reads as many distinct buffers as the calls do)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile / pick algorithms outside the capture
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(replays):  # untimed: after one replay, a process's first timing ran slow
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / len(calls)
