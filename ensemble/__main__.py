"""Command line: build a model repository, or build and serve it.

  python -m ensemble build --model default --out /tmp/repo [--max-batch-size 16 ...]
  python -m ensemble serve [--model default] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                           [--openai-port 9000]   # the OpenAI-compatible endpoint; 0: none
  python -m ensemble check            # the checked-in model_repository matches the default settings

Every ServeSettings field is an option (`--max-tokens-in-paged-kv-cache 4096`, `--device cpu`, ...).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from backend.config_options import add_config_options, given_fields
from backend.loading.model_paths import check_model, check_quantization, resolve_model
from ensemble.build import SOURCE_REPOSITORY, build_repository, stale_configs
from ensemble.openai_server.process import FrontEndProcess
from ensemble.server import TritonServer, check_ports_free, serve_forever
from ensemble.settings import ServeSettings


def _add_settings_options(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, ServeSettings)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    settings = ServeSettings(**given_fields(args, ServeSettings))
    settings.validate()
    return settings


def make_parser() -> argparse.ArgumentParser:
    """The command line of `python -m ensemble` (build, serve, check)."""
    parser = argparse.ArgumentParser(
        prog="python -m ensemble",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="render a model repository")
    build.add_argument("--out", required=True, type=Path, help="repository directory to write")
    _add_settings_options(build)
    serve = commands.add_parser("serve", help="build a repository and run tritonserver on it")
    serve.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to build the repository (default: a temporary directory)",
    )
    serve.add_argument(
        "--repository",
        type=Path,
        default=None,
        help="serve this existing repository as it is instead of building one",
    )
    serve.add_argument("--log-verbose", type=int, default=0)
    serve.add_argument(
        "--openai-port",
        type=int,
        default=9000,
        help="port of the OpenAI-compatible endpoint (/v1/completions, ...); 0 turns it off",
    )
    serve.add_argument(
        "--health-timeout-s",
        type=float,
        default=60.0,
        help="stop tritonserver, and exit 1 for a supervisor to restart it, when it has not "
        "answered /v2/health/live for this long (a hung server); 0: never",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` OpenAI clients pass (default: the model's file or directory name)",
    )
    _add_settings_options(serve)
    commands.add_parser("check", help="check the checked-in repository against the defaults")
    return parser


def has_chat_template(tokenizer_dir: str) -> bool:
    """Whether the tokenizer has a chat template (what the ready banner suggests)."""
    from preprocessing.tokenizer import load_tokenizer

    return bool(load_tokenizer(tokenizer_dir).chat_template)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)

    if args.command == "check":
        stale = stale_configs(ServeSettings())
        if stale:
            print(
                f"stale config.pbtxt in {SOURCE_REPOSITORY}: {', '.join(stale)}; "
                "run: python -m ensemble build --out model_repository"
            )
            return 1
        print("model_repository matches the default settings")
        return 0
    try:
        settings = settings_from_args(args)
        if args.command == "serve":
            check_ports_free(
                {
                    **{
                        name: getattr(settings, name)
                        for name in ("http_port", "grpc_port", "metrics_port")
                    },
                    "openai_port": args.openai_port,
                }
            )
            if args.health_timeout_s < 0:
                raise ValueError(f"health_timeout_s must be >= 0, got {args.health_timeout_s:g}")
            if not 0 <= args.openai_port <= 65535:
                raise ValueError(f"openai_port must be in [0, 65535], got {args.openai_port}")
            if args.openai_port in (settings.http_port, settings.grpc_port, settings.metrics_port):
                raise ValueError(f"openai_port {args.openai_port} is one of Triton's ports")
        if args.command == "build" or not args.repository:
            check_model(settings.model_path)
            check_quantization(settings.model_path, settings.quantization)
            if settings.tokenizer_dir:
                check_model(settings.tokenizer_dir)
    except (ValueError, TypeError, OSError) as exc:
        parser.error(str(exc))
    chat_template = False  # unknown for a given repository: suggest a request any model takes
    if args.command == "serve" and not args.repository:
        # convert here, once, before the models start
        model_dir = resolve_model(settings.model_path, settings.quantization)
        chat_template = has_chat_template(
            resolve_model(settings.tokenizer_dir) if settings.tokenizer_dir else model_dir
        )
    if args.command == "build":
        out = build_repository(settings, args.out)
        print(f"wrote {out}")
        return 0
    with tempfile.TemporaryDirectory(prefix="tritonllm-repo-") as tmp:
        repository = args.repository or build_repository(settings, args.out or tmp)
        server = TritonServer(
            repository,
            settings.http_port,
            settings.grpc_port,
            settings.metrics_port,
            log_verbose=args.log_verbose,
        )
        front_end = None
        if args.openai_port:
            front_end = FrontEndProcess(
                args.openai_port,
                settings.grpc_port,
                settings.metrics_port,
                settings.model_path,
                settings.tokenizer_dir,
                args.served_model_name,
            )
        return serve_forever(server, front_end, args.health_timeout_s, chat_template)


if __name__ == "__main__":
    sys.exit(main())
