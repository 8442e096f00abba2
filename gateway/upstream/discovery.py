"""vLLM pods found by DNS: a backend whose host names many addresses.

In Kubernetes vLLM runs as many pods behind a Service. A ClusterIP Service would
let kube-proxy spread the gateway's requests over them, so conversation affinity,
per-pod health, the hit-ratio scrape and failover could not tell one pod from
another. A headless Service's name resolves to every ready pod's address: with
``discover: true`` each address becomes a backend of its own (``<name>-<slot>``),
and the name is resolved again every ``upstream.discovery_interval_s``:

* a new address takes the lowest free slot (so the backend label stays a bounded
  set, ``max_replicas`` values), is probed, and joins the pool;
* a departed address leaves it (requests under way finish); conversation affinity
  is rendezvous hashing over the pods' addresses (``Backend.identity``), never the
  slots: every replica and worker maps a conversation to the same pod whatever the
  order it found the pods in, and only the conversations of the pod that left move;
* a failed resolution (a DNS blip) keeps the current set and is logged once.

``resolve_addresses`` is the one resolver: the event loop's ``getaddrinfo``. Tests
replace it (the real code path, with answers they control).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from yarl import URL

from gateway.config import BackendSettings

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The host's addresses (IPv4 and IPv6), deduplicated, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DiscoveredBackends:
    """The addresses one ``discover: true`` backend resolves to, each in its slot."""

    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        url = URL(settings.url)
        self.host = url.host or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._url = url
        #: address -> slot
        self.slots: dict[str, int] = {}
        self._failing = False
        #: Addresses beyond max_replicas at the last resolution (warned on a change).
        self._left_out = 0

    def backend_settings(self, address: str, slot: int) -> BackendSettings:
        host = f"[{address}]" if ":" in address else address
        url = self._replace_host(host)
        return self.settings.model_copy(
            update={"name": f"{self.settings.name}-{slot}", "url": url, "discover": False}
        )

    def _replace_host(self, host: str) -> str:
        path = self._url.raw_path.rstrip("/")
        return f"{self._url.scheme}://{host}:{self.port}{path}"

    async def resolve(self, resolver: Resolver) -> tuple[dict[str, int], list[str]] | None:
        """(joined address -> slot, departed addresses) against the last answer, or None
        when the name does not resolve (the current set stays)."""
        try:
            addresses = await resolver(self.host, self.port)
        except OSError as exc:
            if not self._failing:
                log.warning(
                    "backend %s: resolving %s failed (%s); keeping its %d known address(es)",
                    self.settings.name, self.host, exc, len(self.slots),
                )  # fmt: skip
            self._failing = True
            return None
        if self._failing:
            log.warning("backend %s: %s resolves again", self.settings.name, self.host)
        self._failing = False
        departed = [a for a in self.slots if a not in addresses]
        for address in departed:
            del self.slots[address]
        joined: dict[str, int] = {}
        free = (s for s in range(self.settings.max_replicas) if s not in self.slots.values())
        for address in addresses:
            if address in self.slots:
                continue
            slot = next(free, None)
            if slot is None:
                left_out = len(addresses) - len(self.slots)
                if left_out != self._left_out:  # said once per change, not per refresh
                    log.warning(
                        "backend %s: %s has more than max_replicas=%d addresses; %d left out",
                        self.settings.name, self.host, self.settings.max_replicas, left_out,
                    )  # fmt: skip
                self._left_out = left_out
                return joined, departed
            self.slots[address] = joined[address] = slot
        self._left_out = 0
        return joined, departed
