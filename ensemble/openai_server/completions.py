"""POST /v1/completions: one or several prompts (texts or token ids), n choices each.

Choice i of prompt p has index p * n + i. `echo` puts the prompt in front of the text, and with
`logprobs` its tokens in front of the log-probs (the first one null): how lm-eval's
`local-completions` scores a continuation. `max_tokens: 0` with `echo` scores the prompt alone
(the engine generates at least one token: it is generated and dropped).
"""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from ensemble.openai_server import sse
from ensemble.openai_server.context import CONTEXT, Context, new_id, now, usage
from ensemble.openai_server.engine_request import engine_request
from ensemble.openai_server.generation import Choice, Delta, run_all
from ensemble.openai_server.protocol import CompletionRequest
from preprocessing.tokenizer import encode

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Prompt:
    def __init__(self, context: Context, prompt, index: int):
        tokenizer = context.model.tokenizer
        param = "prompt" if index == 0 else f"prompt.{index}"
        if isinstance(prompt, str):
            self.text, self.ids = prompt, encode(tokenizer, prompt)
        else:
            self.ids = list(prompt)
            self.text = None
        context.check_prompt(self.ids, param)
        if self.text is None:
            self.text = tokenizer.decode(self.ids, skip_special_tokens=False)


async def create(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body: CompletionRequest = await context.body(request, CompletionRequest)
    prompts = [Prompt(context, p, i) for i, p in enumerate(body.prompts())]
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    scoring = body.echo and body.logprobs is not None
    # lm-eval reads a scored continuation's log-probs up to the one generated token: that token
    # must come back even when it is the end id (the engine ends on it without delivering it).
    keep_end = scoring and max_tokens <= 1 and not body.ignore_eos
    runs = []  # (prompt, choice, engine request) in index order
    for prompt in prompts:
        for i in range(body.n):
            choice = Choice(
                context.model.tokenizer,
                body.stop_strings(),
                max_tokens == 0,
                end_id=context.model.end_id if keep_end else None,
            )
            engine = engine_request(
                body,
                context.model,
                prompt.ids,
                max(max_tokens, 1),
                i,
                top_log_probs=body.logprobs,
                prompt_log_probs=scoring,
                ignore_end_id=keep_end,
            )
            runs.append((prompt, choice, engine))
    reply = Reply(context, body, new_id("cmpl"))
    if body.stream:
        return await sse.respond(request, reply.stream(runs))
    results = await run_all(context.llm, [(choice, engine) for _, choice, engine in runs])
    choices = [
        reply.choice(index, prompt, choice, deltas)
        for index, ((prompt, choice, _), deltas) in enumerate(zip(runs, results))
    ]
    return web.json_response(
        {
            **reply.header(),
            "choices": choices,
            "usage": reply.usage(runs),
        }
    )


class Reply:
    def __init__(self, context: Context, body: CompletionRequest, reply_id: str):
        self.context, self.body, self.id, self.created = context, body, reply_id, now()

    def header(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.context.model.name,
        }

    def usage(self, runs) -> dict:
        prompt_tokens = sum(len(prompt.ids) for prompt in {id(p): p for p, _, _ in runs}.values())
        return usage(prompt_tokens, sum(choice.num_tokens for _, choice, _ in runs))

    def logprobs(self, choice: Choice, tokens, first: bool, offset: int):
        """The legacy log-probs of `tokens` (after the prompt's on the first chunk with echo);
        text offsets count the tokens' texts from `offset`."""
        if self.body.logprobs is None:
            return None
        if first and self.body.echo:
            tokens = (choice.prompt_tokens or []) + tokens
            offset = 0
        return self.context.formatter.legacy(tokens, self.body.logprobs, offset)

    def choice(self, index: int, prompt: Prompt, choice: Choice, deltas: list[Delta]) -> dict:
        text = "".join(d.text for d in deltas)
        tokens = [t for d in deltas for t in d.tokens]
        return {
            "index": index,
            "text": (prompt.text if self.body.echo else "") + text,
            "logprobs": self.logprobs(choice, tokens, True, 0),
            "finish_reason": choice.finish_reason,
        }

    async def stream(self, runs):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        offsets = [0] * len(runs)  # of each choice's next token in its text
        started = [False] * len(runs)
        iterators = [choice.run(self.context.llm, engine) for _, choice, engine in runs]
        async with aclosing(sse.merge(iterators)) as merged:
            async for index, delta in merged:
                prompt, choice, _ = runs[index]
                text = delta.text
                first = not started[index]
                if first and self.body.echo:
                    text = prompt.text + text
                started[index] = True
                logprobs = self.logprobs(choice, delta.tokens, first, offsets[index])
                if logprobs is not None and logprobs["tokens"]:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                yield {
                    **self.header(),
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": delta.finish_reason,
                        }
                    ],
                    **extra,
                }
        if include_usage:
            yield {**self.header(), "choices": [], "usage": self.usage(runs)}
