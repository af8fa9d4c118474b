"""Server-sent events as OpenAI streams them: `data: {chunk}` events, then `data: [DONE]`.

The response starts only once the first chunk is ready, so a request the engine refuses at once
(queue full, bad input) is answered with its HTTP status and OpenAI's error body; an error after
that is sent as an event holding the error object, as OpenAI's client expects.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web

from ensemble.openai_server.errors import ApiError

_END = object()


async def respond(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    async with aclosing(chunks):  # a client that goes away ends the generation at once
        return await _respond(request, chunks)


async def _respond(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    iterator = chunks.__aiter__()
    try:
        first = await iterator.__anext__()  # an ApiError here becomes a plain error response
    except StopAsyncIteration:
        first = None
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        if first is not None:
            await _send(response, first)
            async for chunk in iterator:
                await _send(response, chunk)
    except ApiError as exc:
        await _send(response, exc.body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index of the iterator, item) from several iterators as items arrive; the first error
    stops them all. Leaving early cancels the ones still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator) -> None:
        try:
            async with aclosing(iterator):
                async for item in iterator:
                    await queue.put((index, item))
            await queue.put((index, _END))
        except BaseException as exc:  # handed to the consumer, cancellation included
            await queue.put((index, exc))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
