"""What every worker and replica must know alike, shared in Redis (or Valkey).

Two memories, each kept per process and, with ``state.redis_url``, also in Redis,
the engine operators already run for cross-replica state:

* **the salt memory** (``SharedSaltMemory``): per conversation fingerprint, which
  rung of the conversation's salt ladder last gave a clean answer. Kept per process
  only, a turn that lands on another worker or replica does not know its chain is
  poisoned: it goes unsalted, gets the corrupt answer again and retries. Keys
  ``<key_prefix>salt:<fingerprint>`` (a 128-bit hash), values ``<rung>:<salt>``
  (the ladder's key is never stored); one ``SET`` when a conversation changes rung
  (again when a process's own entry is past half its TTL), a compare-and-delete
  when corruption recurs under a salt.
* **the answer chains** (``SharedAnswerChains``): per stored Responses answer id,
  the pod that made it (its address: every replica names pods alike) and its
  conversation. vLLM keeps a stored answer in the memory of one server; a follow-up
  (``previous_response_id``), a ``GET`` or a ``cancel`` anywhere else is a 404.
  Keys ``<key_prefix>answer:<id>``, values ``<pod URL> <conversation>``, one ``SET``
  per stored answer, with the salt memory's TTL.

Both read through one ``RedisLink``: a lookup is a ``GET`` within
``state.lookup_timeout_ms`` (the reads of one event-loop pass go as one ``MGET``,
``gateway.guard.redis_lookups``) that also refreshes the local memory; writes leave
the request's path at once (background tasks). Redis is never on the request's
failure path: a lookup past its deadline, or any error, answers from the local
memory and is counted in ``vllm_guard_state_errors_total{op}``. The link's health is
judged per round trip (an MGET, however many lookups it carried; a write): three
failed round trips in a row, or a lost connection (not a slow answer), stop the
lookups; a lookup that misses its own few milliseconds under load does not (its
MGET comes back a moment later). A write made while Redis is away is kept locally
and counted in ``vllm_guard_state_unshared_writes_total{op}``. Stopped: logged once,
``vllm_guard_state_shared`` drops to 0, and the connection is tried again in the
background every ``state.reconnect_s`` until Redis answers. Every command goes
through redis-py, so the URL means the same for reads and writes
(``redis://user:pw@host/3``, ``?password=..&db=..``,
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
from gateway.guard.conversations import AnswerChains, ChainLink, SaltMemory
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
#: Longer ids (a client's invention: vLLM's are ~40 characters) are not looked up.
MAX_SHARED_ANSWER_ID = 256
#: What a lookup's future holds when its deadline passed first.
TOO_LATE = object()


class RedisLink:
    """The connection to Redis every shared memory reads and writes through, and its
    health: while it is not ``healthy`` the memories answer from their own."""

    def __init__(self, settings: StateSettings, metrics: Metrics) -> None:
        assert settings.redis_url is not None
        self.metrics = metrics
        self.key_prefix = settings.key_prefix
        self.timeout_s = settings.lookup_timeout_ms / 1000
        self.reconnect_s = settings.reconnect_s
        self.client = redis.asyncio.Redis.from_url(
            settings.redis_url.get_secret_value(),
            socket_connect_timeout=_BACKGROUND_TIMEOUT_S,
            socket_timeout=_BACKGROUND_TIMEOUT_S,
        )
        self.reads = BatchedGet(self.client, on_round_trip=self._round_trip)
        #: Redis answered the last ping and has not failed since; until ``connect``
        #: succeeds nothing is shared.
        self.healthy = False
        #: Round trips (an MGET, a write) that failed since the last one that did not:
        #: FAILURES_BEFORE_FALLBACK in a row (or a lost connection) stop the lookups
        #: until Redis answers again. A lookup that misses its own deadline is
        #: answered locally and counted, but says nothing of the link: its MGET may
        #: come back a few milliseconds later (a busy event loop, a short stall).
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

    async def get(self, key: str) -> bytes | str | None:
        """Redis's value of ``key`` when it answers in time; None for a missing key
        and when it does not (the failure counted)."""
        if not self.healthy:
            return None
        reply = self.reads.get(key)
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.timeout_s, _expire_after_pending_io, reply, 2)
        try:
            raw = await reply
        except (OSError, RedisError):
            return None  # its MGET failed: counted once, for the batch (``_round_trip``)
        finally:
            deadline.cancel()
        if raw is TOO_LATE:
            self.metrics.state_errors.labels("get").inc()
            return None
        return raw if isinstance(raw, bytes | str) else None

    def background(self, op: str, command: Awaitable[Any]) -> None:
        """Run a write off the request's path; its failure is counted."""

        async def run() -> None:
            if (exc := await _bounded(command)) is not None:
                self.unshared(op)
                self._failed(op, exc)
            else:
                self._failures_in_a_row = 0

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in [*self._tasks, *([self._reconnecting] if self._reconnecting else [])]:
            task.cancel()
        self.reads.close()
        await self.client.aclose()

    def unshared(self, op: str) -> None:
        """A write this process kept to itself (Redis away, or the write failed): the
        other processes learn of it only when it is written again."""
        self.metrics.state_unshared_writes.labels(op).inc()

    # -- failures -----------------------------------------------------------------------

    def _round_trip(self, exc: BaseException | None) -> None:
        if exc is None:
            self._failures_in_a_row = 0
        else:
            self._failed("get", exc)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.state_errors.labels(op).inc()
        self._failures_in_a_row += 1
        if not self.healthy:
            return
        # A slow answer is not a lost connection (Python's TimeoutError is an OSError).
        lost = isinstance(exc, RedisConnectionError | OSError) and not isinstance(exc, TimeoutError)
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


class SharedSaltMemory:
    """The salt memory, shared through Redis, with this process's own as its fallback."""

    def __init__(self, local: SaltMemory, link: RedisLink, salt_reuse: SaltReuseSettings) -> None:
        self.local = local
        self.link = link
        self.prefix = link.key_prefix + "salt:"
        self.ttl_s = max(1, round(salt_reuse.ttl_s))

    def __len__(self) -> int:
        """Entries this process can see: while Redis is in use, any conversation may
        have one (the guard then fingerprints every request)."""
        return max(len(self.local), 1) if self.link.healthy else len(self.local)

    async def lookup(self, key: str | None) -> tuple[str, int] | None:
        """The conversation's known-clean (salt, rung): Redis's word when it answers in
        time, else this process's own."""
        if key is None:
            return None
        entry = _decode_salt(await self.link.get(self.prefix + key))
        if entry is not None:
            self.local.remember(key, *entry)
            return entry
        return self.local.get(key)

    def get(self, key: str | None) -> tuple[str, int] | None:
        """This process's memory only (refreshed by ``lookup`` at the request's start)."""
        return self.local.get(key)

    def remember(self, key: str | None, salt: str, rung: int = 0) -> bool:
        """Remember locally; tell Redis only news (a changed rung, or a refresh of the
        entry's time to live): a conversation that stays on its rung is not a write
        per turn."""
        news = self.local.remember(key, salt, rung)
        if key is None or not news:
            return news
        if self.link.healthy:
            command = self.link.client.set(self.prefix + key, f"{rung}:{salt}", ex=self.ttl_s)
            self.link.background("set", command)
        else:
            self.link.unshared("set")
        return news

    def forget(self, key: str | None, salt: str) -> None:
        self.local.forget(key, salt)
        if key is None:
            return
        if self.link.healthy:
            forget = self.link.client.eval(_FORGET_IF_SAME, 1, self.prefix + key, salt)
            self.link.background("forget", forget)
        else:
            self.link.unshared("forget")


class SharedAnswerChains:
    """Where each stored Responses answer lives (its pod and conversation), shared
    through Redis, with this process's own ``AnswerChains`` as its fallback."""

    def __init__(self, local: AnswerChains, link: RedisLink, ttl_s: float) -> None:
        self.local = local
        self.link = link
        self.prefix = link.key_prefix + "answer:"
        self.ttl_s = max(1, round(ttl_s))

    def get(self, answer_id: str) -> ChainLink | None:
        return self.local.get(answer_id)

    async def lookup(self, answer_id: str) -> ChainLink | None:
        """This process's entry, else Redis's (then kept locally)."""
        known = self.local.get(answer_id)
        if known is not None or len(answer_id) > MAX_SHARED_ANSWER_ID:
            return known
        raw = await self.link.get(self.prefix + answer_id)
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        backend, _, conversation = text.partition(" ")
        if not backend:
            return None
        self.local.remember(answer_id, conversation or None, backend)
        return self.local.get(answer_id)

    def remember(self, answer_id: str, conversation: str | None, backend: str) -> None:
        self.local.remember(answer_id, conversation, backend)
        if self.link.healthy:
            value = f"{backend} {conversation or ''}"
            command = self.link.client.set(self.prefix + answer_id, value, ex=self.ttl_s)
            self.link.background("set", command)
        else:
            self.link.unshared("set")

    def conversation_of(self, answer_id: str) -> str:
        return self.local.conversation_of(answer_id)


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


def _decode_salt(raw: object) -> tuple[str, int] | None:
    if not isinstance(raw, bytes | str):
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    rung, _, salt = text.partition(":")
    if not salt or not rung.isdigit():
        return None
    return salt, int(rung)
