"""A real Prometheus server (Debian's ``prometheus`` package) scraping test targets."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from support.servers import free_port, wait_http


class PrometheusServer:
    def __init__(
        self,
        targets: dict[str, str | list[str]],
        scrape_interval: str = "1s",
        labels: dict[str, dict[str, str]] | None = None,
        rule_files: list[Path] | None = None,
    ) -> None:
        """``targets``: job name -> host:port (or several); ``labels``: job name -> target
        labels (as deploy/prometheus/prometheus.yml labels each vLLM with its backend
        name); ``rule_files``: recording and alerting rules it evaluates (every
        ``scrape_interval``)."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (make prometheus)")
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-guard-prom-"))
        target_labels = labels or {}
        jobs = "\n".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: "
            + json.dumps([target] if isinstance(target, str) else target)
            + (f"\n        labels: {json.dumps(target_labels.get(job))}" * (job in target_labels))
            for job, target in targets.items()
        )
        rules = "".join(f"  - {json.dumps(str(path))}\n" for path in rule_files or [])
        (self.dir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + f"scrape_configs:\n{jobs}\n"
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        log = (self.dir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_http(self.url + "/-/ready", 60, self.process)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        payload = response.json()
        if payload.get("status") != "success":
            raise AssertionError(f"query failed: {promql}: {payload}")
        result: list[dict[str, Any]] = payload["data"]["result"]
        return result

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        if not result:
            return None
        return float(result[0]["value"][1])

    def wait_for_scrape_after(self, moment: float, job: str, timeout_s: float = 20) -> None:
        """Wait until every target of ``job`` was scraped after ``moment`` (unix time)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            targets = httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]
            mine = [t for t in targets["activeTargets"] if t["labels"]["job"] == job]
            if mine and all(
                t["health"] == "up" and _parse_time(t["lastScrape"]) > moment for t in mine
            ):
                return
            time.sleep(0.3)
        raise TimeoutError(f"prometheus did not scrape {job} in time")


def _parse_time(value: str) -> float:
    from datetime import datetime

    # e.g. 2026-12-02T14:40:01.123456789Z: trim to microseconds for fromisoformat
    head, _, frac = value.rstrip("Z").partition(".")
    frac = (frac + "000000")[:6]
    return datetime.fromisoformat(f"{head}.{frac}+00:00").timestamp()
