"""Every metric the gateway exports, defined in one place, on an injected registry.

Label values are bounded sets: models from configuration or the backends'
``/v1/models`` (anything else is ``other``), configured backend names, and fixed
enums. The per-backend series (``vllm_guard_backend_*``) also carry
``backend_address``, the pod's ``host:port`` (``Backend.address``): a discovered
pod's ``backend`` is a slot (``vllm-0``) that differs between replicas with
different discovery histories, its address does not, so rules that join replicas
group by it. One per pod in the pool: a departed pod's series are removed
(``forget_backend``).

With ``--workers N`` the CLI sets ``PROMETHEUS_MULTIPROC_DIR`` before any worker
starts, and ``render`` merges every worker's files, so totals add up.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
from collections.abc import Iterable
from typing import Self

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.metrics import MetricWrapperBase

from gateway import __version__
from gateway.errors import GatewayError

OTHER = "other"
#: The labels of every per-backend series: the backend's name (a discovered pod's
#: slot) and its address (the pod's ``host:port``, the same in every replica).
BACKEND_LABELS = ("backend", "backend_address")
MAX_DISCOVERED_MODELS = 64

#: From 100 µs (gateway overhead) to 20 minutes (long generations).
DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
)  # fmt: skip
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10)


class RemembersChildren(MetricWrapperBase):
    """A metric whose ``labels()`` remembers each child.

    prometheus_client checks, converts and locks on every ``labels()`` call (0.65 µs);
    a request makes about ten of them. A remembered child is one dict lookup. Label
    values are bounded sets (see above), so the memory is too; named label values
    are not remembered.
    """

    _remembered: dict[tuple[object, ...], Self]

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        try:
            return self._remembered[labelvalues]
        except (AttributeError, KeyError):
            child = super().labels(*labelvalues, **labelkwargs)
            if not labelkwargs:
                self.__dict__.setdefault("_remembered", {})[labelvalues] = child
            return child


class Counter(RemembersChildren, prometheus_client.Counter):
    pass


def _bisection_possible() -> bool:
    """``Histogram.observe`` below reads prometheus_client's private ``_sum``,
    ``_buckets``, ``_upper_bounds`` and ``_raise_if_not_observable`` (0.20-0.26
    have them). Checked once, on a histogram no registry sees; without them the
    library's own ``observe`` runs.

    The probe keeps its values in memory even in multiprocess mode: a value of that
    mode is a file in PROMETHEUS_MULTIPROC_DIR, and every scrape would merge the
    probe into /metrics beside the gateway's own histograms."""
    in_files = values.ValueClass
    values.ValueClass = values.MutexValue
    try:
        probe = prometheus_client.Histogram("vllm_guard_probe", "probe", registry=None)
    finally:
        values.ValueClass = in_files
    names = ("_sum", "_buckets", "_upper_bounds", "_raise_if_not_observable")
    return all(hasattr(probe, name) for name in names)


BISECTION = _bisection_possible()


class Histogram(RemembersChildren, prometheus_client.Histogram):
    """A Histogram whose ``observe`` finds the bucket by bisection: prometheus_client
    walks the bounds one by one (22 here), five observations per request
    (BENCHMARKS.md)."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if not BISECTION or exemplar or amount != amount:  # prometheus_client's own way
            super().observe(amount, exemplar)
            return
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount)
        # The first bound >= amount: the bucket prometheus_client's walk stops at.
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(1)


class LiveGauge(RemembersChildren, Gauge):
    """A Gauge for the gauges a request moves (children are never removed)."""


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        models: Iterable[str],
        backends: Iterable[str],
    ) -> None:
        self.registry = registry
        self.models = set(models)
        self.backends = set(backends)
        self._discovered: set[str] = set()
        r = registry
        self.requests = Counter(
            "vllm_guard_requests",
            "Client requests on guarded routes, by final verdict.",
            ["model", "backend", "endpoint", "stream", "verdict"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "vllm_guard_upstream_attempts",
            "Attempts a backend answered (first attempts, retries and failovers; one that "
            "never reached it is not counted). The bug's rate on a backend is "
            "degenerate_responses / upstream_attempts.",
            ["model", "backend"],
            registry=r,
        )
        self.degenerate = Counter(
            "vllm_guard_degenerate_responses",
            "Degenerate attempts detected, by detector kind (at most one per attempt) and "
            "API (endpoint: chat, completions, responses, messages).",
            ["model", "backend", "kind", "endpoint"],
            registry=r,
        )
        self.degenerate_refused = Counter(
            "vllm_guard_degenerate_refused",
            "Requests answered with a 502 because every attempt was degenerate "
            "(guard.on_exhausted: error).",
            ["model", "backend", "kind", "endpoint"],
            registry=r,
        )
        self.degenerate_delivered = Counter(
            "vllm_guard_degenerate_delivered",
            "Degenerate answers that reached the client (observe mode, policy deliver, "
            "or corruption after a stream was released).",
            ["model", "backend", "kind", "endpoint"],
            registry=r,
        )
        self.retries = Counter(
            "vllm_guard_retries",
            "Attempts after the first, by reason (a detector kind or backend_error).",
            ["model", "backend", "reason"],
            registry=r,
        )
        self.retries_refused = Counter(
            "vllm_guard_retries_refused",
            "Degenerate answers not retried, by reason: max_attempts (the per-request "
            "bound), budget (retries stopped recovering and the useless-load allowance "
            "is spent), client_share (this client holds its share of that allowance).",
            ["model", "backend", "reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "vllm_guard_upstream_errors",
            "Backend answers the gateway could not use, by kind: protocol (a 200 whose "
            "body is not a JSON object, or a broken stream).",
            ["backend", "kind"],
            registry=r,
        )
        self.upstream_resends = Counter(
            "vllm_guard_upstream_resends",
            "Proxied idempotent requests (GET, HEAD, ...) sent to a backend a second "
            "time, on a new connection, after its pooled keep-alive connection turned "
            "out closed. Generations are never resent.",
            ["backend"],
            registry=r,
        )
        self.answer_homes = Counter(
            "vllm_guard_answer_homes",
            "Requests for a stored Responses answer (a follow-up by previous_response_id, "
            "GET, cancel) with several backends to choose from, by how its backend was "
            "found: remembered (by this process, or by any through Redis), asked (every "
            "healthy backend asked whether it holds it), not_found (every one answered "
            "404), unanswered (none had it, but one could not say: a 5xx, a timeout; "
            "asked again next time).",
            ["source"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm_guard_prompt_tokens",
            "Prompt tokens of every attempt, by that attempt's verdict.",
            ["model", "backend", "verdict"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "vllm_guard_cached_prompt_tokens",
            "Prompt tokens served from vLLM's prefix cache, by attempt verdict.",
            ["model", "backend", "verdict"],
            registry=r,
        )
        self.stream_cut = Counter(
            "vllm_guard_stream_cut",
            "Streams ended by the gateway because they degenerated after release.",
            ["model", "backend"],
            registry=r,
        )
        self.continuations = Counter(
            "vllm_guard_continuations",
            "Streams that degenerated after release, continued from the text the client "
            "already had (outcome: clean, degenerate, error), or not (refused: no "
            "attempt or budget left, or the request cannot be continued).",
            ["api", "outcome"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "vllm_guard_client_disconnects",
            "Clients that left before their answer was complete; the upstream request "
            "was closed so vLLM aborts it. phase: before_response | streaming.",
            ["model", "endpoint", "stream", "phase"],
            registry=r,
        )
        self.gateway_answered = Counter(
            "vllm_guard_gateway_answered",
            "Requests the gateway answered itself, without a backend's answer: refused "
            "(400, 401, 403, 413, 431) or no backend to send them to (503). endpoint: "
            "the guarded API, or other; reason: the error's code. (The edge's own "
            "refusals before a request reaches the app, 408 and the connection limit's "
            "503, are not among them.)",
            ["endpoint", "status", "reason"],
            registry=r,
        )
        self.salt_reuse = Counter(
            "vllm_guard_salt_reuse",
            "Attempts sent with a remembered known-clean salt, by attempt kind.",
            ["model", "attempt"],
            registry=r,
        )
        self.request_duration = Histogram(
            "vllm_guard_request_duration_seconds",
            "Time from request received to response complete (backend: the final attempt's; "
            "verdict: as vllm_guard_requests_total's, so a recovery's cost can be graphed).",
            ["model", "backend", "endpoint", "stream", "verdict"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "vllm_guard_upstream_duration_seconds",
            "Duration of each upstream attempt.",
            ["model", "backend"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.connection_wait = Histogram(
            "vllm_guard_upstream_connection_wait_seconds",
            "Time each request to a backend waited in the gateway for a free connection "
            "to it (every connection to that pod taken: upstream."
            "max_connections_per_backend); 0 for a request that found one.",
            ["backend"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm_guard_time_to_first_token_seconds",
            "Streams: time from request received to the first byte sent to the client.",
            ["model", "backend"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "vllm_guard_overhead_seconds",
            "Time spent in the gateway itself, excluding waits on the backend.",
            ["endpoint", "stream"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.attempts = Histogram(
            "vllm_guard_attempts",
            "Upstream attempts per guarded request.",
            ["model"],
            buckets=ATTEMPT_BUCKETS,
            registry=r,
        )
        self.backend_up = Gauge(
            "vllm_guard_backend_up",
            "1 when the backend answered its last health check.",
            BACKEND_LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.backend_hit_ratio = Gauge(
            "vllm_guard_backend_prefix_cache_hit_ratio",
            "Backend prefix-cache hit ratio over the last scrape interval "
            "(delta of vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).",
            BACKEND_LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.backend_nan_requests = Gauge(
            "vllm_guard_backend_nan_requests",
            "vLLM's own count of requests whose logits held NaN (vllm:corrupted_requests, "
            "summed over its engines; exported when the server runs with "
            "VLLM_COMPUTE_NANS_IN_LOGITS=1), as last scraped: the bug's signature seen "
            "from inside the server, beside the gateway's degenerate attempts. A counter "
            "of the backend's (it restarts at 0 with vLLM): take increase().",
            BACKEND_LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.backend_degenerate_attempts = Counter(
            "vllm_guard_backend_degenerate_attempts",
            "Attempts the gateway judged degenerate, by backend only: the figure to set "
            "beside vllm_guard_backend_nan_requests (both count vLLM requests, a retry "
            "being one). Starts at 0 for every backend that counts NaNs, so that its "
            "first increase is seen (vllm_guard_degenerate_responses_total's series "
            "appear with their first count).",
            BACKEND_LABELS,
            registry=r,
        )
        self.backend_counts_nans = Gauge(
            "vllm_guard_backend_counts_nans",
            "1 when the backend's /metrics has vllm:corrupted_requests (vLLM started with "
            "VLLM_COMPUTE_NANS_IN_LOGITS=1), 0 when it does not.",
            BACKEND_LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.backend_info = Gauge(
            "vllm_guard_backend_info",
            "The backend's vLLM version (value is always 1).",
            [*BACKEND_LABELS, "version"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.backend_fix_info = Gauge(
            "vllm_guard_backend_fix_info",
            "The backend's vllm-guard-fix status from its own /metrics (1 for the current "
            "one): active, refused, disabled, or absent (no plugin); role as configured.",
            [*BACKEND_LABELS, "role", "status"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.state_errors = Counter(
            "vllm_guard_state_errors",
            "Shared-state (Redis) operations that failed or missed their deadline; the "
            "request went on with this process's own memory. op: get, set, forget, ping.",
            ["op"],
            registry=r,
        )
        self.state_unshared_writes = Counter(
            "vllm_guard_state_unshared_writes",
            "Writes to the shared memory this process kept to itself: Redis was away, or "
            "the write failed. The other processes learn of the entry only when it is "
            "written again. op: set, forget.",
            ["op"],
            registry=r,
        )
        self.state_shared_configured = Gauge(
            "vllm_guard_state_shared_configured",
            "1 when this process is configured to share its memory through Redis "
            "(state.redis_url set), 0 when it is not: vllm_guard_state_shared is 0 in "
            "both cases, this tells a lost Redis from none.",
            registry=r,
            multiprocess_mode="max",
        )
        self.state_shared = Gauge(
            "vllm_guard_state_shared",
            "1 while conversation memory is shared through Redis; 0 while this process "
            "falls back to its own (Redis unset, slow or gone).",
            registry=r,
            multiprocess_mode="min",
        )
        self.in_flight = LiveGauge(
            "vllm_guard_requests_in_flight",
            "Guarded requests being worked on or streamed right now (a scaling signal).",
            ["endpoint"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.config_info = Gauge(
            "vllm_guard_config_info",
            "The guard's mode and policies (value is always 1): alerts use it, e.g. to stay "
            "quiet about delivered degenerate answers in observe mode.",
            ["mode", "on_exhausted", "after_release", "retry_target"],
            registry=r,
            multiprocess_mode="max",
        )
        self.build_info = Gauge(
            "vllm_guard_build_info",
            "vllm-guard build (value is always 1).",
            ["version"],
            registry=r,
            multiprocess_mode="max",
        )
        self.build_info.labels(__version__).set(1)
        if not multiprocess_enabled():
            ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes

    def forget_backend(self, name: str, address: str, slot_taken: bool = False) -> None:
        """A discovered pod left: its per-backend series (``name``, ``address``) go, so
        that a gone pod is neither shown up nor alerted on as down, and the pods'
        series stay one per pod in the pool. ``slot_taken``: a pod that joined in the
        same resolution has the slot (``name``) already, and keeps the series labelled
        by the slot alone (``vllm_guard_upstream_connection_wait_seconds``). In
        multiprocess mode a gauge's file outlives ``remove``: the value left there is
        NaN, which no ``== 0`` alert matches."""
        gauges = (
            self.backend_up,
            self.backend_hit_ratio,
            self.backend_nan_requests,
            self.backend_counts_nans,
            self.backend_info,
            self.backend_fix_info,
        )
        for gauge in gauges:
            for labelvalues in _children_of(gauge, (name, address)):
                gauge.labels(*labelvalues).set(math.nan)
        for metric in (*gauges, self.backend_degenerate_attempts):
            for labelvalues in _children_of(metric, (name, address)):
                with contextlib.suppress(KeyError):
                    metric.remove(*labelvalues)
                getattr(metric, "_remembered", {}).pop(labelvalues, None)
        if not slot_taken:
            with contextlib.suppress(KeyError):
                self.connection_wait.remove(name)
            getattr(self.connection_wait, "_remembered", {}).pop((name,), None)

    def count_degenerate(
        self, model: str, backend: str, address: str | None, kind: str, endpoint: str
    ) -> None:
        """An attempt judged degenerate (before or after its release) on the backend
        named ``backend`` at ``address`` (``Backend.series_address``; None once the pod
        left the pool: its per-pod series are gone and stay gone)."""
        self.degenerate.labels(model, backend, kind, endpoint).inc()
        if address is not None:
            self.backend_degenerate_attempts.labels(backend, address).inc()

    def count_answered(self, endpoint: str, error: GatewayError) -> None:
        """A request the gateway answered itself (when ``error`` is one it answers)."""
        if error.answered_by_gateway:
            self.gateway_answered.labels(endpoint, str(error.status), error.code or "none").inc()

    def model_label(self, model: str | None) -> str:
        if model is not None and (model in self.models or model in self._discovered):
            return model
        return OTHER

    def discover_models(self, names: Iterable[str]) -> None:
        for name in names:
            if len(self._discovered) >= MAX_DISCOVERED_MODELS:
                return
            self._discovered.add(name)

    def render(self) -> tuple[bytes, str]:
        if multiprocess_enabled():
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
            # process_*: the worker answering this scrape (multiprocess mode has no
            # way to merge them across workers).
            ProcessCollector(registry=merged)
            return generate_latest(merged), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _children_of(metric: MetricWrapperBase, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The label values of ``metric``'s children whose first values are ``prefix``."""
    with metric._lock:
        return [tuple(k) for k in metric._metrics if tuple(k[: len(prefix)]) == prefix]
