"""Conversation memory shared by every worker and replica, in Redis (or Valkey).

``gateway.guard.conversations.SaltMemory`` knows, per conversation fingerprint, which rung of the
conversation's salt ladder last gave a clean answer. Kept per process, a turn that
lands on another worker or replica does not know its chain is poisoned: it goes
unsalted, gets the corrupt answer again and retries. With ``state.redis_url`` the
memory is also kept in Redis, the engine operators already run for cross-replica
state:

* one read per guarded request that has a conversation key (a ``GET`` within
  ``state.lookup_timeout_ms``; the reads of one event-loop pass go as one ``MGET``,
  ``gateway.guard.redis_lookups``), which also refreshes the local memory;
* one write when a conversation changes rung (``SET`` with the salt memory's TTL;
  again when a process's own entry is past half its TTL),
  and a compare-and-delete when corruption recurs under a salt; both leave the
  request's path at once (background tasks);
* keys ``<key_prefix>salt:<fingerprint>`` (a fingerprint is a 128-bit hash), values
  ``<rung>:<salt>``; the ladder's key is never stored.

Redis is never on the request's failure path: a lookup past its deadline, or any
error, answers from the local memory and is counted in
``vllm_guard_state_errors_total{op}``. Three failures in a row, or a lost
connection, stop the lookups: logged once, ``vllm_guard_state_shared`` drops to 0,
and the connection is tried again in the background every ``state.reconnect_s``
until Redis answers. Every command goes through redis-py, so the URL means the same
for reads and writes (``redis://user:pw@host/3``, ``?password=..&db=..``,
``rediss://..?ssl_ca_certs=..&ssl_certfile=..&ssl_keyfile=..``), and the memory
counts as shared (``vllm_guard_state_shared`` 1) only once Redis has answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.config import SaltReuseSettings, StateSettings
from gateway.guard.conversations import SaltMemory
from gateway.guard.redis_lookups import BatchedGet
from gateway.observe.metrics import Metrics

log = logging.getLogger(__name__)

#: Deletes a key only if it still holds the salt that failed (another process may
#: have moved the conversation to a newer rung meanwhile). Values are
#: ``<rung>:<salt>``; the gateway's salts hold no ``:``.
_FORGET_IF_SAME = """
local value = redis.call('get', KEYS[1])
if value and string.sub(value, -string.len(ARGV[1]) - 1) == ':' .. ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""
#: Lookups in a row that fail or miss their deadline before the process stops asking
#: (one slow answer on a busy host is not an outage).
FAILURES_BEFORE_FALLBACK = 3
#: Longest wait for a background write or a reconnection probe.
_BACKGROUND_TIMEOUT_S = 1.0
#: What a lookup's future holds when its deadline passed first.
TOO_LATE = object()


class SharedSaltMemory:
    """The salt memory, shared through Redis, with this process's own as its fallback."""

    def __init__(
        self,
        local: SaltMemory,
        settings: StateSettings,
        salt_reuse: SaltReuseSettings,
        metrics: Metrics,
    ) -> None:
        assert settings.redis_url is not None
        self.local = local
        self.metrics = metrics
        self.prefix = settings.key_prefix + "salt:"
        self.timeout_s = settings.lookup_timeout_ms / 1000
        self.ttl_s = max(1, round(salt_reuse.ttl_s))
        self.reconnect_s = settings.reconnect_s
        self.client = redis.asyncio.Redis.from_url(
            settings.redis_url.get_secret_value(),
            socket_connect_timeout=_BACKGROUND_TIMEOUT_S,
            socket_timeout=_BACKGROUND_TIMEOUT_S,
        )
        self.reads = BatchedGet(self.client)
        #: Redis answered the last ping and has not failed since (the local memory
        #: answers meanwhile); until ``connect`` succeeds nothing is shared.
        self.healthy = False
        #: Failures since the last success: a lookup that misses its deadline once is
        #: answered locally; FAILURES_BEFORE_FALLBACK in a row (or a lost connection)
        #: stop the lookups until Redis answers again.
        self._failures_in_a_row = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reconnecting: asyncio.Task[None] | None = None
        metrics.state_shared.set(0)

    async def connect(self) -> None:
        """Open the first connection at start (a lookup's few milliseconds are too short
        to connect in). Any failure, an error reply included (a wrong password, an
        unknown database), starts the fallback at once."""
        if (exc := await _bounded(self.client.ping())) is not None:
            self.metrics.state_errors.labels("ping").inc()
            self._fall_back("ping", exc)
        else:
            self._shared()

    def __len__(self) -> int:
        """Entries this process can see: while Redis is in use, any conversation may
        have one (the guard then fingerprints every request)."""
        return max(len(self.local), 1) if self.healthy else len(self.local)

    async def lookup(self, key: str | None) -> tuple[str, int] | None:
        """The conversation's known-clean (salt, rung): Redis's word when it answers in
        time, else this process's own."""
        if key is None:
            return None
        if self.healthy:
            reply = self.reads.get(self.prefix + key)
            loop = asyncio.get_running_loop()
            deadline = loop.call_later(self.timeout_s, _expire_after_pending_io, reply, 2)
            try:
                raw = await reply
            except (OSError, RedisError) as exc:
                self._failed("get", exc)
            else:
                if raw is TOO_LATE:
                    self._failed("get", TimeoutError())
                else:
                    self._failures_in_a_row = 0
                    entry = _decode(raw)
                    if entry is not None:
                        self.local.remember(key, *entry)
                        return entry
            finally:
                deadline.cancel()
        return self.local.get(key)

    def get(self, key: str | None) -> tuple[str, int] | None:
        """This process's memory only (refreshed by ``lookup`` at the request's start)."""
        return self.local.get(key)

    def remember(self, key: str | None, salt: str, rung: int = 0) -> bool:
        """Remember locally; tell Redis only news (a changed rung, or a refresh of the
        entry's time to live): a conversation that stays on its rung is not a write
        per turn."""
        news = self.local.remember(key, salt, rung)
        if key is not None and self.healthy and news:
            value = f"{rung}:{salt}"
            self._background("set", self.client.set(self.prefix + key, value, ex=self.ttl_s))
        return news

    def forget(self, key: str | None, salt: str) -> None:
        self.local.forget(key, salt)
        if key is not None and self.healthy:
            forget = self.client.eval(_FORGET_IF_SAME, 1, self.prefix + key, salt)
            self._background("forget", forget)

    async def close(self) -> None:
        for task in [*self._tasks, *([self._reconnecting] if self._reconnecting else [])]:
            task.cancel()
        self.reads.close()
        await self.client.aclose()

    # -- failures -----------------------------------------------------------------------

    def _background(self, op: str, command: Awaitable[Any]) -> None:
        async def run() -> None:
            if (exc := await _bounded(command)) is not None:
                self._failed(op, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.state_errors.labels(op).inc()
        self._failures_in_a_row += 1
        if not self.healthy:
            return
        lost = isinstance(exc, RedisConnectionError | OSError)
        if lost or self._failures_in_a_row >= FAILURES_BEFORE_FALLBACK:
            self._fall_back(op, exc)

    def _fall_back(self, op: str, exc: BaseException) -> None:
        """Stop asking Redis; probe it in the background until it answers."""
        self.healthy = False
        self.metrics.state_shared.set(0)
        log.warning(
            "shared state (Redis) failed on %s (%s); using this process's own memory "
            "and retrying the connection every %g s",
            op, type(exc).__name__, self.reconnect_s,
        )  # fmt: skip
        if self._reconnecting is None:
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    def _shared(self) -> None:
        self.healthy = True
        self._failures_in_a_row = 0
        self.metrics.state_shared.set(1)

    async def _reconnect(self) -> None:
        while True:
            await asyncio.sleep(self.reconnect_s)
            if await _bounded(self.client.ping()) is not None:
                self.metrics.state_errors.labels("ping").inc()
                continue
            self._shared()
            log.warning("shared state (Redis) answers again; conversation memory is shared")
            self._reconnecting = None
            return


async def _bounded(command: Awaitable[Any]) -> BaseException | None:
    """Await a command within _BACKGROUND_TIMEOUT_S; its failure, or None."""
    try:
        async with asyncio.timeout(_BACKGROUND_TIMEOUT_S):
            await command
    except (TimeoutError, RedisError, OSError) as exc:
        return exc
    return None


def _expire_after_pending_io(reply: asyncio.Future[object], passes: int) -> None:
    """The lookup's deadline: give up on its reply, but only after the event loop has
    read its sockets once more. After a stall (a busy host) a reply that arrived in time
    is taken, not dropped because a timer ran first: libuv (uvloop) runs due timers
    before it polls, and a callback queued from a callback runs in the next pass."""
    if reply.done():
        return
    if passes:
        asyncio.get_running_loop().call_soon(_expire_after_pending_io, reply, passes - 1)
    else:
        reply.set_result(TOO_LATE)


def _decode(raw: object) -> tuple[str, int] | None:
    if not isinstance(raw, bytes | str):
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    rung, _, salt = text.partition(":")
    if not salt or not rung.isdigit():
        return None
    return salt, int(rung)
