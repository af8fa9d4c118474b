"""Errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, with the HTTP
statuses OpenAI clients act on: 400 bad request, 404 unknown model, 429 retry later (the engine's
queue is full), 503 the server is not ready or shutting down, 500 anything else."""

from __future__ import annotations

from dataclasses import dataclass

# Texts of the engine's refusals (backend/scheduling/scheduler.py, backend/process/client.py) that
# arrive as a Triton error message, and what a client should do about them.
QUEUE_FULL = "request queue is full"
SHUTTING_DOWN = "shutting down"
UNAVAILABLE_HINTS = (
    "failed to connect",
    "connection refused",
    "unavailable",
    "socket closed",
    "not ready",
)

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


def from_triton(message: str) -> ApiError:
    """The ApiError for a Triton error message of a tensorrt_llm request."""
    lowered = message.lower()
    if QUEUE_FULL in lowered:
        return ApiError(429, message, code="rate_limit_exceeded")
    if SHUTTING_DOWN in lowered or any(hint in lowered for hint in UNAVAILABLE_HINTS):
        return ApiError(503, message, code="service_unavailable")
    if "internal error" in lowered:
        return ApiError(500, message, code="internal_error")
    return ApiError(400, message)  # the model's validation: the message names the field
