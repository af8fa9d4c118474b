"""One choice: the pieces of a tensorrt_llm request -> text deltas, log-probs and its end.

Text: postprocessing's incremental detokenizer over the ids received so far (the window the
ensemble's postprocessing step would get), so the deltas concatenate to the ensemble's text.
Stop strings the engine could not stop on are cut here, and the engine request is then cancelled
(leaving the stream cancels the gRPC call).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from ensemble.openai_server.engine_request import EngineRequest
from ensemble.openai_server.logprobs import TokenLogprob, prompt_tokens_of, tokens_of
from ensemble.openai_server.stop_strings import StopStrings
from ensemble.openai_server.triton_llm import TritonLLM
from postprocessing.detokenizer import text_delta, window_start

# the engine's finish reasons -> OpenAI's
FINISH_REASONS = {"length": "length", "stop": "stop", "end_id": "stop"}


@dataclass
class Delta:
    text: str
    tokens: list[TokenLogprob]  # log-probs of the tokens that arrived with this text
    finish_reason: str | None = None  # set on the last delta


@dataclass
class Choice:
    """A choice's state while it is generated."""

    tokenizer: object
    stops: list[str]
    drop_output: bool = False  # max_tokens 0 with echo: the one generated token is not shown
    # Set when the engine was told to ignore the end id so that a scored continuation always has
    # its one token: reaching it here ends the choice with "stop", its log-prob kept.
    end_id: int | None = None
    ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # generated ids, for usage
    prompt_tokens: list[TokenLogprob] | None = None  # with prompt log-probs, from the first piece
    finish_reason: str | None = None

    async def run(self, llm: TritonLLM, request: EngineRequest) -> AsyncIterator[Delta]:
        """Deltas until the end; the last one carries the finish reason."""
        stop = StopStrings(self.stops)
        engine_reason = ""
        async with aclosing(llm.generate(request)) as pieces:  # closed (cancelled) on leaving
            async for piece in pieces:
                if piece.prompt_log_probs is not None and self.prompt_tokens is None:
                    self.prompt_tokens = prompt_tokens_of(
                        request.prompt_ids,
                        piece.prompt_log_probs,
                        piece.prompt_top_ids,
                        piece.prompt_top_log_probs,
                    )
                engine_reason = piece.finish_reason or engine_reason
                if self.drop_output:
                    self.num_tokens = 0
                    continue
                text = self._detokenize(piece.ids, piece.final)
                tokens = (
                    tokens_of(piece.ids, piece.log_probs, piece.top_ids, piece.top_log_probs)
                    if piece.log_probs
                    else []
                )
                released = stop.feed(text, final=piece.final)
                if stop.matched:
                    self.finish_reason = "stop"
                    yield Delta(released, tokens[: self._tokens_within(released, tokens)], "stop")
                    return  # leaving the stream cancels the engine request
                if piece.final:
                    self.finish_reason = FINISH_REASONS.get(engine_reason, "stop")
                    if self.end_id is not None and self.ids[-1:] == [self.end_id]:
                        self.finish_reason = "stop"
                    yield Delta(released, tokens, self.finish_reason)
                    return
                if released or tokens:
                    yield Delta(released, tokens)
        if self.drop_output:
            self.finish_reason = "length"
            yield Delta("", [], "length")

    def _detokenize(self, new_ids: list[int], final: bool) -> str:
        num_sent = len(self.ids)
        self.ids += new_ids
        self.num_tokens = len(self.ids)
        if not new_ids and not final:
            return ""
        start = window_start(num_sent)
        return text_delta(self.tokenizer, self.ids[start:], num_sent - start, final)

    def _tokens_within(self, text: str, tokens: list[TokenLogprob]) -> int:
        """How many of `tokens` start inside `text` (the released part of their piece)."""
        length = 0
        for count, token in enumerate(tokens):
            if length >= len(text):
                return count
            length += len(self.tokenizer.decode([token.token_id]))
        return len(tokens)


async def run_all(llm: TritonLLM, runs: list[tuple[Choice, EngineRequest]]) -> list[list[Delta]]:
    """Every choice's deltas, generated concurrently; the first failure cancels the others (their
    engine requests end at once instead of running on for nobody)."""

    async def collect(choice: Choice, request: EngineRequest) -> list[Delta]:
        return [delta async for delta in choice.run(llm, request)]

    tasks = [asyncio.ensure_future(collect(choice, request)) for choice, request in runs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
