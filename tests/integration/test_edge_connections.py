"""Connection-level limits, on the gateway as ``vllm-guard serve`` runs it.

Headers bounded while they arrive, time limits for a request head and body, a
connection limit that answers 503 instead of resetting. Raw sockets throughout:
these are things no client library would send. Timeouts here are 1 s and every
wait allows 10 s, so a slow machine passes; a gateway without the limit never
closes the connection at all.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from support.servers import free_port, wait_http
from support.stub_backend import StubBackend


@pytest.fixture(scope="module")
def stub() -> Iterator[StubBackend]:
    with StubBackend() as backend:
        yield backend


class Served:
    def __init__(self, stub: StubBackend, **server: object) -> None:
        self.port = free_port()
        env = {**os.environ}
        for key, value in server.items():
            env[f"VLLM_GUARD_SERVER__{key.upper()}"] = str(value)
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-guard-log-")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--backend", stub.url,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/readyz", 30, self.process)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return sock

    def rss_kib(self) -> int:
        for line in open(f"/proc/{self.process.pid}/status"):  # noqa: SIM115
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


@pytest.fixture
def serve(stub: StubBackend) -> Iterator[type[Served]]:
    started: list[Served] = []

    def start(**server: object) -> Served:
        gateway = Served(stub, **server)
        started.append(gateway)
        return gateway

    yield start  # type: ignore[misc]
    for gateway in started:
        gateway.stop()


def read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes; and how long that took."""
    started = time.monotonic()
    data = b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - started


def test_endless_header_lines_are_refused_while_they_arrive(
    serve: type[Served], stub: StubBackend
) -> None:
    """Three connections sending 50 MB of header lines each took the gateway's RSS up
    by hundreds of MiB before. Now each gets a 431 within the first reads."""
    gateway = serve(max_header_bytes=8192)
    before = gateway.rss_kib()
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    for _ in range(3):
        sock = gateway.connect()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n")
        sent = 0
        try:
            while sent < 50 * 1024 * 1024:
                sock.sendall(line * 64)
                sent += len(line) * 64
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = read_until_closed(sock)
        sock.close()
        assert sent < 50 * 1024 * 1024, "the gateway read 50 MB of header lines"
        assert data.startswith(b"HTTP/1.1 431 "), data[:100]
        assert orjson.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    assert gateway.rss_kib() - before < 32 * 1024
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_silent_and_half_sent_heads_are_closed(serve: type[Served]) -> None:
    gateway = serve(header_timeout_s=1)
    silent = gateway.connect()
    partial = gateway.connect()
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
    data, waited = read_until_closed(silent)
    assert data == b""
    assert waited < 8
    data, waited = read_until_closed(partial)
    assert data.startswith(b"HTTP/1.1 408 "), data[:100]
    assert waited < 8


def test_a_body_that_never_finishes_is_closed(serve: type[Served], stub: StubBackend) -> None:
    gateway = serve(body_timeout_s=1)
    sock = gateway.connect()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    _, waited = read_until_closed(sock)
    assert waited < 8
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_a_full_gateway_answers_503_in_openai_shape(serve: type[Served]) -> None:
    gateway = serve(max_connections=4, header_timeout_s=60)
    idle = [gateway.connect() for _ in range(4)]
    try:
        time.sleep(0.3)
        response = httpx.get(gateway.url + "/healthz", timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200


def test_json_logs_carry_the_request_id(serve: type[Served], stub: StubBackend) -> None:
    gateway = serve(log_format="json")
    stub.state.forced_scenario = "not-json"
    try:
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "a secret prompt"}]},
            headers={"x-request-id": "req-json-log-1"},
        )
    finally:
        stub.state.forced_scenario = None
    assert response.status_code == 502
    time.sleep(0.5)
    text = Path(gateway.log.name).read_bytes()
    lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    mine = [line for line in lines if line.get("request_id") == "req-json-log-1"]
    assert mine, lines
    assert mine[0]["level"] == "warning"
    assert b"a secret prompt" not in text
