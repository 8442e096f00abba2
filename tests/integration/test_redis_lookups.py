"""The conversation memory against a real ``redis-server``, through redis-py: lookups
batched into MGETs reach their own requests, a late reply reaches no one, every URL
form redis-py accepts means the same database for writes and lookups, and a Redis
that refuses the connection is never reported as shared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import uvloop
from conftest import ARTIFACTS, RunningRedis, wait_for
from prometheus_client import CollectorRegistry
from support.servers import free_port

from gateway.config import SaltReuseSettings, StateSettings
from gateway.guard.conversations import SaltMemory
from gateway.guard.redis_lookups import BatchedGet
from gateway.guard.shared_state import TOO_LATE, RedisLink, SharedSaltMemory
from gateway.observe.metrics import Metrics

Run = Callable[[Coroutine[Any, Any, Any]], Any]
PASSWORD = "s3cr:et"


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Both event loops the gateway can run on (uvicorn picks uvloop when installed)."""
    return asyncio.run if request.param == "asyncio" else uvloop.run  # type: ignore[return-value]


@pytest.fixture
def redis_with_password() -> Iterator[RunningRedis]:
    server = RunningRedis(free_port(), ARTIFACTS / "redis-password.log", password=PASSWORD)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def memory(url: str) -> tuple[SharedSaltMemory, Metrics]:
    """One process's salt memory, shared through Redis at ``url``."""
    metrics = Metrics(CollectorRegistry(), models=[], backends=[])
    salt_reuse = SaltReuseSettings()
    state = StateSettings.model_validate({"redis_url": url, "lookup_timeout_ms": 1000})
    link = RedisLink(state, metrics)
    return SharedSaltMemory(SaltMemory(salt_reuse), link, salt_reuse), metrics


async def written_then_read(url: str, key: str, salt: str, rung: int) -> tuple[object, float]:
    """One process remembers a conversation's rung through Redis at ``url``; another
    looks it up there (for up to 2 s: the write leaves in the background). What the
    reader found, and its ``vllm_guard_state_shared``."""
    writer, _ = memory(url)
    reader, metrics = memory(url)
    try:
        await writer.link.connect()
        await reader.link.connect()
        writer.remember(key, salt, rung)
        for _ in range(100):
            if (found := await reader.lookup(key)) is not None:
                return found, gauge(metrics, "vllm_guard_state_shared")
            await asyncio.sleep(0.02)
        return None, gauge(metrics, "vllm_guard_state_shared")
    finally:
        await writer.link.close()
        await reader.link.close()


def gauge(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_batched_lookups_reach_their_own_requests(redis_server: RunningRedis, run: Run) -> None:
    for i in range(0, 200, 3):
        redis_server.command("SET", f"key{i}", f"value {i}" * (i % 7))

    async def scenario() -> list[object]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        reads = BatchedGet(client)
        try:
            # 200 lookups in one pass (one MGET), the same key twice among them.
            futures = [reads.get(f"key{i}") for i in range(200)] + [reads.get("key3")]
            return list(await asyncio.gather(*futures))
        finally:
            await client.aclose()

    expected = [f"value {i}".encode() * (i % 7) if i % 3 == 0 else None for i in range(200)]
    assert run(scenario()) == [*expected, b"value 3" * 3]


def test_a_reply_after_its_deadline_reaches_no_one(redis_server: RunningRedis, run: Run) -> None:
    """The lookup gave up (its future holds TOO_LATE); Redis answers it later. The
    next lookup gets its own value."""
    redis_server.command("SET", "first", "1")
    redis_server.command("SET", "second", "2")

    async def scenario() -> tuple[object, object]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        await client.ping()
        reads = BatchedGet(client)
        try:
            redis_server.pause()
            late = reads.get("first")
            await asyncio.sleep(0.05)
            late.set_result(TOO_LATE)  # what the lookup's deadline does
            redis_server.resume()
            await asyncio.sleep(0.05)
            return late.result(), await asyncio.wait_for(reads.get("second"), 5)
        finally:
            redis_server.resume()
            await client.aclose()

    assert run(scenario()) == (TOO_LATE, b"2")


@pytest.mark.parametrize(
    "form",
    [
        "redis://:{pw}@127.0.0.1:{port}/3",
        "redis://127.0.0.1:{port}/3?password={pw}",
        "redis://127.0.0.1:{port}?password={pw}&db=3",
        "redis://:{pw}@127.0.0.1:{port}/0?db=3",
        "redis://guard:{user_pw}@127.0.0.1:{port}/3",  # an ACL user
    ],
)
def test_every_url_form_reads_where_it_writes(redis_with_password: RunningRedis, form: str) -> None:
    """A conversation remembered through one process's memory is written to the URL's
    database, and another process's lookup through the same URL reads it there (the
    hand-written lookups read db 0 for ``?db=3`` and got NOAUTH for
    ``?password=``: every such miss was silent)."""
    server = redis_with_password
    server.command("ACL", "SETUSER", "guard", "on", ">guard-pw", "~*", "+@all")
    url = form.format(pw="s3cr%3Aet", user_pw="guard-pw", port=server.port)

    found, shared = asyncio.run(written_then_read(url, "conversation-1", "vg.rung-2", 2))
    assert found == ("vg.rung-2", 2)
    assert shared == 1
    assert b"vg.rung-2" in server.command("GET", "vllm-guard:salt:conversation-1", db=3)
    assert server.command("GET", "vllm-guard:salt:conversation-1") == b"$-1\r\n"  # not db 0


@pytest.mark.parametrize(
    "wrong", ["redis://:wrong@127.0.0.1:{port}/0", "redis://127.0.0.1:{port}/0"]
)
def test_a_refused_connection_is_never_reported_shared(
    redis_with_password: RunningRedis, wrong: str
) -> None:
    """An error reply at connect (WRONGPASS, NOAUTH) falls back at once: shared 0, the
    error counted, lookups answered from the process's own memory."""

    async def scenario() -> tuple[float, float, object]:
        shared, metrics = memory(wrong.format(port=redis_with_password.port))
        try:
            await shared.link.connect()
            shared.local.remember("conversation-1", "vg.local", 1)
            found = await shared.lookup("conversation-1")
            return (
                gauge(metrics, "vllm_guard_state_shared"),
                gauge(metrics, "vllm_guard_state_errors_total", op="ping"),
                found,
            )
        finally:
            await shared.link.close()

    assert asyncio.run(scenario()) == (0.0, 1.0, ("vg.local", 1))


def test_a_lost_connection_fails_the_waiting_lookups(redis_server: RunningRedis, run: Run) -> None:
    async def scenario() -> BaseException | None:
        client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=5)
        await client.ping()
        reads = BatchedGet(client)
        try:
            redis_server.pause()  # the command is read by no one
            waiting = reads.get("anything")
            await asyncio.sleep(0.05)
            redis_server.kill()  # the kernel closes the socket
            await asyncio.wait((waiting,), timeout=5)
            return waiting.exception()
        finally:
            await client.aclose()

    assert isinstance(run(scenario()), redis.ConnectionError | ConnectionError)


@pytest.fixture
def redis_over_tls(tmp_path: Path) -> Iterator[tuple[int, Path, Any]]:
    """A real redis-server that speaks only TLS and wants a client certificate, with
    a private CA (trustme): (port, directory of the PEM files, the CA)."""
    import subprocess

    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    port = free_port()
    command = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
               "--tls-cert-file", str(tmp_path / "server.pem"),
               "--tls-key-file", str(tmp_path / "server.pem"),
               "--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "yes",
               "--save", "", "--appendonly", "no"]  # fmt: skip
    log = (ARTIFACTS / "redis-tls.log").open("ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: port_open(port), 15), "redis-server (TLS) did not start"
        yield port, tmp_path, ca
    finally:
        process.terminate()
        process.wait(timeout=15)


def port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_rediss_with_a_private_ca_and_a_client_certificate(
    redis_over_tls: tuple[int, Path, Any],
) -> None:
    """``rediss://`` with the CA and the client certificate in the URL's query (redis-py's
    own parameters): shared. Without the client certificate Redis refuses the
    handshake, and the memory says it is not shared."""
    port, pems, ca = redis_over_tls
    client = ca.issue_cert("vllm-guard")
    client.private_key_and_cert_chain_pem.write_to_path(str(pems / "client.pem"))
    base = f"rediss://127.0.0.1:{port}/2?ssl_ca_certs={pems / 'ca.pem'}"
    with_cert = f"{base}&ssl_certfile={pems / 'client.pem'}&ssl_keyfile={pems / 'client.pem'}"

    shared = written_then_read(with_cert, "conversation-tls", "vg.rung-1", 1)
    assert asyncio.run(shared) == (("vg.rung-1", 1), 1.0)
    refused = written_then_read(base, "conversation-tls", "vg.rung-1", 1)
    assert asyncio.run(refused) == (None, 0.0)


@pytest.mark.parametrize(("pause_s", "outage"), [(0.003, False), (0.05, False), (2.0, True)])
def test_sharing_survives_a_stall_under_load_and_returns_after_an_outage(
    redis_server: RunningRedis, pause_s: float, outage: bool
) -> None:
    """64 conversations looking up their salts as fast as the loop turns (every lookup
    within the default 5 ms, most batched), through one process's link to a real
    Redis. Without a fault, sharing stays on the whole time (before: it fell within
    0.2 s: a lookup past its own deadline counted as a lost connection, and every
    waiter on one late MGET as a failure of its own). Redis paused 3 ms or 50 ms:
    sharing stays on. Paused 2 s: it goes off, and comes back within seconds of
    Redis answering; every write made meanwhile is in Redis or counted as kept
    locally (``vllm_guard_state_unshared_writes_total``)."""

    async def scenario() -> tuple[list[float], list[float], int, float]:
        metrics = Metrics(CollectorRegistry(), models=[], backends=[])
        salt_reuse = SaltReuseSettings()
        state = StateSettings.model_validate({"redis_url": redis_server.url, "reconnect_s": 0.2})
        shared = SharedSaltMemory(SaltMemory(salt_reuse), RedisLink(state, metrics), salt_reuse)
        await shared.link.connect()
        stop = asyncio.Event()

        async def conversation(i: int) -> None:
            while not stop.is_set():
                await shared.lookup(f"conversation-{i}")
                await asyncio.sleep(0)  # a lookup answered locally does not yield

        def shared_now() -> float:
            return gauge(metrics, "vllm_guard_state_shared")

        tasks = [asyncio.create_task(conversation(i)) for i in range(64)]
        try:
            calm = []
            for _ in range(50):  # 0.5 s of load, no fault
                await asyncio.sleep(0.01)
                calm.append(shared_now())
            redis_server.pause()
            written = 0
            during = []
            started = asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - started < pause_s:
                shared.remember(f"written-{written}", "vg.salt", 1)
                written += 1
                during.append(shared_now())
                await asyncio.sleep(min(pause_s / 4, 0.05))
            redis_server.resume()
            for _ in range(300):  # up to 3 s for sharing to come back
                await asyncio.sleep(0.01)
                during.append(shared_now())
                if not outage and len(during) > 30:
                    break
                if outage and during[-1] == 1 and 0 in during:
                    break
            await asyncio.sleep(1.5)  # the background writes finish or fail
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await shared.link.close()
        in_redis = sum(
            b"vg.salt" in redis_server.command("GET", f"vllm-guard:salt:written-{i}")
            for i in range(written)
        )
        kept = gauge(metrics, "vllm_guard_state_unshared_writes_total", op="set")
        return calm, during, written, in_redis + kept

    calm, during, written, accounted = asyncio.run(scenario())
    assert calm == [1.0] * len(calm)
    if outage:
        assert 0.0 in during  # it went off
        assert during[-1] == 1.0  # and came back
    else:
        assert during == [1.0] * len(during)
    assert accounted >= written
