"""Whether a vLLM keeps Responses answers under their ids, asked per pod.

vLLM ignores a request's ``store`` unless it was started with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``OpenAIServingResponses``: ``request.store =
False``), and its answers do not say which: ``ResponsesResponse`` has no ``store``
field. So the gateway asks the way a client would find out: one answer of one token
with ``store: true``, then ``GET /v1/responses/{id}`` on the same connection (a
Service URL balances per connection: another pod would not know the id, and a 404
from it would read as "keeps nothing"). Found: the store is on; 404: it is off.
Anything else (an error, a timeout, another server) leaves it unknown, and unknown is
treated as "keeps" (streams held ``adaptive``ly, never continued).

``StoreProbes`` asks in the background, never holding up a metrics scrape or the
start; again in later scrape rounds while the answer is unknown (``MAX_ASKS``), and
afresh when the pod restarted (its ``process_start_time_seconds`` changed: it may
come back with another setting). The cost: one token of generation per pod and
start; on a vLLM whose store is on, one stored answer of a few hundred bytes (vLLM
never frees its store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import urllib.parse

import aiohttp
import orjson

from gateway.upstream.pool import Backend

log = logging.getLogger(__name__)

#: A pod that gives no answer (no Responses API, errors while starting, a queue
#: longer than the timeout) is asked in this many scrape rounds, then left unknown.
MAX_ASKS = 3


async def keeps_responses(
    url: str, model: str, timeout_s: float, auth: dict[str, str]
) -> bool | None:
    """True if the vLLM at ``url`` keeps a stored Responses answer, False if it keeps
    none, None if that could not be told. ``auth``: vLLM's key, where it has one."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # A salt of its own: the probe neither reads a prefix-cache block (a poisoned
    # one would count in vLLM's NaN figure) nor leaves one anyone else reads.
    body = {"model": model, "input": ".", "max_output_tokens": 1, "store": True,
            "cache_salt": secrets.token_hex(8)}  # fmt: skip
    # One connection for both requests: the lookup reaches the server that stored.
    connector = aiohttp.TCPConnector(limit=1)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with session.post(
                url + "/v1/responses", data=orjson.dumps(body),
                headers={"content-type": "application/json", **auth},
            ) as response:  # fmt: skip
                if response.status != 200:
                    return None
                answer_id = orjson.loads(await response.read()).get("id")
            if not isinstance(answer_id, str) or not answer_id:
                return None
            path = "/v1/responses/" + urllib.parse.quote(answer_id, safe="")
            async with session.get(url + path, headers=auth) as found:
                if found.status == 200:
                    return True
                return False if found.status == 404 else None
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError, AttributeError):
        return None


class StoreProbes:
    """Learns each backend's ``keeps_responses`` where the operator did not say it."""

    def __init__(self, timeout_s: float, auth: dict[str, str]) -> None:
        self.timeout_s = timeout_s
        self.auth = auth
        self._asked: dict[tuple[str, str], int] = {}
        self._started_at: dict[tuple[str, str], float] = {}
        self._asking: dict[tuple[str, str], asyncio.Task[None]] = {}

    def observe(self, backend: Backend, model: str | None, started_at: float | None) -> None:
        """One scrape round saw ``backend`` (serving ``model``, its process started at
        ``started_at``): ask it, in the background, if its answer is still unknown."""
        key = (backend.name, backend.url)
        if started_at is not None:
            seen = self._started_at.get(key)
            if seen is not None and seen != started_at:  # restarted: ask afresh
                backend.keeps_responses = backend.settings.keeps_responses
                self._asked.pop(key, None)
                if (asking := self._asking.pop(key, None)) is not None:
                    asking.cancel()  # its answer would be the old process's
            self._started_at[key] = started_at
        if backend.keeps_responses is not None or model is None or key in self._asking:
            return
        asked = self._asked.get(key, 0)
        if asked >= MAX_ASKS:
            return
        self._asked[key] = asked + 1
        self._asking[key] = asyncio.create_task(self._ask(backend, model, key))

    async def _ask(self, backend: Backend, model: str, key: tuple[str, str]) -> None:
        try:
            keeps = await keeps_responses(backend.url, model, self.timeout_s, self.auth)
            if keeps is not None:
                backend.keeps_responses = keeps
                log.info("backend %s %s Responses answers", backend.name,
                         "keeps" if keeps else "keeps no")  # fmt: skip
        finally:
            self._asking.pop(key, None)

    async def settled(self) -> None:
        """Until every ask in flight has its answer (or gave up)."""
        await asyncio.gather(*self._asking.values(), return_exceptions=True)

    async def stop(self) -> None:
        asking = list(self._asking.values())
        for task in asking:
            task.cancel()
        for task in asking:
            with contextlib.suppress(asyncio.CancelledError):
                await task
