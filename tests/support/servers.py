"""Real servers for the tests: a tiny vLLM (CPU build), the gateway in a real uvicorn.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` from the vLLM
virtualenv (tests/support/install_vllm.sh) with the test-only poisoning scheduler.
``GatewayServer`` runs ``create_app(settings)`` in a uvicorn thread on a real
socket, so streams, disconnects and mid-stream failures are real.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.localvllm import (
    MODEL_NAME,
    SUPPORT,
    VLLMServer,
    ensure_model,
    free_port,
    vllm_python,
    wait_http,
)

__all__ = [
    "MODEL_NAME", "SUPPORT", "GatewayServer", "VLLMServer", "ensure_model", "free_port",
    "gateway_settings", "vllm_python", "wait_http",
]  # fmt: skip


class GatewayServer:
    """The gateway app in a real uvicorn on a real socket, in a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = free_port()
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            loop="asyncio",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    def __enter__(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def gateway_settings(backend_urls: list[str] | str, **sections: Any) -> Settings:
    urls = [backend_urls] if isinstance(backend_urls, str) else backend_urls
    backends = sections.pop("backends", None) or [
        {"name": f"vllm{i}", "url": url} for i, url in enumerate(urls)
    ]
    upstream = {"backends": backends, **sections.pop("upstream", {})}
    return Settings.model_validate({"upstream": upstream, **sections})


def main() -> None:  # python tests/support/servers.py: start the tiny vLLM by hand
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    model = ensure_model(Path(os.environ.get("VLLM_GUARD_MODEL_DIR", "/tmp/vllm-guard-tiny-model")))
    server = VLLMServer(model, Path("/tmp/vllm-guard-vllm.log"), port=port,
                        poison_rate=float(os.environ.get("VG_POISON_RATE", "0")))  # fmt: skip
    server.start()
    print(f"starting vLLM on {server.url} (log: {server.log_path}) ...", flush=True)
    server.wait_ready()
    print(f"ready: {server.url}  (model name '{MODEL_NAME}'; Ctrl-C stops it)", flush=True)
    try:
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
