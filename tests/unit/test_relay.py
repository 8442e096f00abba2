"""RelayResponse: the client side of a released stream, under uvicorn's ASGI contract."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from gateway.relay import RelayResponse


class Connection:
    """uvicorn's side of one HTTP connection: ``receive`` waits for an event that
    ``connection_lost`` sets, and ``send`` silently drops what comes after it."""

    def __init__(self) -> None:
        self.lost = False
        self.event = asyncio.Event()
        self.delivered: list[bytes] = []

    def connection_lost(self) -> None:
        self.lost = True
        self.event.set()

    async def receive(self) -> Message:
        await self.event.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if not self.lost and message["type"] == "http.response.body":
            self.delivered.append(message["body"])


def relay_of(
    connection: Connection, chunks: AsyncIterator[bytes]
) -> tuple[RelayResponse, list[str]]:
    events: list[str] = []
    relay = RelayResponse(
        chunks,
        media_type="text/event-stream",
        on_close=lambda: events.append("closed"),
        on_client_gone=lambda: events.append("client gone"),
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
