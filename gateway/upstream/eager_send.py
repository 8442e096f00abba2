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
that runs that one coroutine's first step at once, in the caller's step (in a context
of its own, as an eager task's), and hands the rest (if it had to wait, e.g. for a
full socket buffer) to an ordinary task. The price is a few percent of CPU per request
where the gateway is saturated (writes no longer leave in one batch at the end of a
loop pass); figures: BENCHMARKS.md, "Requests that leave when they are made".

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
    """``coro`` run to its first suspension now, in a context of its own as an eager
    task's is; a finished future if it ended there (aiohttp drops it, as it drops a
    task that finished eagerly), else a task that carries on from where it stopped.

    One difference from 3.12's eager start is left: ``asyncio.current_task()`` in that
    first step is the caller's (3.11 cannot swap it); aiohttp's ``write_bytes`` does
    not ask."""
    context = contextvars.copy_context()
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration as stop:
        done: asyncio.Future[Any] = loop.create_future()
        done.set_result(stop.value)
        return done
    except (KeyboardInterrupt, SystemExit):
        raise
    except asyncio.CancelledError:
        cancelled: asyncio.Future[Any] = loop.create_future()
        cancelled.cancel()
        return cancelled
    except BaseException as exc:  # what the task would have held
        failed: asyncio.Future[Any] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.Task(_Resumed(coro, waiting_on), loop=loop, context=context)


class _Resumed(Coroutine[Any, Any, Any]):
    """The rest of a coroutine whose first step already ran, driven by its task as the
    coroutine itself would be: the first ``send`` hands the task what the coroutine
    waits on; after that every send and throw goes to the coroutine. A cancellation
    that comes before the task's first step still reaches the coroutine, and cancels
    what it was waiting on, as ``Task.cancel`` does for a task that waits."""

    __slots__ = ("_coro", "_handed_over", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self._coro, self._waiting_on, self._handed_over = coro, waiting_on, False

    def send(self, value: Any) -> Any:
        if not self._handed_over:
            self._handed_over = True
            return self._waiting_on
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if not self._handed_over:
            self._handed_over = True
            waiting_on = self._waiting_on
            if asyncio.isfuture(waiting_on) and not waiting_on.done():
                waiting_on._asyncio_future_blocking = False
                waiting_on.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self

    def __iter__(self) -> Generator[Any, Any, Any]:
        return self

    def __next__(self) -> Any:
        return self.send(None)
