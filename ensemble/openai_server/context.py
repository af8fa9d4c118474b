"""What every handler needs: the served model, the Triton client, and the request body checks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from ensemble.openai_server.errors import ApiError, bad_request
from ensemble.openai_server.logprobs import Formatter
from ensemble.openai_server.protocol import parse
from ensemble.openai_server.served_model import ServedModel
from ensemble.openai_server.triton_llm import TritonLLM


@dataclass
class Context:
    model: ServedModel
    llm: TritonLLM
    metrics_url: str | None  # tritonserver's /metrics, proxied

    def __post_init__(self):
        self.formatter = Formatter(self.model.tokenizer)

    async def body(self, request: web.Request, model_cls):
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        body = parse(model_cls, data)
        if body.model != self.model.name:
            raise ApiError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model.name}`",
                "model",
                "model_not_found",
            )
        return body

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        for token in ids:
            if not 0 <= token < self.model.vocab_size:
                raise bad_request(
                    f"{param}: token id {token} is outside the vocabulary "
                    f"[0, {self.model.vocab_size})",
                    param,
                )
        return ids


CONTEXT = web.AppKey("context", Context)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
