"""Upstream capacity is per pod: ``upstream.max_connections_per_backend`` connections
to each backend and no cap on all of them together; a request past a pod's limit
waits in the gateway, and that wait is measured (0 for one that found a connection)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import UpstreamSettings
from gateway.upstream.pool import BackendPool

HOLD_S = 0.3


def test_each_pod_has_its_own_connections_and_a_wait_past_them_is_measured() -> None:
    Waits = list[tuple[str, float]]

    async def scenario() -> tuple[Waits, Waits]:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(HOLD_S)
            return web.Response(text="ok")

        servers = []
        for _ in range(2):
            app = web.Application()
            app.router.add_get("/slow", slow)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
        settings = UpstreamSettings.model_validate({
            "backends": [{"name": f"pod{i}", "url": str(s.make_url("")).rstrip("/")}
                         for i, s in enumerate(servers)],
            "max_connections_per_backend": 2,
        })  # fmt: skip
        pool = BackendPool(settings)
        waits: list[tuple[str, float]] = []
        pool.on_connection_wait = lambda backend, waited: waits.append((backend, waited))

        async def get(index: int) -> None:
            response = await pool.backends[index].open("GET", "/slow", headers={}, body=None)
            await response.read()
            response.release()

        try:
            # Two at once on each pod: within each pod's limit (a cap of 2 for all
            # together would have made two of them wait).
            await asyncio.gather(get(0), get(0), get(1), get(1))
            first_round = list(waits)
            waits.clear()
            await asyncio.gather(get(0), get(0), get(0))  # the third waits for pod0
        finally:
            await pool.stop()
            for server in servers:
                await server.close()
        return first_round, waits

    first, second = asyncio.run(scenario())
    assert sorted(b for b, _ in first) == ["pod0", "pod0", "pod1", "pod1"]
    assert all(waited == 0.0 for _, waited in first)
    assert [b for b, _ in second] == ["pod0"] * 3
    waited = sorted(w for _, w in second)
    assert waited[:2] == [0.0, 0.0]
    assert HOLD_S * 0.8 < waited[2] < HOLD_S * 5  # it waited for a connection to free up


def test_the_old_global_setting_is_refused_with_its_new_name() -> None:
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="max_connections_per_backend"):
        UpstreamSettings.model_validate({"max_connections": 512})
