"""One pipelined Redis connection that only reads keys: the lookup on a request's path.

The shared salt memory reads Redis once per guarded request that has a conversation
key. Through redis-py's client that read costs about twice the CPU of the round trip
itself (connection pool, command packing, a task to await it against a deadline;
BENCHMARKS.md, "Shared conversation memory"), which at one small request at a time
is more than the 10% the lookup may add. This connection writes ``GET`` commands
back to back on one socket and resolves each reply's future in order, with no task
and no lock. Everything else (writes, scripts, pings, reconnecting) stays with
redis-py: this module speaks only the replies a ``GET``, ``AUTH`` and ``SELECT``
can give (RESP2: bulk string, nil, simple string, error).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import Final, cast
from urllib.parse import parse_qs, unquote, urlsplit

#: The value a lookup's future holds when its deadline passed first.
TOO_LATE: Final = object()


class RedisReplyError(Exception):
    """Redis answered a command with an error reply (``-ERR ...``)."""


class PipelinedGet(asyncio.Protocol):
    """``GET`` commands pipelined on one connection; replies matched to them in order."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._waiting: collections.deque[asyncio.Future[object]] = collections.deque()
        self._buffer = b""
        self.closed = False

    @classmethod
    async def open(cls, url: str, timeout_s: float) -> PipelinedGet:
        """Connect to ``redis://``, ``rediss://`` or ``unix://`` and authenticate and
        select the database the URL names; raises OSError, TimeoutError or
        RedisReplyError."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            if parts.scheme == "unix":
                _, connection = await loop.create_unix_connection(cls, parts.path)
            else:
                tls = _tls_context(query) if parts.scheme == "rediss" else None
                host, port = parts.hostname or "localhost", parts.port or 6379
                _, connection = await loop.create_connection(cls, host, port, ssl=tls)
            setup = []
            if parts.password is not None:
                user = unquote(parts.username) if parts.username else "default"
                setup.append(connection.command("AUTH", user, unquote(parts.password)))
            database = (parts.path.strip("/") if parts.scheme != "unix" else "") or (
                query.get("db", ["0"])[0]
            )
            if database not in ("", "0"):
                setup.append(connection.command("SELECT", database))
            try:
                for reply in setup:
                    await reply
            except BaseException:
                connection.close()
                raise
        return connection

    def get(self, key: str) -> asyncio.Future[object]:
        """The key's value (bytes, or None when absent); the future fails with
        ConnectionError if the connection is lost first."""
        return self.command("GET", key)

    def command(self, *words: str) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.closed or self._transport is None:
            future.set_exception(ConnectionError("redis lookup connection closed"))
            return future
        encoded = [word.encode() for word in words]
        self._transport.write(
            b"*%d\r\n" % len(encoded)
            + b"".join(b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded)
        )
        self._waiting.append(future)
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: a cast, not a check.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError("redis lookup connection lost"))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        start = 0
        while self._waiting:
            reply, end = _parse_reply(buffer, start)
            if end < 0:  # incomplete: wait for more bytes
                break
            start = end
            future = self._waiting.popleft()
            if future.done():  # its deadline passed: the reply only keeps the order
                continue
            if isinstance(reply, RedisReplyError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
        # Bytes with no command waiting for them cannot be a reply: dropped.
        self._buffer = buffer[start:] if self._waiting else b""


def _parse_reply(buffer: bytes, start: int) -> tuple[object, int]:
    """One RESP2 reply at ``start``: (value, the offset after it), or (None, -1)
    while it is incomplete."""
    line_end = buffer.find(b"\r\n", start)
    if line_end < 0:
        return None, -1
    kind, header = buffer[start : start + 1], buffer[start + 1 : line_end]
    if kind == b"$":
        length = int(header)
        if length < 0:
            return None, line_end + 2
        end = line_end + 2 + length
        if len(buffer) < end + 2:
            return None, -1
        return buffer[line_end + 2 : end], end + 2
    if kind == b"-":
        return RedisReplyError(header.decode(errors="replace")), line_end + 2
    return header, line_end + 2  # "+OK", ":1"


def _tls_context(query: dict[str, list[str]]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if query.get("ssl_cert_reqs", [""])[0].lower() in ("none", "optional"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
