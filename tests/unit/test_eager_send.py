"""A request to vLLM is written when it is made (gateway/upstream/eager_send.py).

On Python 3.11 aiohttp writes a request's head and body from a task it only queues,
so a request made while other requests wait on the loop (a burst of new streams)
left after all of them. These tests run the real aiohttp client on uvloop, the
serving loop, against a socket the test reads itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import select
import socket
import sys

import aiohttp
import pytest
import uvloop

from gateway.upstream import eager_send

pytestmark = pytest.mark.skipif(
    not eager_send.needed(), reason="aiohttp starts the body write eagerly by itself"
)

BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}' * 30
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


async def _read_request(loop: asyncio.AbstractEventLoop, conn: socket.socket, body: bytes) -> None:
    received = b""
    while not received.endswith(body):
        chunk = await loop.sock_recv(conn, 65536)
        assert chunk, "the client closed the connection"
        received += chunk


async def _written_before_the_next_task_runs(install: bool) -> bool:
    """Two tasks made in one pass: the first sends a request on a pooled connection,
    the second looks (waiting up to a second, the loop blocked) whether the request's
    bytes have reached the server's socket."""
    loop = asyncio.get_running_loop()
    if install:
        assert eager_send.write_request_bodies_eagerly(loop)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def post() -> bytes:
            async with session.post(url, data=BODY) as response:
                return await response.read()

        # A first request opens the connection that the measured one reuses.
        warm_up = asyncio.create_task(post())
        conn, _ = await loop.sock_accept(listener)
        await _read_request(loop, conn, BODY)
        await loop.sock_sendall(conn, ANSWER)
        assert await warm_up == b"{}"

        def arrived() -> bool:
            readable, _, _ = select.select([conn], [], [], 1.0)
            return bool(readable)

        async def look() -> bool:
            return arrived()

        measured = asyncio.create_task(post())
        looked = asyncio.create_task(look())
        was_there = await looked
        await _read_request(loop, conn, BODY)
        await loop.sock_sendall(conn, ANSWER)
        assert await measured == b"{}"
    conn.close()
    listener.close()
    return was_there


def _on_uvloop(main: object) -> object:
    return uvloop.run(main)  # type: ignore[arg-type]


def test_a_request_is_written_before_the_tasks_queued_behind_it_run() -> None:
    assert _on_uvloop(_written_before_the_next_task_runs(install=True)) is True


def test_without_it_aiohttp_on_python_3_11_writes_the_request_only_after_them() -> None:
    # What the factory is for: the same two tasks, the request still unwritten.
    assert sys.version_info < (3, 12)
    assert _on_uvloop(_written_before_the_next_task_runs(install=False)) is False


def test_other_tasks_are_made_by_the_factory_that_was_there_with_their_context() -> None:
    made: list[str] = []
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def previous(loop: asyncio.AbstractEventLoop, coro: object, **kwargs: object) -> object:
        made.append(getattr(coro, "__qualname__", "?"))
        return asyncio.Task(coro, loop=loop, **kwargs)  # type: ignore[arg-type]

    async def reads_var() -> str:
        return var.get()

    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(previous)  # type: ignore[arg-type]
        assert eager_send.write_request_bodies_eagerly(loop)
        var.set("caller")
        inherited = await asyncio.create_task(reads_var())
        context = contextvars.Context()
        given = await loop.create_task(reads_var(), context=context)
        return inherited, given

    assert _on_uvloop(main()) == ("caller", "unset")
    # (then uvloop's own shutdown tasks)
    assert [name.rsplit(".", 1)[-1] for name in made[:2]] == ["reads_var", "reads_var"]


def test_a_write_that_has_to_wait_carries_on_in_a_task_and_can_be_cancelled() -> None:
    """The body does not fit the socket's buffer (aiohttp awaits drain): the first
    step stops at that wait; the rest runs in a task that a cancellation reaches."""
    seen: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        drained: asyncio.Future[None] = loop.create_future()

        async def write(wait: asyncio.Future[None]) -> str:
            seen.append("first step")
            try:
                await wait
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            seen.append("rest")
            return "written"

        task = eager_send._started(loop, write(drained))
        assert seen == ["first step"]  # already ran, before anything else on the loop
        await asyncio.sleep(0)
        assert not task.done()
        drained.set_result(None)
        assert await task == "written"

        cancelled = eager_send._started(loop, write(loop.create_future()))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled

        async def done_at_once() -> str:
            return "no wait"

        finished = eager_send._started(loop, done_at_once())
        assert finished.done()
        assert finished.result() == "no wait"

    _on_uvloop(main())
    assert seen == ["first step", "rest", "first step", "cancelled"]


def test_a_cancel_before_the_rest_has_started_reaches_the_write_and_what_it_waits_on() -> None:
    """aiohttp cancels its writer when the response fails in the same step as the
    send: the write must see the cancellation (it closes the connection) and the
    drain it waited on must be cancelled, not left to fail unretrieved."""
    seen: list[str] = []

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        drained: asyncio.Future[None] = loop.create_future()

        async def write() -> None:
            try:
                await drained
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        task = eager_send._started(loop, write())
        task.cancel()  # before the task has run a step
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled(), drained.cancelled()

    assert _on_uvloop(main()) == (True, True)
    assert seen == ["cancelled"]


def test_the_first_step_runs_in_a_context_of_its_own_that_the_rest_keeps() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        later: asyncio.Future[None] = loop.create_future()

        async def write() -> str:
            token = var.set("set in the first step")
            await later
            var.reset(token)  # the same context: a copy would refuse the token
            return var.get()

        task = eager_send._started(loop, write())
        caller_sees = var.get()
        later.set_result(None)
        return caller_sees, await task

    assert _on_uvloop(main()) == ("unset", "unset")


def test_a_write_cancelled_in_its_first_step_is_a_cancelled_future_not_the_callers_error() -> None:
    async def main() -> bool:
        async def write() -> None:
            raise asyncio.CancelledError

        return eager_send._started(asyncio.get_running_loop(), write()).cancelled()

    assert _on_uvloop(main()) is True
