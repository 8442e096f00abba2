"""Periodic scrape of each backend's own ``/metrics``, ``/version`` and ``/v1/models``.

Exports ``vllm_guard_backend_up``, ``vllm_guard_backend_prefix_cache_hit_ratio``
(from the deltas of vLLM's prefix-cache counters between two scrapes),
``vllm_guard_backend_nan_requests`` and ``vllm_guard_backend_counts_nans`` (vLLM's
own count of requests with NaN logits, ``vllm:corrupted_requests``: ground truth
beside the guard's verdicts, where the server computes it),
``vllm_guard_backend_info{version}`` and ``vllm_guard_backend_fix_info{status}``
(what the backend's vllm-guard-fix plugin says of itself: ``active``, ``refused``,
``disabled``, or ``absent`` without the plugin), each labelled ``backend`` (its name,
a discovered pod's slot) and ``backend_address`` (the pod's ``host:port``, the same in
every replica: ``Backend.address``), and teaches the metrics which
model names are real (the bounded label set). A ``role: fixed`` backend whose fix
is not active is logged: retries sent there are not fixed, whatever its role says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.config import BackendRole, UpstreamSettings
from gateway.observe.metrics import Metrics
from gateway.periodic import Periodic
from gateway.upstream.pool import Backend, BackendPool
from gateway.upstream.responses_store import StoreProbes

log = logging.getLogger(__name__)

_SAMPLE = re.compile(
    rb"^vllm:prefix_cache_(queries|hits)_total(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE
)


_NAN_REQUESTS = re.compile(
    rb"^vllm:corrupted_requests_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE
)
_PROCESS_START = re.compile(rb"^process_start_time_seconds ([0-9.e+]+)$", re.MULTILINE)


def parse_process_start(text: bytes) -> float | None:
    """When the backend's process started (``process_start_time_seconds``): a new
    value is a restart, which may bring other settings (``StoreProbes``)."""
    found = _PROCESS_START.search(text)
    if found is None:
        return None
    try:
        return float(found.group(1))
    except ValueError:
        return None


def parse_nan_requests(text: bytes) -> float | None:
    """vLLM's count of requests with NaN logits, summed over its engines; None when
    the server does not export it (``VLLM_COMPUTE_NANS_IN_LOGITS`` off)."""
    values = _NAN_REQUESTS.findall(text)
    if not values:
        return None
    total = 0.0
    for value in values:
        with contextlib.suppress(ValueError):
            total += float(value)
    return total


_FIX_INFO = re.compile(
    rb'^vllm_guard_fix_info\{[^}]*status="([a-z_]{1,32})"[^}]*\}\s+1', re.MULTILINE
)
FIX_STATUSES = ("active", "refused", "disabled", "absent")


def parse_fix_status(text: bytes) -> str:
    """The backend's vllm-guard-fix status from its ``/metrics`` (``absent``: none)."""
    match = _FIX_INFO.search(text)
    if match is None:
        return "absent"
    status = match.group(1).decode()
    return status if status in FIX_STATUSES else "refused"


@dataclass(slots=True)
class PrefixCacheCounters:
    queries: float
    hits: float


def parse_prefix_cache(text: bytes) -> PrefixCacheCounters | None:
    """Sum vLLM's prefix-cache counters over all label sets (engines, models)."""
    totals = {b"queries": 0.0, b"hits": 0.0}
    seen = False
    for name, value in _SAMPLE.findall(text):
        seen = True
        with contextlib.suppress(ValueError):
            totals[name] += float(value)
    if not seen:
        return None
    return PrefixCacheCounters(totals[b"queries"], totals[b"hits"])


def hit_ratio(previous: PrefixCacheCounters | None, current: PrefixCacheCounters) -> float | None:
    if previous is None:
        return None
    queries = current.queries - previous.queries
    if queries <= 0:  # no traffic, or the backend restarted (counters reset)
        return None
    return max(0.0, min(1.0, (current.hits - previous.hits) / queries))


class BackendScraper:
    def __init__(self, pool: BackendPool, metrics: Metrics, settings: UpstreamSettings) -> None:
        self.pool = pool
        self.metrics = metrics
        self.settings = settings
        self._last: dict[tuple[str, str], PrefixCacheCounters] = {}
        self._versions: dict[tuple[str, str], str] = {}
        #: vLLM's key (``upstream.api_key``): its /v1 paths need it.
        key = settings.api_key
        self._auth = {"authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        #: The model each pod serves (``/v1/models``' first), for the store probe.
        self._models: dict[tuple[str, str], str] = {}
        self.store_probes = StoreProbes(self.pool.probe_timeout_s, self._auth)
        self._fix_status: dict[tuple[str, str], str] = {}
        self._periodic = Periodic(
            settings.metrics_scrape_interval_s, self.scrape_once, "backend scrape"
        )

    async def _get(self, backend: Backend, path: str) -> bytes | None:
        timeout = aiohttp.ClientTimeout(total=self.pool.probe_timeout_s)
        try:
            async with backend.fresh_session.get(
                backend.url + path, timeout=timeout, headers=self._auth
            ) as response:
                if response.status != 200:
                    return None
                return await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def _scrape(self, backend: Backend) -> None:
        if backend.departed:
            return
        self.metrics.backend_up.labels(*_labels(backend)).set(1 if backend.healthy else 0)
        text = await self._get(backend, "/metrics")
        if backend.series_address is None:  # it left while this round read it
            return
        if text is not None:
            counters = parse_prefix_cache(text)
            if counters is not None:
                ratio = hit_ratio(self._last.get(_key(backend)), counters)
                self._last[_key(backend)] = counters
                if ratio is not None:
                    self.metrics.backend_hit_ratio.labels(*_labels(backend)).set(ratio)
            self._record_fix_status(backend, parse_fix_status(text))
            nan_requests = parse_nan_requests(text)
            self.metrics.backend_counts_nans.labels(*_labels(backend)).set(nan_requests is not None)
            if nan_requests is not None:
                self.metrics.backend_nan_requests.labels(*_labels(backend)).set(nan_requests)
                self.metrics.backend_degenerate_attempts.labels(*_labels(backend))  # from 0
        if _key(backend) not in self._versions or _key(backend) not in self._models:
            await self._learn_identity(backend)
        started_at = parse_process_start(text) if text is not None else None
        self.store_probes.observe(backend, self._models.get(_key(backend)), started_at)

    def _record_fix_status(self, backend: Backend, status: str) -> None:
        previous = self._fix_status.get(_key(backend))
        if status == previous:
            return
        self._fix_status[_key(backend)] = status
        for other in FIX_STATUSES:  # one status per backend at a time
            self.metrics.backend_fix_info.labels(
                *_labels(backend), backend.settings.role, other
            ).set(1 if other == status else 0)
        if backend.settings.role is BackendRole.FIXED and status != "active":
            log.warning(
                "backend %s has role fixed but its vLLM reports vllm-guard-fix %s: "
                "requests sent there are not fixed (docs/fixed-backend.md)",
                backend.name, status,
            )  # fmt: skip

    async def _learn_identity(self, backend: Backend) -> None:
        """The backend's version and model, each asked only until it is known."""
        key = _key(backend)
        version_body = None if key in self._versions else await self._get(backend, "/version")
        models_body = None if key in self._models else await self._get(backend, "/v1/models")
        models: list[str] = []
        if models_body is not None:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                data = orjson.loads(models_body).get("data", [])
                models = [
                    m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                ]
                self.metrics.discover_models(models)
        if models:
            self._models[key] = models[0]
        if version_body is not None and backend.series_address is not None:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                version = orjson.loads(version_body).get("version")
                if isinstance(version, str) and len(version) <= 64:
                    self._versions[key] = version
                    self.metrics.backend_info.labels(*_labels(backend), version).set(1)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(b) for b in self.pool.backends))

    def version_of(self, backend: str) -> str | None:
        """The vLLM version the named backend (as it is now in the pool) reported."""
        current = next((b for b in self.pool.backends if b.name == backend), None)
        return self._versions.get(_key(current)) if current is not None else None

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        await self.store_probes.stop()


def _key(backend: Backend) -> tuple[str, str]:
    """What the scrape remembers a backend by: its name and URL, so a discovered slot
    taken by a new pod starts afresh (its counters, version and fix status)."""
    return backend.name, backend.url


def _labels(backend: Backend) -> tuple[str, str]:
    """A backend's per-backend series' labels: ``backend``, ``backend_address``."""
    return backend.name, backend.address
