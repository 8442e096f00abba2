"""CPU per conversation-memory lookup: redis-py with hiredis, redis-py with its pure
Python parser, and (while it exists in the tree) the hand-written pipelined GET the
gateway used before issue 32, in one run against one real ``redis-server``.

Each client does the lookup the guard does (one GET of a key that exists, through
the client's own connection handling), one at a time and 64 at once, 20,000
lookups a round (5,000 one at a time), three rounds each, alternating. Printed:
this process's CPU per lookup (median of the rounds, and the spread between
rounds), and the ratio to redis-py+hiredis. Run with ``python tests/perf/bench_redis_lookup.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.servers import RunningRedis, free_port

LOOKUPS = {1: 5_000, 64: 20_000}
ROUNDS = 3
KEY = "vllm-guard:salt:" + "ab" * 16

Lookup = Callable[[str], Awaitable[Any]]


async def redis_py(url: str, hiredis: bool) -> tuple[Lookup, Callable[[], Awaitable[None]]]:
    import redis.asyncio
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=16,
        parser_class=_AsyncHiredisParser if hiredis else _AsyncRESP2Parser,
    )
    client = redis.asyncio.Redis(connection_pool=pool)
    await client.ping()
    return client.get, client.aclose


async def redis_py_batched(url: str, hiredis: bool) -> tuple[Lookup, Callable[[], Awaitable[None]]]:
    """The lookups of one event-loop pass as one MGET, through redis-py (the gateway's
    way since issue 32: gateway.guard.redis_lookups)."""
    import redis.asyncio
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

    from gateway.guard.redis_lookups import BatchedGet

    parser = _AsyncHiredisParser if hiredis else _AsyncRESP2Parser
    client = redis.asyncio.Redis.from_url(url, parser_class=parser)
    await client.ping()
    batched = BatchedGet(client)
    return batched.get, client.aclose


async def hand_written(url: str) -> tuple[Lookup, Callable[[], Awaitable[None]]] | None:
    try:
        from gateway.guard.redis_get import PipelinedGet  # type: ignore[import-not-found]
    except ImportError:
        return None
    reads = await PipelinedGet.open(url, 1.0)

    async def close() -> None:
        reads.close()

    return reads.get, close


async def one_round(lookup: Lookup, concurrency: int) -> float:
    """CPU seconds of this process per lookup."""
    semaphore = asyncio.Semaphore(concurrency)
    lookups = LOOKUPS[concurrency]

    async def one() -> None:
        async with semaphore:
            assert await lookup(KEY) is not None

    cpu = time.process_time()
    await asyncio.gather(*(one() for _ in range(lookups)))
    return (time.process_time() - cpu) / lookups


async def main(url: str) -> None:
    clients: dict[str, tuple[Lookup, Callable[[], Awaitable[None]]]] = {
        "redis-py + hiredis": await redis_py(url, hiredis=True),
        "redis-py (pure Python parser)": await redis_py(url, hiredis=False),
        "MGET a pass, redis-py + hiredis": await redis_py_batched(url, hiredis=True),
        "MGET a pass, redis-py pure": await redis_py_batched(url, hiredis=False),
    }
    handwritten = await hand_written(url)
    if handwritten is not None:
        clients["hand-written pipelined GET"] = handwritten
    for concurrency in LOOKUPS:
        for lookup, _ in clients.values():  # warm: connections open, code paths hot
            await one_round(lookup, concurrency)
        samples: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(ROUNDS):
            for name, (lookup, _) in clients.items():
                samples[name].append(await one_round(lookup, concurrency))
        base = statistics.median(samples["redis-py + hiredis"])
        print(f"\n{concurrency} lookup(s) at once")
        print(f"{'client':32} {'CPU/lookup':>11} {'spread':>9} {'vs hiredis':>10}")
        for name, values in samples.items():
            median = statistics.median(values)
            spread = (max(values) - min(values)) / median
            print(f"{name:32} {median * 1e6:9.1f}us {spread:8.0%} {median / base:9.2f}x")
    for _, close in clients.values():
        await close()


if __name__ == "__main__":
    server = RunningRedis(free_port(), Path("/tmp/bench-redis-lookup.log"))
    server.start()
    try:
        server.command("SET", KEY, "1:vg.salt")
        uvloop.run(main(server.url))
    finally:
        server.stop()
