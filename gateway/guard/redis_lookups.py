"""The conversation memory's lookups, batched: every GET asked for in one pass of the
event loop goes to Redis as one MGET, through redis-py.

redis-py owns the protocol (every URL it accepts: password and db in the query
string, ACL users, ``rediss://`` with a CA and client certificates), its
connection pool and its parser (hiredis when installed). A GET per request through
it costs about three times the CPU of one pipelined GET (BENCHMARKS.md, "Shared
state lookups"); an MGET per loop pass spreads one command's cost over the
requests that arrived together, which under load is many.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio


class BatchedGet:
    """``get(key)``: a future of the key's value (bytes, or None), resolved by the next
    MGET; a failed MGET fails every future of its batch. A future resolved by someone
    else first (the caller's deadline) is left as it is. ``on_round_trip`` hears of
    each MGET once, however many lookups it carried: None when Redis answered, else
    what went wrong (the link's health is judged per round trip, not per waiter)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        on_round_trip: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.client = client
        self.on_round_trip = on_round_trip
        self._pending: dict[str, list[asyncio.Future[Any]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def get(self, key: str) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(key, []).append(future)
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, {}
        task = asyncio.get_running_loop().create_task(self._mget(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mget(self, batch: dict[str, list[asyncio.Future[Any]]]) -> None:
        keys = list(batch)
        try:
            values = await self.client.mget(keys)
        except BaseException as exc:  # every waiter learns of it
            for futures in batch.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            if self.on_round_trip is not None:
                self.on_round_trip(exc)
            return
        if self.on_round_trip is not None:
            self.on_round_trip(None)
        for key, value in zip(keys, values, strict=True):
            for future in batch[key]:
                if not future.done():
                    future.set_result(value)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
