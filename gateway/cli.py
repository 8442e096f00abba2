"""``vllm-guard serve | check-config``."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import logging.config
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import SecretStr

from gateway import __version__
from gateway.config import (
    RESOLVED_SETTINGS_FILE_ENV,
    ConfigError,
    EvidenceSettings,
    Settings,
    load_settings,
)


def _workers_arg(value: str) -> int | str:
    """``--workers``: a number, or "auto" (one per usable CPU, resolved in the settings)."""
    return value if value == "auto" else int(value)


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
    # A fresh directory of our own, inside the configured one: never delete (or read
    # stale files from) what the gateway did not create.
    parent = settings.metrics.multiproc_dir
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="vllm-guard-metrics-", dir=parent)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def tune_malloc() -> None:
    """glibc malloc: serve large blocks from a heap that keeps its memory, instead of
    fresh mmap pages on every request (the image sets the same MALLOC_*_ variables).
    On VMs where touching fresh memory is slow, a screenshot request's CPU is
    mostly page faults otherwise (BENCHMARKS.md, "Memory")."""
    if sys.platform != "linux" or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 256 << 20)
    # Worker processes inherit the environment, not mallopt: pass it on.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(256 << 20)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, _serve_overrides(args))
    except ConfigError as exc:
        print(f"vllm-guard: {exc}", file=sys.stderr)
        return 2
    # prometheus_client picks its value class when it is first imported, so the
    # multiprocess directory must be set before anything imports it.
    for warning in settings.warnings():
        logging.getLogger("vllm_guard").warning("configuration: %s", warning)
        print(f"vllm-guard: warning: {warning}", file=sys.stderr)
    _prepare_multiprocess_metrics(settings)
    tune_malloc()
    if settings.metrics.enabled and settings.metrics.port is not None:
        from gateway.server.metrics_port import serve_metrics_port

        serve_metrics_port(
            settings.metrics.host, settings.metrics.port, settings.metrics.api_key_sha256
        )
    settings = with_workers_key(settings)
    from gateway.observe.logs import log_config
    from gateway.server.uvicorn_edge import edge_protocol

    with settings_for_workers(settings):
        # Logging as the server will have it, before the protocol is chosen: a closed
        # version gate's WARNING must reach the log in its format.
        logging.config.dictConfig(log_config(settings.server.log_level, settings.server.log_format))
        run_uvicorn(settings, edge_protocol())
    return 0


def run_uvicorn(settings: Settings, http_protocol: type[asyncio.Protocol] | str) -> None:
    import uvicorn

    from gateway.observe.logs import log_config
    from gateway.server import listeners
    from gateway.server.uvicorn_edge import connection_limit

    server = settings.server
    options: dict[str, Any] = dict(
        app="gateway.server.app:create_app",
        factory=True,
        host=server.host,
        port=server.port,
        workers=server.workers,
        log_level=server.log_level,
        log_config=log_config(server.log_level, server.log_format),
        loop="uvloop",
        http=http_protocol,
        limit_concurrency=connection_limit(server.max_connections),
        access_log=False,
        # uvicorn types it int but waits with asyncio.timeout: a fraction of a second
        # is kept as it is (int() made 0.5 a 0, and 0 "wait forever").
        timeout_graceful_shutdown=server.shutdown_grace_s,
        proxy_headers=False,
    )
    if server.workers == 1 or not server.reuse_port or not listeners.supported():
        uvicorn.run(**options)  # one process, or the workers on uvicorn's shared socket
        return
    # server.reuse_port: uvicorn.run's own path for workers, but with the port bound for
    # a listener per worker (gateway.server.listeners: the kernel spreads connections).
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config(**options)

    try:
        sock = listeners.bind_shared_port(server.host, server.port)
    except OSError as exc:
        logging.getLogger("uvicorn.error").error(exc)
        sys.exit(3)  # uvicorn's STARTUP_FAILURE
    with contextlib.suppress(KeyboardInterrupt):
        Multiprocess(config, sockets=[sock]).run()


@contextlib.contextmanager
def settings_for_workers(settings: Settings) -> Iterator[str]:
    """Hand the resolved settings, secrets included, to this process's app and its
    workers in an anonymous in-memory file (``memfd``) that only processes of this
    user can open, through ``/proc/<this pid>/fd/<n>``, and that is gone with this
    process, however it ends (a signal included): the environment carries only that
    path. (They were in an environment variable, which ``/proc/<pid>/environ``
    shows and every child process inherits; a file on disk would outlive a SIGKILL.)
    Where there is no memfd, a 0600 file in a fresh 0700 directory, removed at exit."""
    data = resolved_settings_json(settings).encode()
    with contextlib.ExitStack() as undo:  # undone in reverse when the server returns
        if hasattr(os, "memfd_create"):
            descriptor = os.memfd_create("vllm-guard-settings", os.MFD_CLOEXEC)
            path = f"/proc/{os.getpid()}/fd/{descriptor}"
        else:
            directory = tempfile.mkdtemp(prefix="vllm-guard-settings-")
            undo.callback(shutil.rmtree, directory, ignore_errors=True)
            path = os.path.join(directory, "settings.json")
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        undo.callback(os.close, descriptor)
        with open(descriptor, "wb", closefd=False) as file:
            file.write(data)
        os.environ[RESOLVED_SETTINGS_FILE_ENV] = path
        undo.callback(os.environ.pop, RESOLVED_SETTINGS_FILE_ENV, None)
        yield path


def check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.file)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2  # as serve does for the same error
    backends = ", ".join(f"{b.name}={b.url} ({b.role})" for b in settings.upstream.backends)
    for warning in settings.warnings():
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    print(f"{args.file}: OK")
    print(f"  backends: {backends}")
    print(
        f"  guard: mode={settings.guard.mode}, max_attempts={settings.guard.max_attempts}, "
        f"on_exhausted={settings.guard.on_exhausted}, "
        f"stream hold-back: release after {settings.guard.stream.min_release_chars} healthy "
        f"characters, ceiling {settings.holdback_for(None)}"
    )
    return 0


def with_workers_key(settings: Settings) -> Settings:
    """Several workers and no salt-ladder key configured: draw one here, in the
    parent, for all of them, so that they compute the same retry salts (without it
    each worker drew its own, and a conversation retried on another worker
    recomputed its prompt: BENCHMARKS.md). Replicas still need the configured key."""
    if settings.server.workers <= 1 or settings.guard.salt_reuse.key is not None:
        return settings
    print(
        f"vllm-guard: guard.salt_reuse.key is not set: drew one for this server's "
        f"{settings.server.workers} workers; replicas need the same configured key "
        "(VLLM_GUARD_GUARD__SALT_REUSE__KEY) to share retry salts",
        file=sys.stderr,
    )
    key = SecretStr(secrets.token_hex(32))
    salt_reuse = settings.guard.salt_reuse.model_copy(update={"key": key})
    guard = settings.guard.model_copy(update={"salt_reuse": salt_reuse})
    return settings.model_copy(update={"guard": guard})


def resolved_settings_json(settings: Settings) -> str:
    """The settings for the worker processes, secrets included: pydantic's JSON masks
    a ``SecretStr`` as ``**********``, which gave every worker the salt-ladder key
    ``**********`` (shared, but one anybody can compute) and no Redis URL at all."""

    def reveal(value: object) -> object:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        raise TypeError(type(value).__name__)

    return orjson.dumps(settings.model_dump(mode="python"), default=reveal).decode()


def hash_key_command(args: argparse.Namespace) -> int:
    from gateway.server.auth import hash_key

    key = sys.stdin.readline().strip() if args.key is None else args.key
    if not key:
        print("vllm-guard: no key given", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def evidence_command(args: argparse.Namespace) -> int:
    from gateway.observe.evidence import evidence_files, read_records, summarise

    files = evidence_files(Path(args.path))
    if not files:
        print(f"vllm-guard: no evidence files at {args.path}", file=sys.stderr)
        return 1
    print(summarise(read_records(files)))
    return 0


def probe_command(args: argparse.Namespace) -> int:
    import asyncio

    import orjson

    from gateway.tools.probe import (
        ProbeConfig,
        format_table,
        plot,
        progress_bar,
        report_json,
        run_probe,
    )

    try:
        extra = orjson.loads(args.extra_body) if args.extra_body else {}
    except orjson.JSONDecodeError as exc:
        print(f"vllm-guard: --extra-body is not JSON: {exc}", file=sys.stderr)
        return 2
    config = ProbeConfig(
        target=args.target.rstrip("/"),
        model=args.model,
        workload=args.workload,
        episodes=args.episodes,
        steps=args.steps,
        concurrency=args.concurrency,
        stream=args.stream,
        max_tokens=args.max_tokens,
        images=args.images,
        extra_body=extra,
        verify_determinism=args.verify_determinism,
        api_key=args.api_key,
        vllm_metrics=args.vllm_metrics,
        seed=args.seed,
    )
    report = asyncio.run(run_probe(config, None if args.json else progress_bar))
    if args.plot:
        plot(report, Path(args.plot))
    if args.json:
        sys.stdout.buffer.write(report_json(report) + b"\n")
    else:
        print(format_table(report))
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from gateway.tools.demo import demo_json, format_demo, run_demo

    result = run_demo(
        poison_rate=args.poison_rate,
        episodes=args.episodes,
        steps=args.steps,
        concurrency=args.concurrency,
        quiet=args.json,
    )
    if args.json:
        sys.stdout.buffer.write(demo_json(result) + b"\n")
    else:
        print()
        print(format_demo(result))
        print(
            "\nThe gateway detected the degenerate answers, retried them with a fresh "
            "cache_salt (a prefix-cache miss, so clean), and delivered clean answers."
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
    serve_parser.add_argument("--workers", type=_workers_arg, help='a number, or "auto"')
    serve_parser.set_defaults(func=serve)

    hash_parser = commands.add_parser(
        "hash-key", help="print the SHA-256 of an API key, for auth.api_key_sha256"
    )
    hash_parser.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    hash_parser.set_defaults(func=hash_key_command)

    evidence = commands.add_parser("evidence", help="summarise an evidence capture store")
    evidence.add_argument("path", nargs="?", default=EvidenceSettings().path)
    evidence.set_defaults(func=evidence_command)

    probe = commands.add_parser(
        "probe", help="measure degenerate answers and the prefix-cache hit rate on a target"
    )
    probe.add_argument("target", help="base URL of a vLLM server or of the gateway")
    probe.add_argument("--model", help="model name (default: the server's default)")
    probe.add_argument(
        "--workload", default="agent", help="'agent' (built in) or a JSONL file of request bodies"
    )
    probe.add_argument("--episodes", type=int, default=8)
    probe.add_argument("--steps", type=int, default=6)
    probe.add_argument("--concurrency", type=int, default=8, help="up to 32 like the field")
    probe.add_argument("--stream", action="store_true")
    probe.add_argument("--max-tokens", type=int, default=24)
    probe.add_argument("--images", action="store_true", help="attach 1-3 small screenshots")
    probe.add_argument("--extra-body", help="JSON merged into every request body")
    probe.add_argument(
        "--verify-determinism",
        action="store_true",
        help="resend greedy requests with a fresh salt and compare the answers",
    )
    probe.add_argument(
        "--vllm-metrics",
        help="vLLM's base URL, to read its own NaN count from (a gateway target's copy "
        "is as of its last scrape of vLLM)",
    )
    probe.add_argument("--api-key")
    probe.add_argument("--seed", type=int, default=0)
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.add_argument("--plot", help="write a PNG of corruption and hit rate over the run")
    probe.set_defaults(func=probe_command)

    demo = commands.add_parser(
        "demo",
        help="tiny local vLLM with a poisoned prefix cache, direct vs. through the gateway "
        "(needs a source checkout's tests/support, or VLLM_GUARD_SUPPORT_DIR naming one)",
    )
    demo.add_argument("--poison-rate", type=float, default=0.1, help="per cached block")
    demo.add_argument("--episodes", type=int, default=8)
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=demo_command)

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
