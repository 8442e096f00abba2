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
    """Several workers (or a separate metrics port) share one metrics view through
    prometheus_client's files."""
    separate_port = settings.metrics.port is not None
    if not settings.metrics.enabled or (settings.server.workers <= 1 and not separate_port):
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        return
    directory = settings.metrics.multiproc_dir or tempfile.mkdtemp(prefix="vllm-guard-metrics-")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, _serve_overrides(args))
    except ConfigError as exc:
        print(f"vllm-guard: {exc}", file=sys.stderr)
        return 2
    # prometheus_client picks its value class when it is first imported, so the
    # multiprocess directory must be set before anything imports it.
    _prepare_multiprocess_metrics(settings)
    import uvicorn

    from gateway.app import RESOLVED_SETTINGS_ENV

    if settings.metrics.enabled and settings.metrics.port is not None:
        from gateway.metrics import serve_metrics_port

        serve_metrics_port(
            settings.metrics.host, settings.metrics.port, settings.metrics.api_key_sha256
        )
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
        timeout_graceful_shutdown=int(server.shutdown_grace_s) or None,
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


def hash_key_command(args: argparse.Namespace) -> int:
    from gateway.app import hash_key

    key = sys.stdin.readline().strip() if args.key is None else args.key
    if not key:
        print("vllm-guard: no key given", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def evidence_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gateway.evidence import evidence_files, read_records, summarise

    files = evidence_files(Path(args.path))
    if not files:
        print(f"vllm-guard: no evidence files at {args.path}", file=sys.stderr)
        return 1
    print(summarise(read_records(files)))
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

    hash_parser = commands.add_parser(
        "hash-key", help="print the SHA-256 of an API key, for auth.api_key_sha256"
    )
    hash_parser.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    hash_parser.set_defaults(func=hash_key_command)

    evidence = commands.add_parser("evidence", help="summarise an evidence capture store")
    evidence.add_argument("path", nargs="?", default="vllm-guard-evidence.jsonl")
    evidence.set_defaults(func=evidence_command)

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
