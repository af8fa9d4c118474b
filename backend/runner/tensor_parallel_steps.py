"""The tensor-parallel step protocol on the model runner's side (the messages and the worker
processes: backend/distributed/tp_workers.py).

Rank 0 runs each step through `StepSender.run` and sends it to the workers as it is prepared
(`send`: an `EagerStep`, or a `GraphStep` that every rank replays in its own decode graphs,
captured on every rank in the same order, collectives included). A failure once the step was
sent fails the engine (the workers are inside a step rank 0 left: their collectives would pair
wrongly); one before leaves it to the step's requests. A worker `follow`s: it computes what rank
0's forward pass and logits compute, step by step, until rank 0 stops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from backend.distributed import tp_workers
from backend.distributed.tensor_parallel import TensorParallel, TensorParallelError
from backend.distributed.tp_workers import EagerStep, GraphStep
from backend.logprobs import PromptLogprobs, PromptRows, compute_prompt_logprobs

if TYPE_CHECKING:
    from backend.runner.model_runner import ModelRunner

Result = TypeVar("Result")


class StepSender:
    """Rank 0 of a tensor-parallel group: its workers, and the steps it sends them."""

    def __init__(self, tp: TensorParallel, workers: tp_workers.Workers):
        self.tp, self.workers = tp, workers
        self.sending = False  # on once every rank has started (each warmed up by itself)
        self._sent = False  # the step being run has reached the workers

    def run(self, step: Callable[[], Result]) -> Result:
        """`step()`, its failures named as the module docstring says."""
        self._sent = False
        try:
            if self.workers.dead:
                raise TensorParallelError(self.workers.dead)
            return step()
        except TensorParallelError as exc:
            raise self.workers.explain(exc) from exc
        except Exception as exc:
            if not self._sent:  # nothing reached the workers: this step's requests' fault
                raise
            raise TensorParallelError(f"rank 0 failed inside a tensor-parallel step: {exc!r}")

    def send(
        self,
        step: EagerStep | GraphStep,
        prompt_spans: list[tuple[int, int]] = (),
        previous_ids: torch.Tensor | None = None,
    ) -> None:
        """The step to the workers, once they follow, with the prompt rows (first row, rows)
        whose logits it computes; a graph step's `previous_ids` (on the device) follow where the
        inputs in flight read them and they are not the graphs' own argmax (`ids_sent`)."""
        if not self.sending:
            return
        tp_workers.send_step(self.tp, step, list(prompt_spans))
        self._sent = True
        if isinstance(step, GraphStep) and step.ids_sent:
            self.tp.broadcast(previous_ids)


def follow(runner: ModelRunner) -> None:
    """A worker: run the steps rank 0 sends until it stops."""
    with torch.inference_mode():
        while (received := tp_workers.receive_step(runner.tp)) is not None:
            step, spans = received
            if isinstance(step, GraphStep):
                _replay(runner, step)
                continue
            inputs = runner.device_inputs(step)
            hidden = runner.run_model(inputs)
            runner.model.compute_logits(hidden[inputs.logits_indices])
            if spans:  # the same slices as rank 0's, for nobody
                unused = PromptLogprobs(0, 0)
                compute_prompt_logprobs(
                    runner.model.compute_logits,
                    hidden,
                    [PromptRows(unused, [0] * n, first) for first, n in spans],
                )


def _replay(runner: ModelRunner, step: GraphStep) -> None:
    """Stage and replay the decode step rank 0 replays."""
    graphs = runner.decode_graphs
    runner.stage_graph_step(step, None if step.in_flight is None else graphs.sampled_ids)
    if step.ids_sent:  # else the inputs in flight read this rank's own argmax
        runner.tp.broadcast(graphs.sampled_ids)
    graphs.replay(len(step.input_ids))
