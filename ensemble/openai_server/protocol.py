"""Request bodies of /v1/completions and /v1/chat/completions (pydantic), with OpenAI's ranges.

Fields OpenAI defines that this server cannot honour are refused by name (400), never silently
ignored: `suffix`, `best_of` other than `n`, `tools`/`functions`, a `response_format` other than
text, non-text message parts. Unknown fields are ignored, as OpenAI's own server does for fields
of newer API versions. Extensions (as vLLM names them): `top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ensemble.openai_server.errors import ApiError, bad_request

MAX_N = 64
MAX_TOP_LOGPROBS = 20  # the engine's num_top_log_probs range


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def check(self) -> None:
        """Rules across fields; raises ApiError naming the field."""


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        words = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [word for word in words if word]


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.suffix:
            raise bad_request("suffix is not supported (no fill-in-the-middle)", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of must equal n ({self.n}) or be left out, got {self.best_of}", "best_of"
            )
        if self.max_tokens == 0 and not self.echo:
            raise bad_request(
                "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens"
            )

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"message content parts must be text, got type {part.type!r}")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    functions: list | None = None
    response_format: dict | None = None

    def check(self) -> None:
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise bad_request(f"{name} are not supported (no tool calling)", name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(
                "response_format must be {'type': 'text'} (no JSON mode)", "response_format"
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.max_tokens == 0:
            raise bad_request("max_tokens must be >= 1", "max_tokens")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[BaseModel], body) -> BaseModel:
    """The request body as `model`, or an ApiError naming the first wrong field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None
    parsed.check()
    return parsed


def _first_error(exc: ValidationError) -> ApiError:
    """The first wrong field; a value that fits none of a field's accepted forms (a union: its
    errors' locations name the forms) is reported once, at the field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else None
    same = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    union = field in UNIONS and len(same) > 1
    param = field if union else ".".join(str(part) for part in first["loc"]) or None
    message = UNIONS[field] if union else first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, param)


UNIONS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "must be a string or a list of strings",
    "messages": "each message needs a role and a content (a string or a list of text parts)",
}
