"""Stop the LLM's engine request when the ensemble request it serves was cancelled.

Triton 2.51 propagates an ensemble request's cancellation (gRPC stream cancel, HTTP client gone)
only to steps scheduled after it, never to the running decoupled LLM step; the postprocessing
requests created for the LLM's later responses do arrive cancelled. So this step tells the LLM to
stop, with the `stop` input and the engine request id the LLM sends along (`llm_request_id`).
Checks are throttled per request: each `is_cancelled()` is an IPC round trip.
"""

from __future__ import annotations

import time

import numpy as np
import triton_python_backend_utils as pb_utils

CHECK_PERIOD_S = 0.25
FORGET_AFTER_S = 600.0


class StopForwarder:
    def __init__(self, llm_model: str = "tensorrt_llm"):
        self.llm_model = llm_model
        self.last_check: dict[str, float] = {}

    def observe(self, request, llm_request_id: str | None, final: bool) -> None:
        if not llm_request_id:
            return
        now = time.monotonic()
        if final:
            self.last_check.pop(llm_request_id, None)
            return
        if now - self.last_check.get(llm_request_id, 0.0) < CHECK_PERIOD_S:
            return
        self.last_check[llm_request_id] = now
        if request.is_cancelled():
            self.last_check[llm_request_id] = now + FORGET_AFTER_S  # stop once
            self.stop(llm_request_id)
        if len(self.last_check) > 10000:
            self.last_check = {k: t for k, t in self.last_check.items() if now - t < FORGET_AFTER_S}

    def stop(self, llm_request_id: str) -> None:
        request = pb_utils.InferenceRequest(
            model_name=self.llm_model,
            request_id=llm_request_id,
            requested_output_names=[],
            inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=np.bool_))],
        )
        for response in request.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(
                    f"postprocessing: stopping {llm_request_id} failed: "
                    f"{response.error().message()}"
                )
