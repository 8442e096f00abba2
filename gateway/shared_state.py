"""Conversation memory shared by every worker and replica, in Redis (or Valkey).

``gateway.retry.SaltMemory`` knows, per conversation fingerprint, which rung of the
conversation's salt ladder last gave a clean answer. Kept per process, a turn that
lands on another worker or replica does not know its chain is poisoned: it goes
unsalted, gets the corrupt answer again and retries. With ``state.redis_url`` the
memory is also kept in Redis, the engine operators already run for cross-replica
state:

* one read per guarded request that has a conversation key (``GET``, within
  ``state.lookup_timeout_ms``), which also refreshes the local memory;
* one write when a conversation changes rung (``SET`` with the salt memory's TTL),
  and a compare-and-delete when corruption recurs under a salt; both leave the
  request's path at once (background tasks);
* keys ``<key_prefix>salt:<fingerprint>`` (a fingerprint is a 128-bit hash), values
  ``<rung>:<salt>``; the ladder's key is never stored.

Redis is never on the request's failure path: a lookup past its deadline, or any
error, answers from the local memory and is counted in
``vllm_guard_state_errors_total{op}``. Three failures in a row, or a lost
connection, stop the lookups: logged once, ``vllm_guard_state_shared`` drops to 0,
and the connection is tried again in the background every ``state.reconnect_s``
until Redis answers.
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
from gateway.metrics import Metrics
from gateway.retry import SaltMemory

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
        self.healthy = True
        #: Failures since the last success: a lookup that misses its deadline once is
        #: answered locally; FAILURES_BEFORE_FALLBACK in a row (or a lost connection)
        #: stop the lookups until Redis answers again.
        self._failures_in_a_row = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reconnecting: asyncio.Task[None] | None = None
        metrics.state_shared.set(1)

    async def connect(self) -> None:
        """Open the first connection at start (a lookup's few milliseconds are too short
        to connect in); a Redis that does not answer starts the fallback at once."""
        if (exc := await _bounded(self.client.ping())) is not None:
            self._failed("ping", exc)

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
            # asyncio.wait rather than asyncio.timeout: after the event loop stalls (a
            # busy host), an answer that arrived in time is taken, not cancelled by a
            # deadline timer that happens to run first. A late GET finishes on its own.
            get = asyncio.ensure_future(self.client.get(self.prefix + key))
            await asyncio.wait((get,), timeout=self.timeout_s)
            if not get.done():
                get.add_done_callback(_consume)
                self._failed("get", TimeoutError())
            elif (exc := get.exception()) is not None:
                self._failed("get", exc)
            else:
                self._failures_in_a_row = 0
                entry = _decode(get.result())
                if entry is not None:
                    self.local.remember(key, *entry)
                    return entry
        return self.local.get(key)

    def get(self, key: str | None) -> tuple[str, int] | None:
        """This process's memory only (refreshed by ``lookup`` at the request's start)."""
        return self.local.get(key)

    def remember(self, key: str | None, salt: str, rung: int = 0) -> None:
        self.local.remember(key, salt, rung)
        if key is not None and self.healthy:
            value = f"{rung}:{salt}"
            self._background("set", self.client.set(self.prefix + key, value, ex=self.ttl_s))

    def forget(self, key: str | None, salt: str) -> None:
        self.local.forget(key, salt)
        if key is not None and self.healthy:
            forget = self.client.eval(_FORGET_IF_SAME, 1, self.prefix + key, salt)
            self._background("forget", forget)

    async def close(self) -> None:
        for task in [*self._tasks, *([self._reconnecting] if self._reconnecting else [])]:
            task.cancel()
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
        if not lost and self._failures_in_a_row < FAILURES_BEFORE_FALLBACK:
            return
        self.healthy = False
        self.metrics.state_shared.set(0)
        log.warning(
            "shared state (Redis) failed on %s (%s); using this process's own memory "
            "and retrying the connection every %g s",
            op, type(exc).__name__, self.reconnect_s,
        )  # fmt: skip
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while True:
            await asyncio.sleep(self.reconnect_s)
            if await _bounded(self.client.ping()) is not None:
                self.metrics.state_errors.labels("ping").inc()
                continue
            self.healthy = True
            self._failures_in_a_row = 0
            self.metrics.state_shared.set(1)
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


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a late lookup's outcome, so that asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


def _decode(raw: object) -> tuple[str, int] | None:
    if not isinstance(raw, bytes | str):
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    rung, _, salt = text.partition(":")
    if not salt or not rung.isdigit():
        return None
    return salt, int(rung)
