"""A local vLLM (the CPU build) serving a tiny model, for the demo and the tests.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` from the vLLM
virtualenv (``tests/support/install_vllm.sh`` creates it), with the test-only
scheduler that can poison prefix-cache hits (``tests/support/poison_scheduler.py``)
unless ``fixed=True``. Only for trying things out and testing: never in production.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

#: The source tree this module runs from (an editable install, the image's /app).
REPO = Path(__file__).resolve().parents[2]

#: The test-only pieces a local poisoned vLLM needs (its install script, the tiny
#: model builder, the poisoning scheduler): a checkout's ``tests/support``, or
#: ``VLLM_GUARD_SUPPORT_DIR`` pointing at one.
SUPPORT = Path(os.environ.get("VLLM_GUARD_SUPPORT_DIR") or REPO / "tests" / "support")
SUPPORT_FILES = ("install_vllm.sh", "build_tiny_model.py", "poison_scheduler.py")


def missing_support() -> str | None:
    """What the local vLLM lacks to start, said exactly, or None."""
    missing = [name for name in SUPPORT_FILES if not (SUPPORT / name).exists()]
    if not missing:
        return None
    return (
        f"the local poisoned vLLM needs {', '.join(missing)} from a vllm-guard source "
        f"checkout's tests/support (looked in {SUPPORT}): run `make demo` in a checkout, "
        "or set VLLM_GUARD_SUPPORT_DIR to a checkout's tests/support. They are test-only "
        "(a scheduler that poisons prefix-cache hits) and are not installed with the package."
    )


MODEL_NAME = "tiny"


def vllm_python() -> Path:
    override = os.environ.get("VLLM_GUARD_VLLM_PYTHON")
    if override:
        return Path(override)
    venv = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/vllm-guard/vllm-venv"))
    return venv / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ensure_model(directory: Path) -> Path:
    if not (directory / "model.safetensors").exists():
        subprocess.run(
            [str(vllm_python()), str(SUPPORT / "build_tiny_model.py"), str(directory)],
            check=True,
            capture_output=True,
        )
    return directory


def wait_http(url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


def vllm_cpus() -> list[int]:
    """The CPUs the local vLLM may run on: all but the last, which is left to the
    gateway and its clients (``VLLM_GUARD_VLLM_CPUS="0,1"`` overrides).

    vLLM's CPU build binds its worker to a core and spins its engine core on
    ``sched_yield()`` while the worker computes a step. On a 2-core machine that
    kept every other process runnable but not running for seconds at a time:
    a process that wakes every 10 ms missed its wake-ups by seconds during long
    generations, so a test client could only "hang up" after vLLM had finished.
    With vLLM confined to core 0 it missed none, at the cost of slower generation
    (BENCHMARKS.md).
    """
    override = os.environ.get("VLLM_GUARD_VLLM_CPUS")
    if override:
        return [int(cpu) for cpu in override.split(",")]
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:-1] if len(allowed) > 1 else allowed


class VLLMServer:
    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        poison_rate: float = 0.0,
        fixed: bool = False,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = port or free_port()
        self.poison_rate = poison_rate
        #: The "fixed" backend: the vllm-guard-fix plugin on, no poisoning scheduler.
        self.fixed = fixed
        self.extra_args = extra_args or []
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cpus = vllm_cpus()
        confine = ["taskset", "-c", ",".join(map(str, cpus))] if shutil.which("taskset") else []
        return [
            *confine,
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--max-model-len", "2048",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", str(self.port),
            # Request ids in the log, so tests can see vLLM abort a discarded attempt.
            "--enable-log-requests",
            *([] if self.fixed else ["--scheduler-cls", "poison_scheduler.PoisonScheduler",
                                     "--worker-cls", "poison_scheduler.PoisonWorker"]),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "VG_POISON_RATE": str(self.poison_rate),
            # The Responses API's store (previous_response_id, background), as a
            # deployment that uses them runs it; off by default in vLLM.
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            # vLLM's own count of requests with NaN logits (vllm:corrupted_requests):
            # the ground truth the gateway shows beside its verdicts, as the chart's
            # vLLM runs it.
            "VLLM_COMPUTE_NANS_IN_LOGITS": "1",
            "PYTHONPATH": str(SUPPORT),
            **self.extra_env,
        }
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env.pop("VLLM_GUARD_FIX_STATE_DIR", None)  # each server counts its own lookups
        if self.fixed:  # as the fixed image runs it: refuse to start unless active
            env.pop("VLLM_GUARD_FIX_DISABLE", None)
            env["VLLM_GUARD_FIX_REQUIRE"] = "1"
        else:
            env["VLLM_GUARD_FIX_DISABLE"] = "1"
            env.pop("VLLM_GUARD_FIX_REQUIRE", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 420) -> None:
        try:
            wait_http(self.url + "/health", timeout_s, self.process)
        except Exception as exc:
            tail = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM did not start: {exc}\n--- log tail ---\n{tail}") from exc

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
