"""Triton adapter of the engine: token ids in, token ids out (TensorRT-LLM names); decoupled
unless rendered with decoupled_mode=false (then one response per request).

The engine runs in a process of its own (backend/process/service.py): this stub answers Triton,
the engine process computes, and neither waits for the other's interpreter. The model's
instances (`llm_instance_count`, each a stub process) share one engine: the first to initialize
starts it, the others attach, so the response path has several interpreters. execute() converts
each request's tensors into engine requests and returns at once; responses are sent from the
response thread (llm_responses.py) as the engine's outputs arrive. A poll thread checks client
cancellation and refreshes the metrics.

When the engine fails for good (a tensor-parallel rank died: its requests have ended with that
error), this stub exits after FATAL_GRACE_S, the time to send those errors: Triton 2.51 offers a
model no way to read not ready, and the stub's watcher (ensemble/stub_watch.py) then stops the
server, so that clients get errors and a supervisor restarts it.
"""

from __future__ import annotations

import json
import os
import threading
import time

import triton_python_backend_utils as pb_utils

from backend.config import EngineConfig
from backend.process.client import EngineProcess
from ensemble.environment import check_stub_numpy
from ensemble.params import engine_kwargs, get_setting, parameters
from ensemble.request_loop import dispatch
from ensemble.stub_watch import dismiss, watch_stub

from llm_inputs import Defaults, convert_request, is_stop_request
from llm_metrics import LlmMetrics
from llm_responses import ResponseDispatcher

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FATAL_GRACE_S = 2.0


class TritonPythonModel:
    def initialize(self, args):
        check_stub_numpy()
        model_config = json.loads(args["model_config"])
        params = parameters(model_config)
        self.config = EngineConfig(**engine_kwargs(params))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        self.defaults = Defaults(
            max_tokens=get_setting(params, "default_max_tokens"),
            exclude_input_in_output=get_setting(params, "exclude_input_in_output"),
            decoupled=self.decoupled,
        )
        self.cancel_period_s = get_setting(params, "cancellation_check_period_ms") / 1000
        self.stats_period_s = get_setting(params, "stats_check_period_ms") / 1000
        # Named by the server's pid (the stubs' parent) and the model: one engine per served model.
        # Its outputs are read by the response thread (ResponseDispatcher), not a thread of its own.
        self.engine = EngineProcess.shared(
            self.config, f"{os.getppid()}-{args['model_name']}", receiver_thread=False
        )
        instances = sum(g.get("count", 1) for g in model_config.get("instance_group") or [{}])
        self.metrics = LlmMetrics(
            args["model_name"],
            args["model_version"],
            self.config.max_batch_size,
            engine_gauges=self.engine.owner,
            instance=args["model_instance_name"] if instances > 1 else None,
        )
        rate = get_setting(params, "response_rate_limit")
        self.dispatcher = ResponseDispatcher(
            self.engine,
            self.metrics,
            self.decoupled,
            gap_per_row_s=instances / rate if rate else 0.0,
        )
        self.engine.on_stop_user = self.dispatcher.stop  # a stop sent to another instance
        self.stopping = threading.Event()
        self.poller = threading.Thread(target=self._poll, name="llm-poll", daemon=True)
        self.poller.start()
        info = self.engine.info
        pb_utils.Logger.log_info(
            f"{args['model_instance_name']} ready: engine process {info.pid} on {info.device} "
            f"({'started' if self.engine.owner else 'attached'}), "
            f"model {info.model_dir}, "
            f"vocab {info.vocab_size}, max_seq_len {info.max_seq_len}, "
            f"config {json.dumps(vars(self.config))}"
        )
        self.stub_watch = watch_stub(args["model_name"])  # last: a failed load is not a death

    def execute(self, requests):
        dispatch("tensorrt_llm", requests, self._handle)

    def _handle(self, request, tensors, sender) -> None:
        if is_stop_request(tensors):
            self._stop(request, sender)
            return
        try:
            rows = convert_request(tensors, self.defaults, self.engine.vocab_size)
            self.dispatcher.submit(request, sender, rows)
        except ValueError:  # answered by `dispatch`; counted like the engine's own refusals
            self.metrics.record_rejected("invalid")
            raise

    def _stop(self, request, sender) -> None:
        user_id = request.request_id()
        if not user_id:
            raise ValueError("stop: a request id is required to stop a request")
        self.dispatcher.stop(user_id)
        self.engine.stop_user(user_id)  # the request may run in another instance
        if self.decoupled:
            sender.send(flags=FINAL)
        else:  # a model that is not decoupled must send a response with its FINAL flag
            sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _poll(self) -> None:
        next_stats = 0.0
        elapsed = 0.0
        while not self.stopping.wait(self.cancel_period_s):
            if self.engine.fatal is not None:
                self._exit_on_fatal(self.engine.fatal)
            try:
                self.dispatcher.poll_cancellations(self.cancel_period_s)
                elapsed += self.cancel_period_s
                stats = self.engine.stats()
                if elapsed >= next_stats and stats is not None:
                    self.metrics.update(stats)
                    next_stats = elapsed + self.stats_period_s
            except Exception as exc:
                pb_utils.Logger.log_warn(f"tensorrt_llm poll: {exc!r}")

    def _exit_on_fatal(self, message: str) -> None:
        pb_utils.Logger.log_error(f"tensorrt_llm: the engine failed: {message}; exiting")
        time.sleep(FATAL_GRACE_S)
        if not self.stopping.is_set():
            os._exit(1)

    def finalize(self):
        # The watcher stays until the end: a thread blocked on a server that exited meanwhile
        # (a metric update) would otherwise leave this stub and its engine behind as orphans.
        try:
            self.stopping.set()
            self.poller.join(timeout=5)
            self.dispatcher.shutdown()  # first: then the handle reads the rest itself
            self.engine.shutdown()
        finally:
            dismiss(self.stub_watch)
