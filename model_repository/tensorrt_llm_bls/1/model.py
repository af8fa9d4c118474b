"""BLS alternative to the ensemble: preprocessing -> tensorrt_llm -> postprocessing, from Python.

Same inputs and outputs as `ensemble`; the wiring is the ensemble's own (ensemble/tensors.py), so
the two entry points cannot drift apart. Each request runs in its own thread, so one instance
serves many requests at once; a watcher stops the LLM request of a client that went away. Its
transaction policy is tensorrt_llm's (both rendered from decoupled_mode): when not decoupled it
calls the LLM once and answers with one response.
"""

from __future__ import annotations

import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble.environment import check_stub_numpy
from ensemble.request_loop import dispatch
from ensemble.stub_watch import dismiss, watch_stub
from ensemble.tensors import ENSEMBLE

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PRE, LLM, POST = ENSEMBLE.steps
OUTPUT_NAMES = [t.name for t in ENSEMBLE.outputs]


class StepError(Exception):
    pass


def call(step, tensors: dict[str, np.ndarray], request_id: str = "", decoupled: bool = False):
    """Run one ensemble step on the tensors available so far (by ensemble tensor name)."""
    inputs = [
        pb_utils.Tensor(model_input, tensors[name])
        for model_input, name in step.inputs.items()
        if name in tensors
    ]
    request = pb_utils.InferenceRequest(
        model_name=step.model,
        inputs=inputs,
        requested_output_names=list(step.outputs),
        request_id=request_id,
    )
    return request.exec(decoupled=decoupled)


def outputs_of(step, response) -> dict[str, np.ndarray]:
    if response.has_error():
        raise StepError(response.error().message())
    found = {}
    for model_output, name in step.outputs.items():
        tensor = pb_utils.get_output_tensor_by_name(response, model_output)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


class TritonPythonModel:
    def initialize(self, args):
        check_stub_numpy()
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(
            json.loads(args["model_config"])
        )
        self.threads: set[threading.Thread] = set()
        self.live: dict[str, object] = {}  # LLM request id -> the client's sender
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self.watch, name="bls-cancel", daemon=True)
        self.watcher.start()
        self.stub_watch = watch_stub(args["model_name"])  # last: a failed load is not a death

    def execute(self, requests):
        dispatch("tensorrt_llm_bls", requests, self.start)

    def start(self, request, tensors: dict[str, np.ndarray], sender) -> None:
        thread = threading.Thread(target=self.serve, args=(tensors, sender), daemon=True)
        with self.lock:
            self.threads.add(thread)
        thread.start()

    def serve(self, tensors: dict[str, np.ndarray], sender) -> None:
        llm_id = f"bls-{uuid.uuid4().hex}"
        try:
            self.generate(tensors, sender, llm_id)
        except StepError as exc:
            self.send(
                sender,
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                FINAL,
                llm_id,
            )
        except Exception as exc:  # never leave a request without its FINAL flag
            pb_utils.Logger.log_error(f"tensorrt_llm_bls: {exc!r}")
            error = pb_utils.TritonError(f"internal error: {exc}")
            self.send(sender, pb_utils.InferenceResponse(error=error), FINAL, llm_id)
        finally:
            with self.lock:
                self.live.pop(llm_id, None)
                self.threads.discard(threading.current_thread())

    def generate(self, tensors: dict[str, np.ndarray], sender, llm_id: str) -> None:
        tensors.update(outputs_of(PRE, call(PRE, tensors)))
        with self.lock:
            self.live[llm_id] = sender
        responses = call(LLM, tensors, request_id=llm_id, decoupled=self.decoupled)
        for response in responses if self.decoupled else [responses]:
            if len(response.output_tensors()) == 0 and not response.has_error():
                continue  # a flag-only final response
            step_tensors = outputs_of(LLM, response)
            merged = {**step_tensors, **outputs_of(POST, call(POST, step_tensors))}
            answer = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(name, merged[name]) for name in OUTPUT_NAMES if name in merged
                ]
            )  # optional ones only when asked
            if not self.decoupled:  # its one response carries FINAL
                self.send(sender, answer, FINAL, llm_id)
                return
            self.send(sender, answer, 0)
        if not self.decoupled:
            raise StepError(f"{LLM.model} answered without outputs")
        self.send(sender, None, FINAL, llm_id)

    def watch(self) -> None:
        """Stop the LLM request of every client that went away (streaming or not). A sender is
        asked only while it is live, under the lock its FINAL send takes: asking after the final
        response (which releases the response factory) crashed tritonserver 2.51."""
        while not self.stopping.wait(0.1):
            with self.lock:
                live = list(self.live)
            for llm_id in live:
                with self.lock:
                    sender = self.live.get(llm_id)
                    try:
                        cancelled = sender is not None and sender.is_cancelled()
                    except Exception as exc:
                        pb_utils.Logger.log_warn(f"tensorrt_llm_bls: cancel check failed: {exc!r}")
                        cancelled = False
                    if cancelled:
                        self.live.pop(llm_id, None)
                if cancelled:
                    self.stop(llm_id)

    def stop(self, llm_id: str) -> None:
        request = pb_utils.InferenceRequest(
            model_name=LLM.model,
            request_id=llm_id,
            requested_output_names=[],
            inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=np.bool_))],
        )
        if not self.decoupled:
            request.exec()
            return
        for _ in request.exec(decoupled=True):
            pass

    def send(self, sender, response, flags: int, llm_id: str | None = None) -> None:
        """Send one response; a FINAL one leaves `live` first, under the watcher's lock."""
        if flags & FINAL:
            with self.lock:
                self.live.pop(llm_id, None)
                self._send_now(sender, response, flags)
        else:
            self._send_now(sender, response, flags)

    @staticmethod
    def _send_now(sender, response, flags: int) -> None:
        try:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)
        except Exception as exc:
            pb_utils.Logger.log_info(f"tensorrt_llm_bls: could not send a response: {exc}")

    def finalize(self):
        dismiss(self.stub_watch)
        self.stopping.set()
        self.watcher.join(timeout=5)
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)
