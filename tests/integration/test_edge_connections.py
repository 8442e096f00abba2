"""Connection-level limits, on the gateway as ``vllm-guard serve`` runs it.

Headers bounded while they arrive, time limits for a request head and body, a
connection limit that answers 503 instead of resetting. Raw sockets throughout:
these are things no client library would send. Timeouts here are 1 s and every
wait allows 10 s, so a slow machine passes; a gateway without the limit never
closes the connection at all.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def test_every_request_is_traceable_in_the_logs_and_counted(
    serve: type[Served], stub: StubBackend
) -> None:
    """``vllm-guard serve`` with JSON logs and the access log on: a request whose
    every attempt is degenerate leaves one outcome line (attempts, kinds, rung,
    outcome, the latency retries added) and one access line, both with its id; a
    request the gateway refuses itself (400) is counted by status and reason."""
    gateway = serve(log_format="json", access_log="true")
    stub.state.forced_scenario = "bang"
    try:
        degenerate = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "a secret prompt"}]},
            headers={"x-request-id": "req-trace-1"},
        )
    finally:
        stub.state.forced_scenario = None
    assert degenerate.headers["x-vllm-guard-verdict"] == "degenerate"
    refused = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"x-request-id": "req-trace-2", "content-type": "application/json"},
    )
    assert refused.status_code == 400
    metrics = httpx.get(gateway.url + "/metrics").text
    assert (
        'vllm_guard_gateway_answered_total{endpoint="chat",reason="invalid_request",'
        'status="400"} 1.0' in metrics
    )
    assert 'verdict="degenerate"' in metrics.split("vllm_guard_request_duration_seconds_count")[1]
    time.sleep(0.5)
    text = Path(gateway.log.name).read_bytes()
    lines = [orjson.loads(line) for line in text.splitlines() if line.startswith(b"{")]
    outcome = [line for line in lines if line.get("outcome")]
    assert len(outcome) == 1
    assert outcome[0]["request_id"] == "req-trace-1"
    assert (outcome[0]["attempts"], outcome[0]["kinds"]) == (3, ["punct_run"] * 3)
    # Rung 1 for the second attempt; the last one takes a fresh random salt, off the
    # ladder (Guard._retry_salt), and leaves the rung as it was.
    assert (outcome[0]["outcome"], outcome[0]["rung"]) == ("degenerate", 1)
    assert 0 <= outcome[0]["added_ms"] <= outcome[0]["duration_ms"]
    access = [line for line in lines if line["logger"] == "vllm_guard.access"]
    assert [(a["request_id"], a["status"], a["path"]) for a in access if a["method"] == "POST"] == [
        ("req-trace-1", 200, "/v1/chat/completions"),
        ("req-trace-2", 400, "/v1/chat/completions"),
    ]
    assert b"a secret prompt" not in text


def established_per_worker(gateway: Served) -> list[int]:
    """How many established client connections each worker holds (from /proc: the
    workers are the server's children that hold a socket listening on its port)."""
    port = f":{gateway.port:04X}"
    listening, established = set(), set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(port):
            (listening if fields[3] == "0A" else established).add(fields[9])
    counts = []
    pid = gateway.process.pid
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        inodes = set()
        for fd in Path(f"/proc/{child}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        if inodes & listening:
            counts.append(len(inodes & established))
    return counts


async def burst_shares(gateway: Served, connections: int) -> list[int]:
    """``connections`` new keep-alive connections at once, each answered once; then how
    many of them each worker holds, fewest first."""

    async def one() -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        writer.write(b"GET /readyz HTTP/1.1\r\nhost: gateway\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        return writer

    writers = await asyncio.gather(*(one() for _ in range(connections)))
    shares = sorted(established_per_worker(gateway))
    for writer in writers:
        writer.close()
    await asyncio.gather(*(writer.wait_closed() for writer in writers))
    return shares


def test_workers_with_reuse_port_share_bursts_of_new_connections(serve: type[Served]) -> None:
    """Two workers on uvicorn's one shared listening socket: the worker that woke first
    for a burst took most of it (uvloop accepts until the queue is empty) and kept it
    (keep-alive): 58/6, 60/4, 63/1, 64/0 of 64 here. With ``server.reuse_port`` (a
    listener per worker) the kernel hashes each connection to one: a share is
    Binomial(64, 1/2), below 12 at odds of 1.0e-7 per burst (2 x P(X <= 11)), so 8
    bursts fail by chance at under 1e-6. (Without reuse_port this test fails.)"""
    gateway = serve(workers=2, reuse_port="true")
    deadline = time.monotonic() + 30
    while len(established_per_worker(gateway)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # the second worker still starting
    shares = []
    for _ in range(8):
        shares.append(asyncio.run(burst_shares(gateway, 64)))
        time.sleep(0.3)  # the closed connections gone from /proc/net/tcp
    assert all(len(share) == 2 and share[0] >= 12 for share in shares), shares


def test_a_second_gateway_on_a_port_whose_workers_listen_is_refused(
    serve: type[Served], stub: StubBackend
) -> None:
    """SO_REUSEPORT would let a second gateway (same user: a double start, an old
    instance during a deploy) join the first one's port and take half its connections;
    its start is refused instead, with uvicorn's exit code and error, as without it."""
    first = serve(workers=2, reuse_port="true")
    second = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--backend", stub.url,
         "--host", "127.0.0.1", "--port", str(first.port), "--workers", "2"],
        env={**os.environ, "VLLM_GUARD_SERVER__REUSE_PORT": "true"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 3, second.stderr[-2000:]
    assert "Address already in use" in second.stderr
    assert httpx.get(first.url + "/readyz", timeout=10).status_code == 200
