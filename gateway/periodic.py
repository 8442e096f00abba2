"""Timers for many things at once: ``Periodic``, a background task that runs an async
action every N seconds and never dies; ``Sweep``, one timer that checks every item
of a set (connections, streams) instead of a timer handle per item."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, interval_s: float, action: Callable[[], Awaitable[None]], name: str) -> None:
        self.interval_s = interval_s
        self.action = action
        self.name = name
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.action()
            except Exception:  # a background loop must survive any one round
                log.exception("%s round failed", self.name)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Sweep(Generic[T]):
    """A set of items checked by one timer, every ``period`` seconds while it holds any:
    ``check(item, now)`` (the event loop's clock) returns True to drop the item. A
    deadline checked this way fires within ``deadline + period``; a timer handle
    created and cancelled per item and event cost more than the check."""

    def __init__(self, period: float, check: Callable[[T, float], bool]) -> None:
        self.period = period
        self.check = check
        self.items: set[T] = set()
        #: The event loop whose clock ``check`` is given (set when an item is added).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def add(self, item: T) -> None:
        self.items.add(item)
        if self._timer is None:
            self.loop = asyncio.get_running_loop()
            self._timer = self.loop.call_later(self.period, self._sweep)

    def discard(self, item: T) -> None:
        self.items.discard(item)

    def _sweep(self) -> None:
        assert self.loop is not None
        now = self.loop.time()
        for item in list(self.items):
            if self.check(item, now):
                self.items.discard(item)
        self._timer = self.loop.call_later(self.period, self._sweep) if self.items else None
