"""A background task that runs an async action every N seconds and never dies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

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
