"""Run the OpenAI-compatible front end alone, beside a running tritonserver.

python -m ensemble.openai_server --triton-url localhost:8001 --port 9000 --model default
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from ensemble.openai_server.app import make_app
from ensemble.openai_server.context import Context
from ensemble.openai_server.served_model import ServedModel
from ensemble.openai_server.triton_llm import LLM_MODEL, TritonLLM

# On SIGTERM, how long open streams may take to end (a drained engine ends them within a second).
SHUTDOWN_TIMEOUT_S = 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ensemble.openai_server", description=__doc__)
    p.add_argument("--triton-url", default="localhost:8001", help="tritonserver's gRPC address")
    p.add_argument(
        "--metrics-url",
        default="http://localhost:8002/metrics",
        help="tritonserver's metrics, proxied at /metrics ('' to leave out)",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model", default="default", help="the served model, for its tokenizer")
    p.add_argument("--tokenizer-dir", default=None, help="instead of --model's tokenizer")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` clients pass (default: --model's file or directory name)",
    )
    p.add_argument("--llm-model-name", default=LLM_MODEL, help="the Triton model to call")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s openai %(message)s")
    try:
        model = ServedModel.load(args.model, args.served_model_name, args.tokenizer_dir)
    except (OSError, ValueError) as exc:
        p.error(str(exc))

    async def app() -> web.Application:  # the gRPC client needs the server's event loop
        llm = TritonLLM(args.triton_url, args.llm_model_name)
        return make_app(Context(model, llm, args.metrics_url or None))

    print(
        f"OpenAI-compatible endpoint for {model.name!r} on http://{args.host}:{args.port}/v1 "
        f"(tritonserver {args.triton_url})",
        flush=True,
    )
    # handler_cancellation: a client that goes away cancels its handler, hence its engine requests
    web.run_app(
        app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # Streams and the gRPC client are closed by now; skip the interpreter's teardown, where
    # gRPC's threads raised into a half-finalized interpreter ("Error in sys.excepthook").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
