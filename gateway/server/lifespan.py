"""What one serving process owns from start to stop: the backend pool, the metrics,
the guard and the scrape of vLLM's metrics (``Runtime``), started and stopped by
the app's lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gateway import __version__
from gateway.config import Settings
from gateway.guard.loop import Guard
from gateway.observe.evidence import EvidenceStore
from gateway.observe.metrics import Metrics
from gateway.observe.tracing import start_tracing, stop_tracing
from gateway.upstream.eager_send import write_request_bodies_eagerly
from gateway.upstream.pool import BackendPool
from gateway.upstream.scrape import BackendScraper

log = logging.getLogger("vllm_guard")


@dataclass(slots=True)
class Runtime:
    settings: Settings
    pool: BackendPool
    metrics: Metrics
    guard: Guard


def tune_gc() -> None:
    """Move everything alive after startup out of the collector's sight and collect
    the young generation less often: the default thresholds put full collections in
    the tail of small requests at c=32 (BENCHMARKS.md), CPU per request unchanged."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def runtime_lifespan(
    settings: Settings, attach: Callable[[FastAPI, Runtime], None], *, tune: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: builds this process's ``Runtime``, hands it to ``attach``,
    and stops it at shutdown. ``tune``: this is the serving process (not a test that
    embeds the app), whose interpreter-wide settings are ours to change."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if tune:  # the loop is the serving process's own
            write_request_bodies_eagerly(asyncio.get_running_loop())
        pool = BackendPool(settings.upstream)
        metrics = Metrics(CollectorRegistry(), models=settings.models, backends=pool.names)
        guard_settings = settings.guard
        metrics.config_info.labels(
            guard_settings.mode,
            guard_settings.on_exhausted,
            guard_settings.stream.after_release,
            guard_settings.retry_target,
        ).set(1)
        scraper = BackendScraper(pool, metrics, settings.upstream)
        evidence = open_evidence(settings)
        tracing = start_tracing(settings.tracing)  # None while off: nothing imported
        guard = Guard(
            settings, pool, metrics,
            evidence=evidence, version_of=scraper.version_of, tracing=tracing,
        )  # fmt: skip
        attach(app, Runtime(settings, pool, metrics, guard))
        if guard.redis is not None:
            await guard.redis.connect()
        pool.on_departed.append(metrics.forget_backend)
        pool.on_connection_wait = lambda backend, waited: metrics.connection_wait.labels(
            backend
        ).observe(waited)
        await pool.discover()
        await pool.check_all(initial=True)
        await scraper.scrape_once()
        pool.start()
        scraper.start()
        if tune:
            tune_gc()
        log_start(settings, guard, pool.names)
        try:
            yield
        finally:
            await scraper.stop()
            await pool.stop()
            if guard.redis is not None:
                await guard.redis.close()
            if tracing is not None:  # the spans still queued, exported (a few seconds at most)
                await stop_tracing(tracing)

    return lifespan


def open_evidence(settings: Settings) -> EvidenceStore | None:
    """The evidence store when capture is on and its directory can be written; else
    None, with an ERROR that says what to mount (a read-only root filesystem)."""
    if not settings.evidence.enabled:
        return None
    try:
        return EvidenceStore(settings.evidence, per_process=settings.server.workers > 1)
    except OSError as exc:
        log.error(
            "evidence.path %s cannot be written (%s): mount a writable volume at its "
            "directory (the root filesystem may be read-only) or set evidence.path; "
            "running without evidence capture",
            settings.evidence.path, exc.strerror or exc,
        )  # fmt: skip
        return None


def log_start(settings: Settings, guard: Guard, backends: list[str]) -> None:
    log.info("vllm-guard %s ready; backends: %s", __version__, ", ".join(backends))
    if not guard.ladder.shared:
        log.info(
            "guard.salt_reuse.key is not set: this process draws its own retry-salt key, "
            "so other workers and replicas retry a conversation in other cache "
            "namespaces (set the key to share them)"
        )
    if settings.server.workers > 1 and guard.redis is None:
        log.info(
            "state.redis_url is not set: the %d workers each keep their own conversation "
            "memory (a turn on another worker retries before it finds the clean salt)",
            settings.server.workers,
        )
