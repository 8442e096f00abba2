"""The edge: which paths and methods get through, with and without a key.

A scripted backend records every request that reaches it, so "refused" means it
never saw the request. Raw sockets where a client library would normalise.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import GatewayFactory
from support.stub_backend import StubBackend

from gateway.server.auth import hash_key
from gateway.server.paths import UNGUARDED_SPELLINGS, VLLM_ADMIN_PATHS


@pytest.fixture
def stub() -> Iterator[StubBackend]:
    with StubBackend() as backend:
        yield backend


KEY = "client-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path", sorted(VLLM_ADMIN_PATHS))
def test_vllm_admin_endpoints_are_closed_by_default(
    stub: StubBackend, gateway_for: GatewayFactory, path: str
) -> None:
    gateway = gateway_for(stub.url)
    for method in ("GET", "POST"):
        response = httpx.request(method, gateway.url + path, content=b"{}")
        assert response.status_code == 403
        assert response.json()["error"]["type"] == "permission_error"
        # ...whatever the spelling
        response = httpx.request(method, gateway.url + "/" + path + "/", content=b"{}")
        assert response.status_code == 403
    assert stub.state.paths == []


def test_an_allowlisted_admin_endpoint_is_proxied(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, server={"allow_vllm_paths": ["/reset_prefix_cache"]})
    assert httpx.post(gateway.url + "/reset_prefix_cache").status_code == 200
    assert httpx.post(gateway.url + "/sleep").status_code == 403
    assert stub.state.paths == ["/reset_prefix_cache"]


@pytest.mark.parametrize("path", sorted(UNGUARDED_SPELLINGS))
def test_unguarded_ways_into_the_generation_handlers_are_refused(
    stub: StubBackend, gateway_for: GatewayFactory, path: str
) -> None:
    gateway = gateway_for(stub.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(gateway.url + path, json=body)
    assert response.status_code == 400
    assert "/v1/chat/completions" in response.json()["error"]["message"]
    assert stub.state.paths == []
    assert stub.state.requests == []


def test_auth_exemptions_hold_for_reads_of_the_gateways_own_endpoints_only(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """POST or DELETE on /healthz, /readyz, /metrics without a key fell through to the
    catch-all proxy; now only GET and HEAD are open, and only where the gateway
    answers itself."""
    gateway = gateway_for(stub.url, auth={"api_key_sha256": [hash_key(KEY)]})
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(gateway.url + path).status_code == 200
        assert httpx.head(gateway.url + path).status_code == 200
        for method in ("POST", "DELETE", "PUT", "PATCH"):
            response = httpx.request(method, gateway.url + path, content=b"x")
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gateway.url + "/v1/models").status_code == 401
    assert stub.state.paths == []


def test_with_metrics_off_metrics_is_an_ordinary_proxied_path_behind_the_key(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """With metrics.enabled false, a keyless GET /metrics returned vLLM's metrics."""
    gateway = gateway_for(
        stub.url, auth={"api_key_sha256": [hash_key(KEY)]}, metrics={"enabled": False}
    )
    assert httpx.get(gateway.url + "/metrics").status_code == 401
    assert httpx.get(gateway.url + "/metrics", headers=AUTH).status_code == 200


def raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/other"])
def test_repeated_headers_survive_and_connection_named_ones_do_not(
    stub: StubBackend, gateway_for: GatewayFactory, path: str
) -> None:
    """Repeated response headers collapsed to the last one (two Set-Cookie -> one,
    Vary lost), as did repeated request headers; headers named in Connection went
    through in both directions."""
    gateway = gateway_for(stub.url)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        "X-Stub-Scenario: repeated-headers\r\n"
        "Accept-Language: en\r\nAccept-Language: fr\r\n"
        "Connection: close, x-client-hop\r\nX-Client-Hop: secret\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    response = raw_request(gateway.url, head, body)
    status_line, _, rest = response.partition(b"\r\n")
    assert b" 200 " in status_line
    headers = [tuple(line.split(b": ", 1)) for line in rest.split(b"\r\n\r\n", 1)[0].split(b"\r\n")]
    names = [name.lower() for name, _ in headers]
    assert (b"set-cookie", b"a=1; Path=/") in headers
    assert (b"set-cookie", b"b=2; Path=/") in headers
    assert names.count(b"vary") == 2
    assert b"x-backend-internal" not in names
    sent = stub.state.raw_headers[-1]
    assert [v for k, v in sent if k == "accept-language"] == ["en", "fr"]
    assert "x-client-hop" not in [k for k, _ in sent]


def test_the_evidence_store_takes_bad_input_without_failing_the_request(
    stub: StubBackend, gateway_for: GatewayFactory, tmp_path: object
) -> None:
    """A degenerate answer to a prompt nested 300 deep (past what orjson encodes):
    the client gets its answer and the evidence line is written without the prompt."""
    import json
    from pathlib import Path

    path = Path(str(tmp_path)) / "evidence.jsonl"
    gateway = gateway_for(
        stub.url,
        evidence={"enabled": True, "path": str(path), "include_prompt": True},
        guard={"max_attempts": 1},
    )
    deep = "[" * 300 + "]" * 300
    body = ('{"model": "m", "messages": [{"role": "user", "content": ' + deep + "}]}").encode()
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={"x-stub-scenario": "bang", "content-type": "application/json"},
    )
    assert response.status_code == 200
    assert response.headers["x-vllm-guard-verdict"] == "degenerate"
    record = json.loads(path.read_text().splitlines()[0])
    assert record["kind"] == "punct_run"
    assert record["prompt"].startswith("(not stored")


def test_an_unexpected_error_is_one_log_line_and_an_openai_500(
    stub: StubBackend, gateway_for: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A 500-deep request once produced a 222 KB traceback per 1 KB request."""
    gateway = gateway_for(stub.url)

    async def explode(*args: object, **kwargs: object) -> object:
        def down(n: int) -> int:
            return down(n + 1)

        return down(0)

    gateway.runtime.guard.handle = explode
    with caplog.at_level("INFO", logger="vllm_guard"):
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "RecursionError" in message
    assert "\n" not in message
    assert errors[0].exc_info is None
    assert len(message) < 1000
