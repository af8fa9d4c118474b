"""The `tensorrt_llm` model over gRPC streaming, from asyncio.

tritonclient.grpc.aio rather than the sync client in threads: every choice is one bidirectional
stream on one shared channel, awaited on the web server's event loop (no thread per request), and
a client that goes away cancels the handler's task, whose `finally` cancels the gRPC call, which
Triton turns into a cancellation of the engine request (its KV blocks are freed at once).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from ensemble.openai_server.engine_request import EngineRequest
from ensemble.openai_server.errors import ApiError, from_triton

LLM_MODEL = "tensorrt_llm"


@dataclass
class Piece:
    """What one tensorrt_llm response adds to a choice."""

    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)  # per id, k of them
    top_ids: list[list[int]] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None  # first response only, when asked
    prompt_top_log_probs: list[list[float]] | None = None
    prompt_top_ids: list[list[int]] | None = None
    finish_reason: str = ""  # the engine's: length, stop, end_id, cancelled; "" until the end
    final: bool = False


class TritonLLM:
    def __init__(self, url: str, model: str = LLM_MODEL):
        self.url = url
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(
                self.model
            )
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    async def generate(self, request: EngineRequest) -> AsyncIterator[Piece]:
        """The pieces of one request until its final one; ApiError on a Triton error."""

        async def one_request():
            yield {
                "model_name": self.model,
                "inputs": request.inputs(),
                "request_id": uuid.uuid4().hex,
                "parameters": {"triton_enable_empty_final_response": True},
            }

        responses = self.client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise from_triton(error.message())
                piece = read_piece(result)
                yield piece
                if piece.final:
                    return
            raise ApiError(503, "tritonserver closed the stream before the final response")
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        except InferenceServerException as exc:
            raise from_triton(exc.message()) from None
        finally:
            responses.cancel()


def read_piece(result) -> Piece:
    piece = Piece()
    final = result.get_response().parameters.get("triton_final_response")
    piece.final = final is not None and final.bool_param
    ids = result.as_numpy("output_ids")
    if ids is None or not ids.size:
        return piece
    length = int(result.as_numpy("sequence_length").reshape(-1)[0])
    piece.ids = [int(t) for t in ids.reshape(-1)[:length]]
    reason = result.as_numpy("finish_reason")
    if reason is not None and reason.size:
        value = reason.reshape(-1)[0]
        piece.finish_reason = value.decode() if isinstance(value, bytes) else str(value)
    log_probs = result.as_numpy("output_log_probs")
    if log_probs is not None:
        piece.log_probs = log_probs.reshape(-1)[:length].tolist()
    top = _rows(result, "top_log_probs", length)
    if top is not None:
        piece.top_log_probs, piece.top_ids = top, _rows(result, "top_token_ids", length)
    prompt = result.as_numpy("prompt_log_probs")
    if prompt is not None:
        piece.prompt_log_probs = prompt.reshape(-1).tolist()
        n = len(piece.prompt_log_probs)
        piece.prompt_top_log_probs = _rows(result, "prompt_top_log_probs", n)
        piece.prompt_top_ids = _rows(result, "prompt_top_token_ids", n)
    return piece


def _rows(result, name: str, length: int) -> list[list] | None:
    """A [1, n, k] output as n lists of k values (None when absent)."""
    array = result.as_numpy(name)
    if array is None:
        return None
    array = np.asarray(array)
    k = array.shape[-1] if array.ndim else 0
    return array.reshape(-1, k)[:length].tolist() if k else [[] for _ in range(length)]


def _rpc_error(exc: grpc.RpcError) -> ApiError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(
            503, f"tritonserver is not reachable: {details}", code="service_unavailable"
        )
    return from_triton(details or str(exc))
