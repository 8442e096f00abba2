"""Requests to vLLM leave when they are made, not after every request already waiting.

aiohttp's client buffers a request's head and writes it, with the body, from a task
of its own (``ClientRequest.write_bytes``). On Python 3.12 and later aiohttp starts
that task eagerly, so the request goes out within the ``session.request`` call that
makes it. On 3.11 (this project's floor, and its image's Python) the task is only
queued: it runs after everything already ready on the loop. When a burst of new
requests reaches the gateway (``vllm bench serve``'s streams end in one engine step,
so the next c arrive together), uvicorn queues a task for each, and no request is
written to vLLM until every one of them has been set up: the first waits as long as
the last. ``write_request_bodies_eagerly`` gives 3.11 what 3.12 does: a task factory
that runs that one coroutine's first step at once, in the caller's step, and hands
the rest (if it had to wait, e.g. for a full socket buffer) to an ordinary task.
Figures: BENCHMARKS.md, "Requests that leave when they are made".

The coroutine is recognised by aiohttp's code object: an aiohttp internal, touched
here only, behind a version check; where the check fails, or aiohttp has no such
method, nothing is installed and the requests go out as before (late, not wrong).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Coroutine, Generator
from typing import Any

import aiohttp
from aiohttp.client_reqrep import ClientRequest

log = logging.getLogger("vllm_guard")

#: aiohttp releases whose ``ClientRequest.send`` was read for this: it creates the
#: body-writing task with ``asyncio.create_task(self.write_bytes(...))`` below 3.12.
_CHECKED_AIOHTTP = ((3, 10), (3, 14))

_TaskFactory = Any  # asyncio's own annotation is private (asyncio.events._TaskFactory)


def _aiohttp_version() -> tuple[int, int]:
    major, minor = aiohttp.__version__.split(".")[:2]
    return int(major), int(minor)


def needed() -> bool:
    """True where aiohttp queues the body-writing task instead of starting it."""
    if sys.version_info >= (3, 12):
        return False  # aiohttp starts it eagerly itself
    low, high = _CHECKED_AIOHTTP
    write_bytes = getattr(ClientRequest, "write_bytes", None)
    return low <= _aiohttp_version() <= high and hasattr(write_bytes, "__code__")


def write_request_bodies_eagerly(loop: asyncio.AbstractEventLoop) -> bool:
    """Install the factory on ``loop`` (a serving process's own loop); True if it was.
    Any factory already there still makes every other task."""
    if not needed():
        return False
    write_bytes = ClientRequest.write_bytes.__code__
    previous: _TaskFactory = loop.get_task_factory()

    def make_task(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any],
        context: contextvars.Context | None = None,
    ) -> asyncio.Future[Any]:
        if getattr(coro, "cr_code", None) is write_bytes:
            return _started(loop, coro)
        if previous is not None:
            made: asyncio.Future[Any] = (
                previous(loop, coro) if context is None else previous(loop, coro, context=context)
            )
            return made
        return asyncio.Task(coro, loop=loop, context=context)

    loop.set_task_factory(make_task)  # type: ignore[arg-type]  # the 3.11 signature
    log.debug("request bodies are written when a request is made (aiohttp on Python 3.11)")
    return True


def _started(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]
) -> asyncio.Future[Any]:
    """``coro`` run to its first suspension now; a finished future if it ended there
    (aiohttp then drops it, as it drops a task that finished eagerly), else a task
    that carries on from where it stopped."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[Any] = loop.create_future()
        done.set_result(stop.value)
        return done
    except Exception as exc:  # what the task would have held; aiohttp's own code catches
        failed: asyncio.Future[Any] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.Task(_Resumed(coro, waiting_on).run(), loop=loop)


class _Resumed:
    """The rest of a coroutine whose first step already ran: what it was waiting on
    is handed to the task unchanged, and whatever the task sends or throws back
    (a result, a cancellation) goes on to the coroutine, as ``await`` would."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self.coro, self.waiting_on = coro, waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting_on = self.coro, self.waiting_on
        while True:
            try:
                sent = yield waiting_on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                waiting_on = coro.send(sent)
            except StopIteration as stop:
                return stop.value

    async def run(self) -> Any:
        return await self
