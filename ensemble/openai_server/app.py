"""The aiohttp application: routes, OpenAI-shaped errors, health and metrics.

/health answers 200 only while tritonserver and its `tensorrt_llm` model are ready (503
otherwise), so a load balancer stops sending requests to a replica that is starting or stopping.
/metrics proxies tritonserver's Prometheus text (the engine's queue and KV metrics), so one port
can be scraped per replica; the same numbers stay on Triton's metrics port.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from ensemble.openai_server import chat, completions
from ensemble.openai_server.context import CONTEXT, Context, now
from ensemble.openai_server.errors import ApiError

log = logging.getLogger("ensemble.openai_server")


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:  # unknown path, wrong method
        if exc.status < 400:
            raise
        error = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}")
        return web.json_response(error.body(), status=exc.status)
    except Exception as exc:  # ours: say so, keep serving
        log.exception("%s %s failed", request.method, request.path)
        error = ApiError(500, f"internal error: {exc}", code="internal_error")
        return web.json_response(error.body(), status=500)


async def models(request: web.Request) -> web.Response:
    name = request.app[CONTEXT].model.name
    return web.json_response({"object": "list", "data": [_model_card(name)]})


async def model(request: web.Request) -> web.Response:
    name = request.app[CONTEXT].model.name
    if request.match_info["name"] != name:
        raise ApiError(
            404,
            f"The model `{request.match_info['name']}` does not exist",
            "model",
            "model_not_found",
        )
    return web.json_response(_model_card(name))


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": now(), "owned_by": "tritonllm"}


async def health(request: web.Request) -> web.Response:
    if await request.app[CONTEXT].llm.ready():
        return web.Response(text="ok")
    raise ApiError(503, "tritonserver or its tensorrt_llm model is not ready", code="not_ready")


async def metrics(request: web.Request) -> web.Response:
    url = request.app[CONTEXT].metrics_url
    if not url:
        raise ApiError(404, "no tritonserver metrics URL was given (--metrics-url)")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(url) as upstream:
                text = await upstream.text()
                if upstream.status != 200:
                    raise ApiError(503, f"tritonserver metrics answered {upstream.status}")
    except aiohttp.ClientError as exc:
        raise ApiError(503, f"tritonserver metrics are not reachable: {exc}") from None
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def make_app(context: Context) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=64 * 1024 * 1024)
    app[CONTEXT] = context
    app.router.add_post("/v1/completions", completions.create)
    app.router.add_post("/v1/chat/completions", chat.create)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def close_client(app: web.Application) -> None:
        await app[CONTEXT].llm.close()

    app.on_cleanup.append(close_client)
    return app
