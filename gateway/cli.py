"""``vllm-guard serve | check-config``."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from gateway import __version__
from gateway.config import ConfigError, Settings, load_settings


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    for key in ("host", "port", "workers"):
        value = getattr(args, key)
        if value is not None:
            server[key] = value
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.backend:
        overrides["upstream"] = {
            "backends": [
                {"name": f"backend{i}" if i else "default", "url": url}
                for i, url in enumerate(args.backend)
            ]
        }
    return overrides


def _prepare_multiprocess_metrics(settings: Settings) -> None:
    """Several workers share one metrics view through prometheus_client's files."""
    if settings.server.workers <= 1 or not settings.metrics.enabled:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        return
    directory = settings.metrics.multiproc_dir or tempfile.mkdtemp(prefix="vllm-guard-metrics-")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import RESOLVED_SETTINGS_ENV

    try:
        settings = load_settings(args.config, _serve_overrides(args))
    except ConfigError as exc:
        print(f"vllm-guard: {exc}", file=sys.stderr)
        return 2
    _prepare_multiprocess_metrics(settings)
    os.environ[RESOLVED_SETTINGS_ENV] = settings.model_dump_json()
    server = settings.server
    uvicorn.run(
        "gateway.app:create_app",
        factory=True,
        host=server.host,
        port=server.port,
        workers=server.workers,
        log_level=server.log_level,
        loop="uvloop",
        http="httptools",
        access_log=False,
        timeout_graceful_shutdown=30,
        proxy_headers=False,
    )
    return 0


def check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.file)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    backends = ", ".join(f"{b.name}={b.url} ({b.role})" for b in settings.upstream.backends)
    print(f"{args.file}: OK")
    print(f"  backends: {backends}")
    print(
        f"  guard: mode={settings.guard.mode}, max_attempts={settings.guard.max_attempts}, "
        f"on_exhausted={settings.guard.on_exhausted}, "
        f"holdback_chars={settings.guard.stream.holdback_chars}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-guard",
        description="Response-guarding OpenAI-compatible gateway for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-guard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="run the gateway")
    serve_parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    serve_parser.add_argument(
        "--backend",
        action="append",
        help="vLLM base URL; repeat for several (overrides the config's backends; "
        "default http://127.0.0.1:8000)",
    )
    serve_parser.add_argument("--host")
    serve_parser.add_argument("--port", type=int)
    serve_parser.add_argument("--workers", type=int)
    serve_parser.set_defaults(func=serve)

    check = commands.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
