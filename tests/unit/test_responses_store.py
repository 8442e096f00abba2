"""Whether a backend keeps Responses answers (issue 41 item 4): the probe and its rounds.

The stub models vLLM's Responses store as ``OpenAIServingResponses`` keeps it: a
``POST /v1/responses`` with ``store: true`` is kept in the serving process's memory
only when the store is on (``VLLM_ENABLE_RESPONSES_API_STORE=1``; otherwise vLLM
sets ``request.store = False``), and ``GET /v1/responses/{id}`` answers 200 for a
kept id, 404 otherwise. ``stores`` > 1 models several processes (or pods behind a
Service) balanced per connection, each with its own memory. It differs from vLLM in
generating nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import BackendSettings
from gateway.upstream.pool import Backend
from gateway.upstream.responses_store import MAX_ASKS, StoreProbes, keeps_responses


@asynccontextmanager
async def vllm_store(
    *, store_on: bool, stores: int = 1, post_status: int = 200, delay_s: float = 0.0
) -> AsyncIterator[tuple[str, dict[str, int]]]:
    memories: list[set[str]] = [set() for _ in range(stores)]
    by_connection: dict[int, set[str]] = {}
    next_memory = itertools.cycle(memories)
    ids = itertools.count()
    seen = {"posts": 0}

    def memory(request: web.Request) -> set[str]:  # balanced per connection
        return by_connection.setdefault(id(request.transport), next(next_memory))

    async def create(request: web.Request) -> web.Response:
        seen["posts"] += 1
        await asyncio.sleep(delay_s)
        if post_status != 200:
            return web.json_response({"error": {"message": "no"}}, status=post_status)
        body = await request.json()
        answer_id = f"resp_{next(ids)}"
        if store_on and body.get("store"):
            memory(request).add(answer_id)
        return web.json_response({"id": answer_id, "object": "response", "output": []})

    async def retrieve(request: web.Request) -> web.Response:
        found = request.match_info["answer_id"] in memory(request)
        return web.json_response(
            {"id": request.match_info["answer_id"]}, status=200 if found else 404
        )

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{answer_id}", retrieve)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()


def ask(**stub: Any) -> bool | None:
    async def scenario() -> bool | None:
        async with vllm_store(**stub) as (url, _):
            return await keeps_responses(url, "tiny", 5.0, {})

    return asyncio.run(scenario())


def test_the_probe_tells_a_store_that_keeps_from_one_that_does_not() -> None:
    assert ask(store_on=True) is True
    assert ask(store_on=False) is False
    assert ask(store_on=True, post_status=404) is None  # no Responses API: not known


def test_the_lookup_goes_where_the_answer_was_stored() -> None:
    """Two processes (or pods behind a Service) balanced per connection, store on: a
    lookup on a new connection reaches the other one, whose 404 read as "keeps
    nothing" (and stored answers were then continued). One connection for both."""
    assert ask(store_on=True, stores=2) is True


def backend(url: str, **settings: Any) -> Backend:
    return Backend(BackendSettings(name="b", url=url, **settings), None, None)  # type: ignore[arg-type]


def test_a_slow_pod_is_asked_in_the_background_and_again_while_unknown() -> None:
    """A probe never holds up the scrape round that starts it; one that times out is
    asked again in later rounds (at most MAX_ASKS), not given up after the first."""

    async def scenario() -> None:
        async with vllm_store(store_on=False, delay_s=2.0) as (url, seen):
            probes = StoreProbes(timeout_s=0.2, auth={})
            pod = backend(url)
            for _ in range(MAX_ASKS + 2):
                probes.observe(pod, "tiny", started_at=1.0)  # not awaited: the round goes on
                assert seen["posts"] == 0 or pod.keeps_responses is None
                await probes.settled()  # the ask timed out
            assert pod.keeps_responses is None
            assert seen["posts"] == MAX_ASKS
            await probes.stop()

    asyncio.run(scenario())


def test_a_restarted_pod_is_asked_afresh() -> None:
    """A pod that kept nothing comes back (a new process start time) with its store
    on: it is asked again and its answers are no longer continued."""

    async def scenario() -> None:
        probes = StoreProbes(timeout_s=5.0, auth={})
        async with vllm_store(store_on=False) as (url, _):
            pod = backend(url)
            probes.observe(pod, "tiny", started_at=1.0)
            await probes.settled()
            assert pod.keeps_responses is False
        async with vllm_store(store_on=True) as (url2, _):
            pod.settings = BackendSettings(name="b", url=url2)  # the same pod, restarted
            probes.observe(pod, "tiny", started_at=1.0)
            await probes.settled()
            assert pod.keeps_responses is False  # same process: not asked again
            probes.observe(pod, "tiny", started_at=2.0)
            await probes.settled()
            assert pod.keeps_responses is True
        await probes.stop()

    asyncio.run(scenario())


def test_the_operators_word_is_taken_and_nothing_asked() -> None:
    async def scenario() -> None:
        async with vllm_store(store_on=True) as (url, seen):
            probes = StoreProbes(timeout_s=5.0, auth={})
            pod = backend(url, keeps_responses=False)
            probes.observe(pod, "tiny", started_at=1.0)
            await probes.settled()
            assert (pod.keeps_responses, seen["posts"]) == (False, 0)
            probes.observe(pod, "tiny", started_at=2.0)  # restarted: still the operator's
            await probes.settled()
            assert (pod.keeps_responses, seen["posts"]) == (False, 0)

    asyncio.run(scenario())
