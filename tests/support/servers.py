"""Real servers for the tests: a tiny vLLM (CPU build), the gateway in a real uvicorn.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` from the vLLM
virtualenv (tests/support/install_vllm.sh) with the test-only poisoning scheduler.
``GatewayServer`` runs ``create_app(settings)`` in a uvicorn thread on a real
socket, so streams, disconnects and mid-stream failures are real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from gateway.config import Settings
from gateway.server.app import create_app
from gateway.server.uvicorn_edge import ServerHooksProtocol
from gateway.tools.localvllm import (
    MODEL_NAME,
    SUPPORT,
    VLLMServer,
    ensure_model,
    free_port,
    vllm_python,
    wait_http,
)

__all__ = [
    "MODEL_NAME", "SUPPORT", "GatewayServer", "RunningRedis", "ThreadedServer", "VLLMServer",
    "ensure_model",
    "free_port",
    "gateway_settings", "vllm_python", "wait_http",
]  # fmt: skip


class ThreadedServer:
    """An ASGI app in a real uvicorn on a real socket, in a background thread.

    (httpx's test conftest does the same: wait for ``started``, never sleep.)"""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        *,
        grace_s: int = 5,
        http: Any = "auto",
        host: str = "127.0.0.1",
    ) -> None:
        self.app = app
        self.host = host
        self.port = port or free_port()
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", loop="asyncio",
            lifespan="on", timeout_graceful_shutdown=grace_s, http=http,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Any:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class GatewayServer(ThreadedServer):
    """The gateway app (``create_app(settings)``) on a real socket, behind the server
    protocol that tells it when a client leaves (``ServerHooksProtocol``, which
    ``vllm-guard serve`` runs too, with its edge limits on top); ``http="auto"``:
    plain uvicorn, where the app watches ``receive()`` instead."""

    def __init__(self, settings: Settings, http: Any = ServerHooksProtocol) -> None:
        self.settings = settings
        super().__init__(create_app(settings), http=http)

    @property
    def runtime(self) -> Any:
        return self.app.runtime


class RunningRedis:
    """A real ``redis-server`` (Debian's package) on a free port, no persistence."""

    def __init__(self, port: int, log_path: Path, password: str | None = None) -> None:
        self.port = port
        self.log_path = log_path
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no"]  # fmt: skip
        if self.password:
            command += ["--requirepass", self.password]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not self.answers():
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                if self.password:
                    conn.sendall(f"AUTH {self.password}\r\n".encode())
                    conn.recv(64)
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str, db: int = 0) -> bytes:
        """One command in RESP (in database ``db``), its raw reply (enough for GET,
        KEYS, DBSIZE)."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            if self.password:
                conn.sendall(f"AUTH {self.password}\r\n".encode())
                conn.recv(64)
            if db:
                conn.sendall(f"SELECT {db}\r\n".encode())
                conn.recv(64)
            conn.sendall(payload.encode())
            return conn.recv(65536)

    def pause(self) -> None:
        """A Redis that hangs: connections open, nothing answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Gone at once, answering nothing still queued (also when paused)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=15)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            self.process.wait(timeout=15)
            self.process = None


def gateway_settings(backend_urls: list[str] | str, **sections: Any) -> Settings:
    urls = [backend_urls] if isinstance(backend_urls, str) else backend_urls
    backends = sections.pop("backends", None) or [
        {"name": f"vllm{i}", "url": url} for i, url in enumerate(urls)
    ]
    upstream = {"backends": backends, **sections.pop("upstream", {})}
    return Settings.model_validate({"upstream": upstream, **sections})


def main() -> None:  # python tests/support/servers.py: start the tiny vLLM by hand
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    model = ensure_model(Path(os.environ.get("VLLM_GUARD_MODEL_DIR", "/tmp/vllm-guard-tiny-model")))
    server = VLLMServer(model, Path("/tmp/vllm-guard-vllm.log"), port=port,
                        poison_rate=float(os.environ.get("VG_POISON_RATE", "0")))  # fmt: skip
    server.start()
    print(f"starting vLLM on {server.url} (log: {server.log_path}) ...", flush=True)
    server.wait_ready()
    print(f"ready: {server.url}  (model name '{MODEL_NAME}'; Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops vLLM too
    try:
        assert server.process is not None
        server.process.wait()
    except (KeyboardInterrupt, SystemExit):
        server.stop()


if __name__ == "__main__":
    main()
