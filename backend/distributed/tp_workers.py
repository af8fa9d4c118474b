"""The worker processes of a tensor-parallel engine, and the step inputs rank 0 sends them.

Rank 0 is the engine (scheduler, sampler, outputs); it starts ranks 1..N-1 with the spawn start
method (fork can deadlock on a parent's threads). Each worker builds its shard of the model and
a KV pool of its own (per KV cache group the same number of blocks on every rank: the least any
rank can hold, since rank 0's block tables address them all), then follows: for each step rank 0
broadcasts the packed step inputs it built (`EagerStep`: token ids, positions, cache slots, query
starts, context lengths, block tables (slots and tables of each KV cache group in turn), logit
rows, the rows whose ids are in flight; and the prompt rows some request wants log-probs of) and
every rank runs the forward pass and the logits (whose collectives pair up). Only rank 0 samples,
from the gathered logits: sampling state (seeded generators, penalties' token history) lives
with the requests on rank 0 alone, and the ids every rank computes with next are the ones rank 0
sends, so no rank can pick another token.

A worker's death: a watchdog thread on rank 0 waits on the workers' process sentinels and names
the rank that died; a collective with a dead peer fails at once (a hung one after
`COLLECTIVE_TIMEOUT_S`), and the engine then fails its requests with that message and stops
(`backend.engine.executor`).

Decode CUDA graphs: every rank captures the same graphs (their all-reduces and gathers pair up
when replayed). For a step rank 0 replays, it sends a GRAPH_STEP (`GraphStep`: the rows' ids,
positions, slots, context lengths, block tables, in-flight rows and banned ids, in the same
message layout): each worker stages the same step into its own graphs and replays the same graph.
The previous ids that inputs in flight read are the worker's own graphs' argmax when rank 0's are
its graphs' (the logits every rank gathers are the same, and so are the bans); when rank 0's came
from elsewhere (its sampler, an eager step) it broadcasts them on the device (`ids_sent`).

Step message on the gloo group: a header of HEADER_LEN int64 (command, the eight array lengths,
chunks, block-table width, prompt spans), then one int64 payload of the arrays and the spans.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np
import torch

from backend.config import EngineConfig
from backend.distributed.tensor_parallel import TensorParallelError

log = logging.getLogger(__name__)

HEADER_LEN = 12
STOP, STEP, GRAPH_STEP = 0, 1, 2
# input ids, positions, slots, query starts, context lengths, block tables, logit rows, fill rows
ARRAY_DTYPES = (np.int64, np.int64, np.int64, np.int32, np.int32, np.int32, np.int64, np.int64)
IDLE_WAIT = datetime.timedelta(days=3650)  # a worker waits for the next step as long as it takes
DEATH_GRACE_S = 2.0  # how long a failed collective waits for the watchdog to name a dead rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, rank: int, device: torch.device) -> torch.device:
    """The device of `rank`: on CUDA the `gpu_device_ids` entry of the rank, else its index."""
    if device.type != "cuda":
        return device
    ids = [int(i) for i in config.gpu_device_ids.split(",")] if config.gpu_device_ids else None
    return torch.device("cuda", ids[rank] if ids else rank)


# ---- step inputs ---------------------------------------------------------------------------------
@dataclass
class EagerStep:
    """A step run eagerly, as rank 0 packed it (`backend.runner.step_packing`) and sends it."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [groups * T], each KV cache group's in turn
    query_start_loc: np.ndarray  # int32 [N + 1]
    seq_lens: np.ndarray  # int32 [N]
    block_tables: np.ndarray  # int32 [groups * N, width], each group's in turn
    logits_indices: np.ndarray  # int64, the rows whose logits the step computes
    in_flight_rows: np.ndarray | None = None  # int64: the rows whose input id is in flight
    # Rank 0 only, not sent (the workers get the ids themselves): each such row's row of the
    # ids of the step in flight.
    in_flight_sources: np.ndarray | None = None

    def arrays(self) -> list[np.ndarray]:
        """In the message's slots (ARRAY_DTYPES' order)."""
        arrays = [self.input_ids, self.positions, self.slots, self.query_start_loc]
        arrays += [self.seq_lens, self.block_tables, self.logits_indices]
        return arrays + ([] if self.in_flight_rows is None else [self.in_flight_rows])

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray]) -> EagerStep:
        packed, in_flight_rows = arrays[:7], arrays[7] if len(arrays) > 7 else None
        return cls(*packed, in_flight_rows)


@dataclass
class GraphStep:
    """A decode step the graphs replay, as rank 0 staged it (`DecodeGraphs.stage`'s arrays)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    in_flight: np.ndarray | None  # per row: its input's row of the previous ids, -1 when known
    banned_ids: np.ndarray | None  # [rows, k]
    ids_sent: bool  # rank 0 broadcasts the previous ids after this message

    def arrays(self) -> list[np.ndarray]:
        """In a step's message slots: the bans (flattened) where query starts go, [ids_sent,
        ban width] where logit rows go."""
        bans = self.banned_ids if self.banned_ids is not None else np.empty((0, 0), np.int64)
        flags = np.array([self.ids_sent, bans.shape[1]], dtype=np.int64)
        arrays = [self.input_ids, self.positions, self.slots, bans.reshape(-1), self.seq_lens]
        arrays += [self.block_tables, flags]
        return arrays + ([] if self.in_flight is None else [self.in_flight])

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray]) -> GraphStep:
        input_ids, positions, slots, bans, seq_lens, block_tables, flags, *in_flight = arrays
        ids_sent, width = int(flags[0]), int(flags[1])
        return cls(
            input_ids,
            positions,
            slots,
            seq_lens,
            block_tables,
            in_flight[0] if in_flight else None,
            bans.reshape(len(input_ids), width) if width else None,
            bool(ids_sent),
        )


def send_step(tp, step: EagerStep | GraphStep, spans: list[tuple[int, int]] = ()) -> None:
    """Rank 0: broadcast a step's host arrays (`arrays()`) and its prompt spans (first row,
    rows)."""
    arrays = step.arrays()
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0] = GRAPH_STEP if isinstance(step, GraphStep) else STEP
    header[1 : 1 + len(arrays)] = [a.size for a in arrays]
    header[9], header[10] = arrays[5].shape
    header[11] = len(spans)
    parts = [a.reshape(-1).astype(np.int64, copy=False) for a in arrays]
    parts.append(np.asarray(spans, dtype=np.int64).reshape(-1))
    tp.broadcast(torch.from_numpy(header), host=True)
    tp.broadcast(torch.from_numpy(np.concatenate(parts)), host=True)


def send_stop(tp) -> None:
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    tp.broadcast(torch.from_numpy(header), host=True)


def receive_step(tp) -> tuple[EagerStep | GraphStep, list[tuple[int, int]]] | None:
    """A worker: the next step and its prompt spans, or None when rank 0 stops."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    tp.cpu_group.broadcast(header, 0, IDLE_WAIT).wait()
    header = header.numpy()
    if header[0] == STOP:
        return None
    sizes = header[1:9]
    payload = torch.empty(int(sizes.sum() + 2 * header[11]), dtype=torch.int64)
    tp.broadcast(payload, host=True)
    values, arrays, at = payload.numpy(), [], 0
    for i, (size, dtype) in enumerate(zip(sizes, ARRAY_DTYPES)):
        if size or i < len(ARRAY_DTYPES) - 1:  # the fill rows only when some id is in flight
            arrays.append(values[at : at + size].astype(dtype))
        at += size
    arrays[5] = arrays[5].reshape(int(header[9]), int(header[10]))
    spans = [tuple(s) for s in values[at:].reshape(-1, 2).tolist()]
    step_type = GraphStep if header[0] == GRAPH_STEP else EagerStep
    return step_type.from_arrays(arrays), spans


# ---- the workers, seen from rank 0 ---------------------------------------------------------------
class Workers:
    """Ranks 1..N-1 as processes, with a watchdog. `on_death(message)` is called (from the
    watchdog thread) when one of them exits while the engine runs."""

    def __init__(self, config: EngineConfig, port: int, runner_class: type):
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=worker_main,
                args=(runner_class, config, rank, port),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, config.tensor_parallel_size)
        ]
        for process in self.processes:
            process.start()
        self.dead: str | None = None  # names the first rank that died
        self.on_death = lambda message: None
        self._stopping = False
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        rank = self._first_dead(timeout=None)
        if self._stopping:
            return
        message = self._death(rank)
        log.error(message)
        self.on_death(message)

    def _first_dead(self, timeout: float | None) -> int | None:
        """The rank of a worker that has exited, waiting up to `timeout` for one. Sentinels, not
        exit codes: the watchdog and the engine thread may both ask, and only one can reap."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ended = wait(list(sentinels), timeout=timeout)
        return sentinels[ended[0]] if ended else None

    def _death(self, rank: int) -> str:
        """Record and return the message naming `rank`, which has exited (the first one wins)."""
        process = self.processes[rank - 1]
        process.join(timeout=1)  # reaps it, unless the other thread already does
        if self.dead is None:
            self.dead = (
                f"tensor-parallel rank {rank} (pid {process.pid}) died "
                f"(exit code {process.exitcode}); the engine cannot run"
            )
        return self.dead

    def explain(self, exc: TensorParallelError) -> TensorParallelError:
        """A failed collective, named after the rank that died when one did (waiting a moment
        for it to be gone)."""
        if self.dead is None:
            rank = self._first_dead(timeout=DEATH_GRACE_S)
            if rank is not None:
                self._death(rank)
        return TensorParallelError(self.dead) if self.dead else exc

    def stop(self, tp, timeout_s: float = 30.0) -> None:
        """Tell the workers to exit (when all live) and wait; kill those that do not."""
        self._stopping = True
        if tp is not None and self.dead is None and all(p.is_alive() for p in self.processes):
            try:
                send_stop(tp)
            except TensorParallelError:
                pass
        for process in self.processes:
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.kill()
                process.join()


# ---- a worker (its own process) ------------------------------------------------------------------
def worker_main(runner_class: type, config: EngineConfig, rank: int, port: int) -> None:
    """`runner_class`: rank 0's model runner class (passed, not imported: it imports this)."""
    logging.basicConfig(
        level=logging.INFO, format=f"tp-rank-{rank} %(levelname)s %(name)s: %(message)s"
    )
    runner = runner_class(config, tp_rank=rank, tp_port=port)
    runner.follow()
    runner.release()
