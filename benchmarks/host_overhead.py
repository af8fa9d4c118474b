"""Host overhead of one engine step: everything but the model.

A fake runner packs the step's inputs (`ModelRunner.prepare`) but skips the forward pass and
returns zero logits, so what is left is the executor's own work per step: scheduling, KV block
bookkeeping, packing, sampling bookkeeping, stop checks and delivery. On GPU this work either adds
to the step time or, with overlap scheduling, hides behind the previous step's forward pass.

Decode steps are isolated by difference: B requests generate N1 and then N2 tokens (fresh random
prompts each time, so prefix reuse does not shorten the second prefill); the extra N2 - N1 steps
take (wall2 - wall1). The machine may be shared: the best of `--repeats` pairs is reported.

    python -m benchmarks.host_overhead [--batch 1 64 256] [--repeats 3] [--overlap] [--profile]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.runner.model_runner import ModelRunner, StepLogits
from backend.sampling_params import SamplingParams


class FakeRunner(ModelRunner):
    """Packs the batch like the real runner, returns zero logits without running the model."""

    def execute(self, chunks, in_flight_ids=None, banned_ids=None, **options):
        self.prepare(chunks, in_flight_ids)
        return StepLogits(torch.zeros(sum(c.samples for c in chunks), self.vocab_size), None)


def tiny_model_dir() -> Path:
    from tests.tiny_models import make_tiny_model

    path = Path(tempfile.gettempdir()) / "host-overhead-tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_model("llama", path)
    return path


def run(executor: Executor, batch: int, isl: int, osl: int, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, executor.vocab_size) for _ in range(isl)] for _ in range(batch)]
    n0 = executor.stats().num_iterations
    start = time.perf_counter()
    executor.generate(prompts, SamplingParams(max_tokens=osl, ignore_end_id=True))
    return time.perf_counter() - start, executor.stats().num_iterations - n0


def ms_per_decode_step(
    batch: int,
    isl: int = 128,
    short: int = 20,
    long: int = 220,
    overlap: bool | None = None,
    repeats: int = 1,
) -> float:
    config = EngineConfig(
        model_path=str(tiny_model_dir()),
        max_batch_size=max(batch, 1),
        max_num_tokens=8192,
        max_seq_len=isl + long + 16,
        tokens_per_block=32,
        overlap_scheduling=overlap,
    )
    executor = Executor(config, runner=FakeRunner(config))
    best = float("inf")
    try:
        run(executor, batch, isl, short, seed=0)  # warm-up
        for i in range(repeats):
            wall1, steps1 = run(executor, batch, isl, short, seed=2 * i + 1)
            wall2, steps2 = run(executor, batch, isl, long, seed=2 * i + 2)
            best = min(best, (wall2 - wall1) * 1e3 / (steps2 - steps1))
    finally:
        executor.shutdown()
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.host_overhead", description=__doc__.splitlines()[0]
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--overlap", action="store_true", help="force overlap scheduling on (CPU test path)"
    )
    p.add_argument(
        "--profile", action="store_true", help="cProfile the executor thread (first batch size)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    overlap = True if args.overlap else None
    if args.profile:
        profile(args.batch[0], overlap)
        return
    for batch in args.batch:
        print(
            f"batch {batch:4d}: "
            f"{ms_per_decode_step(batch, overlap=overlap, repeats=args.repeats):.3f} "
            f"ms/step host overhead"
        )


def profile(batch: int, overlap: bool | None) -> None:
    """cProfile the executor thread (cProfile sees only the thread it is enabled in)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    original = Executor._loop

    def profiled_loop(self):
        profiler.enable()
        try:
            original(self)
        finally:
            profiler.disable()

    Executor._loop = profiled_loop
    try:
        ms_per_decode_step(batch, overlap=overlap)
    finally:
        Executor._loop = original
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
