"""The version gates on third-party internals, closed, on the real serving path.

``vllm-guard serve`` runs its edge protocol only on a uvicorn release it was tested
on (``gateway.server.uvicorn_edge.TESTED_UVICORN``). Here the installed uvicorn claims another
release: the gateway says so once, in a WARNING, and guards with uvicorn's stock
protocol, against the real tiny vLLM and the official SDK (seen failing with the
gate broken, ``edge_protocol`` ignoring the check: no WARNING).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from conftest import RunningVLLM, openai_client
from support.servers import free_port, wait_http

pytestmark = pytest.mark.vllm

#: The CLI, started after the installed uvicorn's version was replaced in memory.
AS_IF_UVICORN = (
    "import sys, uvicorn; uvicorn.__version__ = sys.argv.pop(1); "
    "from gateway.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_an_untested_uvicorn_serves_guarded_with_its_stock_protocol(
    vllm: RunningVLLM,
) -> None:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-guard-gate-")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-c", AS_IF_UVICORN, "0.99.0", "serve", "--backend", vllm.url,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", 60, process)
        client = openai_client(url)
        messages = [{"role": "user", "content": "open the settings page"}]
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, messages=messages, max_tokens=8, temperature=0
        )
        assert raw.status_code == 200
        assert raw.headers["x-vllm-guard-verdict"] == "clean"
        assert raw.parse().choices[0].message.content
        with client.chat.completions.with_streaming_response.create(
            model=vllm.model, messages=messages, max_tokens=8, temperature=0, stream=True
        ) as streamed:
            assert streamed.headers["x-vllm-guard-verdict"] == "clean"
            chunks = list(streamed.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = open(log.name).read()  # noqa: SIM115
    warnings = [line for line in text.splitlines() if "WARNING" in line and "uvicorn" in line]
    assert len(warnings) == 1, text
    assert "0.99.0 is outside the tested range >=0.55,<0.56" in warnings[0]
    assert "Traceback" not in text
