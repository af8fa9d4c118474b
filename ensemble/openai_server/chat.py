"""POST /v1/chat/completions: the messages in the model's chat template, n choices.

The prompt is preprocessing's chat template rendering (the ensemble's `apply_chat_template`, with
the whole conversation instead of one user message), ending with the assistant's turn opener.
"""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web
from jinja2.exceptions import TemplateError

from ensemble.openai_server import sse
from ensemble.openai_server.context import CONTEXT, Context, new_id, now, usage
from ensemble.openai_server.engine_request import engine_request
from ensemble.openai_server.errors import bad_request
from ensemble.openai_server.generation import Choice, run_all
from ensemble.openai_server.protocol import ChatCompletionRequest
from preprocessing.tokenizer import apply_chat_template


def prompt_ids(context: Context, body: ChatCompletionRequest) -> list[int]:
    tokenizer = context.model.tokenizer
    if not tokenizer.chat_template:
        raise bad_request(
            "this model has no chat template; use /v1/completions with a plain prompt", "messages"
        )
    messages = []
    for i, message in enumerate(body.messages):
        try:
            content = message.text()
        except ValueError as exc:
            raise bad_request(f"messages.{i}.content: {exc}", f"messages.{i}.content") from None
        entry = {"role": message.role, "content": content}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    try:
        ids = apply_chat_template(tokenizer, messages)
    except TemplateError as exc:
        raise bad_request(f"the model's chat template refused the messages: {exc}", "messages")
    return context.check_prompt(ids, "messages")


async def create(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body: ChatCompletionRequest = await context.body(request, ChatCompletionRequest)
    ids = prompt_ids(context, body)
    top = (body.top_logprobs or 0) if body.logprobs else None
    runs = [
        (
            Choice(context.model.tokenizer, body.stop_strings()),
            engine_request(body, context.model, ids, body.token_limit(), i, top_log_probs=top),
        )
        for i in range(body.n)
    ]
    reply = Reply(context, body, new_id("chatcmpl"), len(ids))
    if body.stream:
        return await sse.respond(request, reply.stream(runs))
    results = await run_all(context.llm, runs)
    return web.json_response(
        {
            **reply.header("chat.completion"),
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                    "logprobs": reply.logprobs([t for d in deltas for t in d.tokens]),
                    "finish_reason": choice.finish_reason,
                }
                for index, ((choice, _), deltas) in enumerate(zip(runs, results))
            ],
            "usage": reply.usage(runs),
        }
    )


class Reply:
    def __init__(self, context: Context, body: ChatCompletionRequest, reply_id: str, prompt: int):
        self.context, self.body, self.id, self.created = context, body, reply_id, now()
        self.prompt_tokens = prompt

    def header(self, kind: str) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.context.model.name,
        }

    def usage(self, runs) -> dict:
        return usage(self.prompt_tokens, sum(choice.num_tokens for choice, _ in runs))

    def logprobs(self, tokens) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": self.context.formatter.chat(tokens, self.body.top_logprobs or 0)}

    async def stream(self, runs):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
            return {
                **self.header("chat.completion.chunk"),
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                ],
                **extra,
            }

        merged = sse.merge([choice.run(self.context.llm, engine) for choice, engine in runs])
        started = [False] * len(runs)
        async with aclosing(merged):
            async for index, delta in merged:
                if not started[index]:  # the role first, once the engine took the request
                    started[index] = True
                    yield chunk(index, {"role": "assistant", "content": ""})
                logprobs = self.logprobs(delta.tokens) if delta.tokens else None
                if delta.text or logprobs:
                    yield chunk(index, {"content": delta.text}, logprobs)
                if delta.finish_reason:
                    yield chunk(index, {}, finish_reason=delta.finish_reason)
        if include_usage:
            yield {**self.header("chat.completion.chunk"), "choices": [], "usage": self.usage(runs)}
