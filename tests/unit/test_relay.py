"""RelayResponse: the client side of a released stream, under uvicorn's ASGI contract."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from gateway.guard.answer import ChunkSender, StreamedAnswer
from gateway.server.relay import BodyWriter, RelayResponse


class Connection:
    """uvicorn's side of one HTTP connection (uvicorn/protocols/http/httptools_impl.py,
    RequestResponseCycle): ``receive`` waits for an event that ``connection_lost``
    sets, and so does the last body frame (``response_complete``); from then on
    ``receive`` answers ``http.disconnect`` although the client is still connected.
    ``send`` silently drops what comes after a lost connection."""

    def __init__(self) -> None:
        self.lost = False
        self.response_complete = False
        self.event = asyncio.Event()
        self.delivered: list[bytes] = []

    def connection_lost(self) -> None:
        self.lost = True
        self.event.set()

    async def receive(self) -> Message:
        if not self.lost and not self.response_complete:
            await self.event.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if not self.lost and message["type"] == "http.response.body":
            self.delivered.append(message["body"])
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.response_complete = True
            self.event.set()


def relay_of(
    connection: Connection, chunks: AsyncIterator[bytes]
) -> tuple[RelayResponse, list[str]]:
    events: list[str] = []

    async def pump(send: ChunkSender, write_body: BodyWriter) -> bytes:
        async for chunk in chunks:
            await send(chunk)
        return b""

    async def nothing_after() -> None:
        return None

    relay = RelayResponse(
        StreamedAnswer(
            headers=[],
            relay=pump,
            body_ready=False,
            after_complete=nothing_after,
            on_close=lambda: events.append("closed"),
            on_client_gone=lambda: events.append("client gone"),
        )
    )
    return relay, events


def test_a_client_that_leaves_while_every_chunk_is_already_buffered_is_seen() -> None:
    """The relay never has to wait (all of vLLM's answer is buffered), and the client
    leaves after the first chunk: the relay must still report it."""

    async def scenario() -> tuple[list[str], list[bytes]]:
        connection = Connection()

        async def buffered() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            connection.connection_lost()
            for n in range(2, 6):
                yield f"data: {n}\n\n".encode()

        relay, events = relay_of(connection, buffered())
        await relay({"type": "http"}, connection.receive, connection.send)
        return events, connection.delivered

    events, delivered = asyncio.run(scenario())
    assert delivered == [b"data: 1\n\n"]
    assert events == ["client gone", "closed"]


def test_a_client_that_stays_is_not_reported_gone() -> None:
    async def scenario() -> tuple[list[str], list[bytes]]:
        connection = Connection()

        async def buffered() -> AsyncIterator[bytes]:
            for n in range(3):
                yield f"data: {n}\n\n".encode()

        relay, events = relay_of(connection, buffered())
        await relay({"type": "http"}, connection.receive, connection.send)
        return events, connection.delivered

    events, delivered = asyncio.run(scenario())
    assert delivered == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert events == ["closed"]


def test_a_stream_read_to_the_end_is_not_a_disconnect() -> None:
    """uvicorn says "disconnect" to every receive() once the response is complete; ten
    complete streams must not count ten clients gone (they counted before)."""

    async def scenario() -> list[str]:
        all_events: list[str] = []
        for _ in range(10):
            connection = Connection()

            async def slow() -> AsyncIterator[bytes]:
                for n in range(3):
                    await asyncio.sleep(0.001)
                    yield f"data: {n}\n\n".encode()

            relay, events = relay_of(connection, slow())
            await relay({"type": "http"}, connection.receive, connection.send)
            await asyncio.sleep(0.01)  # the watcher, had it not been cancelled, runs now
            all_events += events
        return all_events

    assert asyncio.run(scenario()) == ["closed"] * 10
