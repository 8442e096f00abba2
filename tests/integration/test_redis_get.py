"""The lookups' pipelined Redis connection (gateway.guard.redis_get) against a real
``redis-server``: replies matched to their commands in order, a late reply that keeps
the order without reaching anyone, AUTH and SELECT from the URL, a lost connection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop
from conftest import ARTIFACTS, RunningRedis
from support.servers import free_port

from gateway.guard.redis_get import TOO_LATE, PipelinedGet, RedisReplyError

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Both event loops the gateway can run on (uvicorn picks uvloop when installed):
    their transports differ (uvloop's are not asyncio.Transport subclasses)."""
    return asyncio.run if request.param == "asyncio" else uvloop.run  # type: ignore[return-value]


@pytest.fixture
def redis_with_password() -> Iterator[RunningRedis]:
    server = RunningRedis(free_port(), ARTIFACTS / "redis-password.log", password="s3cr:et")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_pipelined_replies_reach_their_own_lookups(redis_server: RunningRedis, run: Run) -> None:
    for i in range(0, 200, 3):
        redis_server.command("SET", f"key{i}", f"value {i}" * (i % 7))

    async def scenario() -> list[object]:
        reads = await PipelinedGet.open(redis_server.url, 5)
        try:
            # 200 commands written back to back: the replies arrive in several reads,
            # split anywhere (bulk strings of every length, nils among them).
            return list(await asyncio.gather(*(reads.get(f"key{i}") for i in range(200))))
        finally:
            reads.close()

    expected = [f"value {i}".encode() * (i % 7) if i % 3 == 0 else None for i in range(200)]
    assert run(scenario()) == expected


def test_a_reply_after_its_deadline_keeps_the_order(redis_server: RunningRedis, run: Run) -> None:
    """The lookup gave up (its future holds TOO_LATE); Redis answers it later. The
    next lookup gets its own value, not the late one."""
    redis_server.command("SET", "first", "1")
    redis_server.command("SET", "second", "2")

    async def scenario() -> tuple[object, object]:
        reads = await PipelinedGet.open(redis_server.url, 5)
        try:
            redis_server.pause()
            late = reads.get("first")
            await asyncio.sleep(0.05)
            late.set_result(TOO_LATE)  # what the lookup's deadline does
            redis_server.resume()
            return late.result(), await asyncio.wait_for(reads.get("second"), 5)
        finally:
            redis_server.resume()
            reads.close()

    assert run(scenario()) == (TOO_LATE, b"2")


def test_password_and_database_from_the_url(redis_with_password: RunningRedis, run: Run) -> None:
    redis_with_password.command("SELECT", "0")
    redis_with_password.command("SET", "where", "db0")
    base = f"redis://:s3cr%3Aet@127.0.0.1:{redis_with_password.port}"

    async def read(url: str) -> object:
        reads = await PipelinedGet.open(url, 5)
        try:
            return await reads.get("where")
        finally:
            reads.close()

    assert run(read(base + "/0")) == b"db0"
    assert run(read(base + "/3")) is None  # another database
    with pytest.raises(RedisReplyError, match="WRONGPASS"):
        run(read(f"redis://:wrong@127.0.0.1:{redis_with_password.port}/0"))


def test_a_lost_connection_fails_the_waiting_lookups(redis_server: RunningRedis, run: Run) -> None:
    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        reads = await PipelinedGet.open(redis_server.url, 5)
        redis_server.pause()  # the command is read by no one
        waiting = reads.get("anything")
        await asyncio.sleep(0.05)
        redis_server.kill()  # the kernel closes the socket: connection_lost
        await asyncio.wait((waiting,), timeout=5)
        after = reads.get("anything")
        return waiting.exception(), after.exception()

    waiting, after = run(scenario())
    assert isinstance(waiting, ConnectionError)
    assert isinstance(after, ConnectionError)
