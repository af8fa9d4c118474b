"""All-reduce time inside a CUDA graph on two GPUs: NCCL against the peer-mapped buffer
(`backend.distributed.peer_all_reduce`), for [rows, hidden] activations as a tensor-parallel decode
step sums them (two per layer).

Each figure is one all-reduce's share of a graph of 64 back to back, replayed 50 times; the
sums are checked against the expected values on both paths.

    python -m benchmarks.all_reduce --hidden 4096 --rows 1 8 64 256 512 1024 --json OUT
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp

from benchmarks.provenance import provenance, save_json

PER_GRAPH, REPLAYS = 64, 50


def graph_time_us(step) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for _ in range(PER_GRAPH):
            step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPLAYS / PER_GRAPH * 1e6


def rank_main(rank: int, port: int, args, out: dict) -> None:
    from backend.distributed.tensor_parallel import TensorParallel, connect

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    tp = connect(rank, 2, port, device, dtype)
    nccl_only = TensorParallel(tp.rank, tp.size, tp.group, tp.cpu_group)
    rows = []
    for n in args.rows:
        x = torch.empty(n, args.hidden, dtype=dtype, device=device)
        row = {"rows": n, "bytes": x.numel() * x.element_size()}
        for name, group in (("nccl", nccl_only), ("peer", tp)):
            if name == "peer" and not (tp.peer and tp.peer.takes(x)):
                continue
            x.fill_(rank + 1.0)
            group.all_reduce(x)
            torch.cuda.synchronize()
            row[f"{name}_correct"] = bool((x == 3.0).all())
            row[f"{name}_us"] = round(graph_time_us(lambda: group.all_reduce(x)), 2)
        rows.append(row)
    tp.close()
    if rank == 0:
        out["rows"] = rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.all_reduce", description=__doc__.splitlines()[0]
    )
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512, 1024])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from backend.distributed.tp_workers import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(free_port(), args, out), nprocs=2)
        rows = list(out["rows"])
    meta = {
        "benchmark": "all_reduce",
        **provenance(torch.device("cuda", 0)),
        "gpus": torch.cuda.device_count(),
        "hidden": args.hidden,
        "dtype": args.dtype,
    }
    results = [{**meta, **row} for row in rows]
    for r in results:
        print(r)
    save_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
