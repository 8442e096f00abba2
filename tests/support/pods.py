"""vLLM pods behind one DNS name, for the tests of discovery and of the fleet.

Scripted backends listen on one port at 127.0.0.2, .3 and .4 (Linux routes all of
127/8 to the loopback): the addresses a headless Service's name resolves to. The
resolver is the real code path's (``discovery.resolve_addresses``) with answers the
test controls, as a cluster's DNS changes them when a pod leaves and another joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
from support.servers import free_port
from support.stub_backend import StubBackend

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
#: The name the pods' backend is configured with (``discover: true``).
PODS_HOST = "vllm-pods.test"


class Dns:
    """What the pods' name resolves to now (``None``: the resolver fails)."""

    def __init__(self) -> None:
        self.answer: list[str] | None = []

    async def resolve(self, host: str, port: int) -> list[str]:
        assert host == PODS_HOST
        if self.answer is None:
            raise OSError("Temporary failure in name resolution")
        return list(self.answer)


@contextlib.contextmanager
def pods_on_one_port() -> Iterator[tuple[int, dict[str, StubBackend]]]:
    """A scripted backend at each of ``ADDRESSES``, all on one free port."""
    port = free_port()
    servers = {address: StubBackend(port, host=address) for address in ADDRESSES}
    for server in servers.values():
        server.__enter__()
    try:
        yield port, servers
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)


def backends_of(gateway_url: str) -> dict[str, bool]:
    """The gateway's backends and their health, as its /readyz says."""
    states: dict[str, bool] = httpx.get(gateway_url + "/readyz").json()["backends"]
    return states
