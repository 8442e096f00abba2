"""Faults only a scripted backend produces on demand: garbage SSE, drops, late corruption,
upstream 503, a backend that never answers, bad bodies and limits."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import anthropic
import httpx
import orjson
import pytest
from conftest import GatewayFactory, scraped_metric, wait_for
from support.stub_backend import StubBackend

from gateway.server.uvicorn_edge import ServerHooksProtocol
from gateway.upstream import pool

BODY = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def stub() -> Iterator[StubBackend]:
    with StubBackend() as backend:
        yield backend


def stream_events(url: str, scenario: str, **body: object) -> tuple[httpx.Response, list[bytes]]:
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True, **body},
        headers={"x-stub-scenario": scenario}, timeout=30,
    ) as response:  # fmt: skip
        data = response.read()
    events = [e[len(b"data: ") :] for e in data.split(b"\n\n") if e.startswith(b"data: ")]
    return response, events


def error_of(event: bytes) -> dict[str, object]:
    error: dict[str, object] = orjson.loads(event)["error"]
    return error


def test_garbage_sse_before_release_is_a_502(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url)
    response, _ = stream_events(gateway.url, "sse-garbage")
    assert response.status_code == 502
    assert orjson.loads(response.read())["error"]["code"] == "upstream_protocol_error"


def test_an_sse_event_over_the_limit_is_a_502(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, upstream={"max_sse_event_bytes": 16384})
    response, _ = stream_events(gateway.url, "big-event")
    assert response.status_code == 502
    assert "larger than 16384 bytes" in orjson.loads(response.read())["error"]["message"]


def test_garbage_sse_after_release_ends_with_inband_error(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, guard={"stream": {"holdback_chars": 0}})
    response, events = stream_events(gateway.url, "sse-garbage")
    assert response.status_code == 200
    assert error_of(events[-2])["code"] == "upstream_protocol_error"
    assert events[-1] == b"[DONE]"


def test_mid_stream_drop_ends_with_inband_error(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, guard={"stream": {"holdback_chars": 8}})
    response, events = stream_events(gateway.url, "sse-drop")
    assert response.status_code == 200
    assert b"button" in b"".join(events)  # released before the drop
    assert error_of(events[-2])["type"] == "upstream_error"
    assert events[-1] == b"[DONE]"


def test_a_backend_silent_before_release_is_a_504(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """Headers and one event, then nothing: ``read_s`` of silence is a timeout, and
    the backend's connection is closed (vLLM aborts a request whose client left)."""
    gateway = gateway_for(stub.url, upstream={"timeouts": {"read_s": 1.0}})
    started = time.perf_counter()
    response, _ = stream_events(gateway.url, "stall-early")
    assert response.status_code == 504
    assert orjson.loads(response.read())["error"]["type"] == "timeout"
    assert time.perf_counter() - started < 5
    assert wait_for(lambda: stub.state.open_streams == 0, timeout_s=5)


@pytest.fixture(params=["hook", "aiohttp's own timer"])
def read_timer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a stream's silence is timed: the StallWatch, where aiohttp's per-read
    timer can be dropped (``gateway.upstream.pool.READ_TIMER_HOOK``), and aiohttp's own
    ``sock_read`` timer where the installed aiohttp has no hook for it."""
    monkeypatch.setattr(pool, "READ_TIMER_HOOK", request.param == "hook")
    return str(request.param)


def test_a_backend_silent_after_release_ends_the_stream_in_band(
    stub: StubBackend, gateway_for: GatewayFactory, read_timer: str
) -> None:
    # 1 s: far above the stub's 5 ms between words even on a loaded machine, so the
    # answer is released before the silence.
    gateway = gateway_for(
        stub.url, upstream={"timeouts": {"read_s": 1.0}}, guard={"stream": {"holdback_chars": 8}}
    )
    started = time.perf_counter()
    response, events = stream_events(gateway.url, "stall-late")
    assert response.status_code == 200
    assert b"button" in b"".join(events)  # released before the silence
    assert error_of(events[-2])["type"] == "timeout"
    assert events[-1] == b"[DONE]"
    assert time.perf_counter() - started < 5
    assert wait_for(lambda: stub.state.open_streams == 0, timeout_s=5)


def test_read_timeout_is_the_longest_silence_not_the_streams_length(
    stub: StubBackend, gateway_for: GatewayFactory, read_timer: str
) -> None:
    """40 events 50 ms apart (2.4 s in all) under a 1 s read timeout: the stream is
    whole. The stall timer wakes every 0.25 s while the stream runs and must count
    the wait for the next event, not time the stream. (1 s leaves a loaded machine
    20 times the stub's gap.)"""
    gateway = gateway_for(
        stub.url, upstream={"timeouts": {"read_s": 1.0}}, guard={"stream": {"holdback_chars": 8}}
    )
    response, events = stream_events(gateway.url, "slow-stream")
    assert response.status_code == 200
    assert sum(e.count(b"tick") for e in events) == 40
    assert events[-1] == b"[DONE]"
    assert not any(b'"error"' in e for e in events)


@pytest.mark.parametrize("http_protocol", ["hook", "auto"])
def test_a_client_that_leaves_is_seen_under_either_server_protocol(
    stub: StubBackend, gateway_for: GatewayFactory, http_protocol: str
) -> None:
    """The gateway learns that its client left from the server protocol's
    ``ServerHooks`` (``vllm-guard serve`` and the test gateways) or, under a plain
    uvicorn, from a task watching ``receive()``: either way each departure is counted
    once, in its phase, and the backend's request is closed."""
    gateway = gateway_for(
        stub.url,
        http_protocol=ServerHooksProtocol if http_protocol == "hook" else "auto",
        guard={"stream": {"holdback_chars": 8}},
    )

    def left(phase: str) -> float:
        return scraped_metric(gateway.url, "vllm_guard_client_disconnects_total", phase=phase)

    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json={**BODY, "stream": True},
        headers={"x-stub-scenario": "slow-stream"}, timeout=30,
    ) as response:  # fmt: skip
        next(response.iter_raw())  # released; the stream runs 2 s more: leave now
    assert wait_for(lambda: left("streaming") == 1, timeout_s=10)
    assert wait_for(lambda: stub.state.open_streams == 0, timeout_s=10)

    with pytest.raises(httpx.ReadTimeout):  # the backend never answers; leave after 0.5 s
        httpx.post(
            gateway.url + "/v1/chat/completions", json=BODY,
            headers={"x-stub-scenario": "hang"}, timeout=0.5,
        )  # fmt: skip
    assert wait_for(lambda: left("before_response") == 1, timeout_s=10)
    backends = gateway.runtime.pool.backends
    assert wait_for(lambda: all(b.in_flight == 0 for b in backends), timeout_s=10)
    stream_events(gateway.url, "clean")  # read to the end: no departure
    time.sleep(0.3)
    assert (left("streaming"), left("before_response")) == (1, 1)


def test_a_client_that_reads_slowly_gets_every_event_in_order(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """8 MB of events while the client reads nothing for a second: the gateway's
    socket buffer fills, the server pauses writing, and chunks that were written
    directly (``ServerHooks.write_body``) and those sent after the pause through
    ``send()`` (which waits for the drain) arrive complete and in order."""
    gateway = gateway_for(stub.url)
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json={**BODY, "stream": True},
        headers={"x-stub-scenario": "flood"}, timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        time.sleep(1.0)
        data = response.read()
    events = [e[len(b"data: ") :] for e in data.split(b"\n\n") if e.startswith(b"data: ")]
    texts = [
        c["delta"].get("content", "")
        for e in events[:-1]
        for c in orjson.loads(e).get("choices", [])
    ]
    numbered = [t[:6] for t in texts if t[:6].isdigit()]
    assert numbered == [f"{i:06d}" for i in range(8000)]
    assert events[-1] == b"[DONE]"


@pytest.mark.parametrize("holdback", [0, 1024])
def test_stream_ended_late_after_done_keeps_its_connection(
    stub: StubBackend, gateway_for: GatewayFactory, holdback: int
) -> None:
    """The backend's body ends 50 ms after [DONE]: the client's answer is complete at
    [DONE], and the gateway reads the backend's body to its end, so the connection
    goes back to the pool. Closing it with the terminator unread cost a new TCP
    connection per stream (six ports for six requests here). With hold-back 1,024 the
    whole stream is held before release; with 0 it is relayed as it comes."""
    gateway = gateway_for(
        stub.url,
        guard={"stream": {"holdback_chars": holdback}},
        upstream={"health_interval_s": 600, "metrics_scrape_interval_s": 600},
    )
    first = len(stub.state.client_ports)
    for _ in range(6):
        # The last stream's body has ended (the stub's 50 ms terminator sent) before
        # the next starts: a loaded machine could otherwise find both pooled
        # connections still reading and open a third.
        assert wait_for(lambda: stub.state.open_streams == 0, timeout_s=10)
        started = time.perf_counter()
        response, events = stream_events(gateway.url, "late-end")
        assert (response.status_code, events[-1]) == (200, b"[DONE]")
        assert time.perf_counter() - started < 5  # never held to FINISH_READING_S per stream
    ports = stub.state.client_ports[first:]
    assert len(ports) == 6
    # One, reused (two tolerated: the gateway reads the terminator a moment after the
    # stub has sent it).
    assert len(set(ports)) <= 2, f"{ports}: {len(set(ports))} connections for 6 streams"


@pytest.mark.parametrize("policy", ["pass", "cut"])
def test_corruption_after_release(
    stub: StubBackend, gateway_for: GatewayFactory, policy: str
) -> None:
    gateway = gateway_for(
        stub.url, guard={"stream": {"holdback_chars": 8, "after_release": policy}}
    )
    response, events = stream_events(gateway.url, "late-bang")
    assert response.status_code == 200
    assert response.headers["x-vllm-guard-verdict"] == "clean"  # what was known at release
    metrics = httpx.get(gateway.url + "/metrics").text
    assert (
        'vllm_guard_degenerate_responses_total{backend="vllm0",endpoint="chat",'
        'kind="punct_run",model="other"} 1.0' in metrics
    )
    assert 'verdict="degenerate"} 1.0' in metrics
    if policy == "cut":
        assert error_of(events[-2])["type"] == "degenerate_response"
        assert events[-1] == b"[DONE]"
        assert 'vllm_guard_stream_cut_total{backend="vllm0",model="other"} 1.0' in metrics
    else:
        assert events[-1] == b"[DONE]"
        assert sum(e.count(b'"!"') for e in events) == 30
        assert "vllm_guard_degenerate_delivered_total{" in metrics


def test_upstream_503_passes_through(stub: StubBackend, gateway_for: GatewayFactory) -> None:
    gateway = gateway_for(stub.url)
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=BODY, headers={"x-stub-scenario": "503"}
    )
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "overloaded"


def test_backend_that_never_answers_is_a_504(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, upstream={"timeouts": {"read_s": 0.5}})
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=BODY, headers={"x-stub-scenario": "hang"},
        timeout=10,
    )  # fmt: skip
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"


@pytest.mark.parametrize("scenario", ["not-json", "truncated-json", "empty-body"])
def test_a_success_that_is_not_a_json_object_is_a_counted_502(
    stub: StubBackend, gateway_for: GatewayFactory, scenario: str
) -> None:
    """An HTML page, a truncated or an empty body with status 200 is never "clean"."""
    gateway = gateway_for(stub.url)
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=BODY, headers={"x-stub-scenario": scenario}
    )
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_protocol_error"
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'vllm_guard_upstream_errors_total{backend="vllm0",kind="protocol"} 1.0' in metrics
    assert 'verdict="error"} 1.0' in metrics


def test_a_success_that_is_not_json_fails_over_to_another_backend(
    gateway_for: GatewayFactory,
) -> None:
    with StubBackend() as html, StubBackend() as good:
        html.state.forced_scenario = "not-json"
        gateway = gateway_for(
            [],
            backends=[
                {"name": "html", "url": html.url, "weight": 1000},  # nearly always first
                {"name": "good", "url": good.url, "weight": 0.001},
            ],
        )
        for _ in range(3):
            response = httpx.post(gateway.url + "/v1/chat/completions", json=BODY, timeout=30)
            assert response.status_code == 200
            assert "button" in response.json()["choices"][0]["message"]["content"]
        assert html.state.requests, "the HTML backend was never tried"


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1,2,3]", 400, "JSON object"),
        (b'{"stream": 1}', 400, "'stream'"),
        (b'{"cache_salt": "a/b"}', 400, "must not contain"),
        (b"\xc3\x28", 400, "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, 400, "not valid JSON"),
    ],
)
def test_bad_bodies_get_openai_errors_before_any_upstream_call(
    stub: StubBackend, gateway_for: GatewayFactory, content: bytes, status: int, fragment: str
) -> None:
    gateway = gateway_for(stub.url)
    response = httpx.post(gateway.url + "/v1/chat/completions", content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert stub.state.requests == []


def test_oversized_body_is_413(stub: StubBackend, gateway_for: GatewayFactory) -> None:
    gateway = gateway_for(stub.url, server={"max_body_bytes": 4096})
    response = httpx.post(gateway.url + "/v1/chat/completions", content=b"{" + b" " * 5000 + b"}")
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    chunked = httpx.post(
        gateway.url + "/v1/chat/completions", content=iter([b"{", b" " * 5000, b"}"])
    )
    assert chunked.status_code == 413
    assert stub.state.requests == []


def test_backend_without_cached_tokens_leaves_token_metrics_alone(
    stub: StubBackend, gateway_for: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The stub's usage has no prompt_tokens_details, like vLLM without
    --enable-prompt-tokens-details: say so once, write no token counts (not zeros)."""
    gateway = gateway_for(stub.url)
    for _ in range(3):
        assert httpx.post(gateway.url + "/v1/chat/completions", json=BODY).status_code == 200
    metrics = httpx.get(gateway.url + "/metrics").text
    assert "vllm_guard_prompt_tokens_total{" not in metrics
    assert "vllm_guard_cached_prompt_tokens_total{" not in metrics
    assert caplog.text.count("does not report cached_tokens") == 1


def test_connect_timeout(gateway_for: GatewayFactory) -> None:
    """A backend whose accept queue is full never completes the TCP handshake."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue; later SYNs are dropped
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        gateway = gateway_for(
            f"http://127.0.0.1:{port}",
            upstream={"timeouts": {"connect_s": 0.5, "pool_s": 0.5}, "health_interval_s": 60},
        )
        gateway.runtime.pool.backends[0].mark(True)  # the startup health check failed
        started = time.monotonic()
        response = httpx.post(gateway.url + "/v1/chat/completions", json=BODY, timeout=20)
        elapsed = time.monotonic() - started
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert elapsed < 5
    finally:
        for s in [listener, *fillers]:
            s.close()


def test_a_generation_on_a_closed_pooled_connection_is_not_sent_twice(
    gateway_for: GatewayFactory,
) -> None:
    """A backend that reads a request on a kept-alive connection and then closes it
    without answering: as a keep-alive close racing a reuse, and as a load balancer
    cutting a long generation, look from the gateway. A generation (POST) that may
    have reached the backend is never sent again: the client gets a 502 in OpenAI's
    shape, and the backend saw the request once. An idempotent request (GET) is
    resent once on a new connection (never another pooled one, which may be just as
    dead: a 502 in a storm of streams once came from that), and the resend is
    counted."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    answer = orjson.dumps(
        {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "fine"}}]}
    )
    ready = threading.Event()
    port_box: list[int] = []
    heads: list[bytes] = []  # the request line of every request the backend read

    async def read_request(reader: asyncio.StreamReader) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head.split(b"\r\n", 1)[0])
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length"):
                await reader.readexactly(int(line.split(b":")[1]))

    async def serve() -> None:
        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Answer the first request on a connection; read the next one, then drop
            # the connection without answering it.
            await read_request(reader)
            await asyncio.sleep(0.3)  # so that concurrent requests need a connection each
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()
            with contextlib.suppress(asyncio.IncompleteReadError):
                await read_request(reader)
            writer.close()

        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        port_box.append(server.sockets[0].getsockname()[1])
        ready.set()
        await asyncio.sleep(30)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    ready.wait(5)
    gateway = gateway_for(f"http://127.0.0.1:{port_box[0]}", upstream={"health_interval_s": 60})
    gateway.runtime.pool.backends[0].mark(True)  # this raw server has no /health

    def ask(_: object = None) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/chat/completions", json=BODY, timeout=10)

    def get(_: object = None) -> httpx.Response:
        return httpx.get(gateway.url + "/v1/models", timeout=10)

    with ThreadPoolExecutor(3) as pool:  # three connections, all pooled afterwards
        assert [r.status_code for r in pool.map(ask, range(3))] == [200] * 3
    cut = ask()  # takes a pooled connection the backend reads from, then drops
    assert cut.status_code == 502, cut.text
    assert cut.json()["error"]["code"] == "backend_unreachable"
    with ThreadPoolExecutor(3) as pool:  # the other two pooled ones: cut as well
        assert [r.status_code for r in pool.map(ask, range(2))] == [502] * 2
    time.sleep(0.3)
    posts = [h for h in heads if h.startswith(b"POST")]
    assert len(posts) == 6  # 3 answered + 3 cut, each read once: none sent again
    with ThreadPoolExecutor(3) as pool:
        assert [r.status_code for r in pool.map(get, range(3))] == [200] * 3
    resent = get()  # a GET on a dropped pooled connection: sent again, answered
    assert resent.status_code == 200, resent.text
    assert scraped_metric(gateway.url, "vllm_guard_upstream_resends_total") == 1


def raw_post(url: str, path: bytes, body: bytes, extra: bytes = b"") -> tuple[int, bytes, bytes]:
    """POST with the path exactly as given: no client library normalises it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST " + path + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: " + str(len(body)).encode() + b"\r\n"
            + b"Connection: close\r\n\r\n" + body
        )  # fmt: skip
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, payload


DOT_PATHS = [
    b"/v1/./chat/completions",
    b"/v1/x/../chat/completions",
    b"/v1/%2e%2e/v1/chat/completions",
    b"/v1/%2E/chat/completions",
    b"/v1/chat/completions/..",
    b"/./v1/models",
]
SPELLINGS_OF_CHAT = [
    b"//v1/chat/completions",
    b"/v1//chat/completions",
    b"/v1/chat/completions/",
    b"/v1/chat//completions//",
    b"/v1%2Fchat%2Fcompletions",
]


@pytest.mark.parametrize("path", DOT_PATHS, ids=lambda p: p.decode())
def test_dot_segments_never_reach_a_backend(
    stub: StubBackend, gateway_for: GatewayFactory, path: bytes
) -> None:
    gateway = gateway_for(stub.url)
    status, _, payload = raw_post(gateway.url, path, orjson.dumps(BODY))
    assert status == 400
    assert orjson.loads(payload)["error"]["type"] == "BadRequestError"
    assert stub.state.requests == []
    assert stub.state.paths == []


@pytest.mark.parametrize("path", SPELLINGS_OF_CHAT, ids=lambda p: p.decode())
def test_every_spelling_of_a_guarded_path_is_guarded(
    stub: StubBackend, gateway_for: GatewayFactory, path: bytes
) -> None:
    """A spelling vLLM might route to chat completions gets the guard (verdict header,
    body limit) and reaches the backend as the canonical path."""
    gateway = gateway_for(stub.url, server={"max_body_bytes": 4096})
    status, head, _ = raw_post(gateway.url, path, orjson.dumps(BODY))
    assert status == 200
    assert b"x-vllm-guard-verdict: clean" in head.lower()
    assert [h[":path"] for h in stub.state.headers] == ["/v1/chat/completions"]
    too_big = orjson.dumps({**BODY, "pad": "x" * 5000})
    status, _, _ = raw_post(gateway.url, path, too_big)
    assert status == 413
    assert len(stub.state.requests) == 1


def test_the_body_limit_applies_to_proxied_paths(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url, server={"max_body_bytes": 4096})
    status, _, payload = raw_post(gateway.url, b"/v1/embeddings", b"x" * 5000)
    assert status == 413
    assert orjson.loads(payload)["error"]["code"] == "payload_too_large"
    chunked = httpx.post(gateway.url + "/tokenize", content=iter([b"{", b" " * 5000, b"}"]))
    assert chunked.status_code == 413
    assert stub.state.paths == []
    small = httpx.post(gateway.url + "/tokenize", content=b"{}")
    assert small.status_code == 200


def test_streams_read_to_the_end_are_not_counted_as_disconnects(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """Ten streams read to [DONE] on one keep-alive connection: no client left."""
    gateway = gateway_for(stub.url)
    with httpx.Client(timeout=30) as client:
        for _ in range(10):
            with client.stream(
                "POST", gateway.url + "/v1/chat/completions", json={**BODY, "stream": True}
            ) as response:
                assert response.read().endswith(b"data: [DONE]\n\n")
    time.sleep(0.2)  # the relays' watchers have had every chance to run
    metrics = httpx.get(gateway.url + "/metrics").text
    assert "vllm_guard_client_disconnects_total{" not in metrics
    assert 'verdict="clean"} 10.0' in metrics


def test_a_conversations_turns_stay_on_one_replica(gateway_for: GatewayFactory) -> None:
    """Two primaries: every turn of a conversation reaches the same one (its prefix
    cache), and the conversations spread over both."""
    with StubBackend() as a, StubBackend() as b:
        gateway = gateway_for([a.url, b.url])
        for turn in range(3):
            # 40 conversations: all on one replica by chance is 2 x 2^-40 (at 12 it
            # was 1 in 2,000: the rendezvous hash keys on the stubs' random ports).
            for conversation in range(40):
                messages = [
                    {"role": "system", "content": f"agent {conversation}"},
                    {"role": "user", "content": "open settings"},
                    *[{"role": "user", "content": f"step {t}"} for t in range(turn)],
                ]
                response = httpx.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": "m", "messages": messages},
                    timeout=30,
                )
                assert response.status_code == 200
        homes: dict[str, set[str]] = {}
        for name, stub in (("a", a), ("b", b)):
            for body in stub.state.requests:
                system = body["messages"][0]["content"]  # type: ignore[index]
                homes.setdefault(system, set()).add(name)
        assert len(homes) == 40
        assert all(len(replicas) == 1 for replicas in homes.values()), homes
        assert {next(iter(r)) for r in homes.values()} == {"a", "b"}
        # The bounded-load counts go back to zero: streams, errors and hang-ups included.
        stream_events(gateway.url, "clean")
        stream_events(gateway.url, "sse-garbage")
        httpx.post(gateway.url + "/v1/chat/completions", json=BODY,
                   headers={"x-stub-scenario": "not-json"})  # fmt: skip
        with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                          json={**BODY, "stream": True},
                          headers={"x-stub-scenario": "slow-stream"}) as response:  # fmt: skip
            next(response.iter_raw())  # ...and leave
        assert wait_for(
            lambda: all(b.in_flight == 0 for b in gateway.runtime.pool.backends), timeout_s=10
        )


def test_retries_climb_the_shared_ladder_and_the_last_one_takes_a_fresh_namespace(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    """Attempt 2 takes the conversation's first ladder rung (the namespace another
    process may have warmed); the last attempt a fresh random salt, a cache miss
    that cannot load a corrupt state (two gateways alternating turns delivered 2
    corrupt answers of 72 when every retry climbed the ladder)."""
    gateway = gateway_for(stub.url, guard={"salt_reuse": {"key": "k"}})
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=BODY, headers={"x-stub-scenario": "bang"}
    )
    assert response.headers["x-vllm-guard-attempts"] == "3"
    salts = [body.get("cache_salt") for body in stub.state.requests]
    guard = gateway.runtime.guard
    conversation = guard_conversation(guard, BODY)
    assert conversation is not None
    assert salts[0] is None
    assert salts[1] == guard.ladder.rung(conversation, None, 1)
    assert salts[2] not in (None, salts[1], guard.ladder.rung(conversation, None, 2))


def guard_conversation(guard: object, body: dict[str, object]) -> str | None:
    from gateway.guard.conversations import conversation_key
    from gateway.guard.request import parse_guarded

    request = parse_guarded("chat", orjson.dumps(body))
    settings = guard.settings.guard.salt_reuse  # type: ignore[attr-defined]
    return conversation_key("chat", request.body, None, settings)


# -- Responses and Messages: a stream that breaks after release ---------------------------


def typed_events(url: str, path: str, scenario: str) -> list[tuple[str, dict[str, object]]]:
    """(event name, data) of a Responses or Messages stream through the gateway."""
    body = {"model": "stub", "stream": True, "max_tokens": 16, "input": "hi",
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    headers = {"x-stub-scenario": scenario}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        raw = response.read()
    events = []
    for block in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
        if b"data" in lines:
            events.append((lines[b"event"].decode(), orjson.loads(lines[b"data"])))
    return events


def test_a_responses_stream_that_breaks_after_release_ends_with_a_responses_error_event(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url)
    events = typed_events(gateway.url, "/v1/responses", "sse-drop")
    name, error = events[-1]
    assert name == "error"
    assert error["type"] == "error"
    assert error["code"] == "backend_unreachable"
    # The gateway's event continues the stream's sequence numbers.
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    clean = typed_events(gateway.url, "/v1/responses", "clean")
    assert clean[-1][0] == "response.completed"
    assert wait_for(lambda: stub.state.open_streams == 0, timeout_s=5)


def test_a_messages_stream_that_breaks_after_release_ends_with_an_anthropic_error_event(
    stub: StubBackend, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(stub.url)
    events = typed_events(gateway.url, "/v1/messages", "sse-drop")
    name, error = events[-1]
    assert name == "error"
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error"  # type: ignore[index]
    assert (
        "".join(
            str(e["delta"]["text"])
            for n, e in events
            if n == "content_block_delta"  # type: ignore[index]
        )
        == "The button is at the top right of the page. "
    )
    # The official SDK raises it as an API error, mid-stream.
    client = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(
        model="stub", max_tokens=16, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-stub-scenario": "sse-drop"},
    ) as stream:  # fmt: skip
        for _ in stream.text_stream:
            pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_a_stored_response_is_continued_and_read_on_the_backend_that_made_it(
    gateway_for: GatewayFactory,
) -> None:
    """vLLM keeps a stored response (and its history) in the memory of the pod that
    made it: the next turn (previous_response_id), GET and cancel must go there.
    Eight answers over two backends: without the memory of where each was made,
    rendezvous and random routing would send each follow-up to the other backend
    half of the time (all 24 follow-ups right by chance: 1 in 2^16 or less)."""
    with StubBackend() as one, StubBackend() as two:
        stubs = {one.port: one, two.port: two}
        # Affinity off: the answer's backend must be remembered, not re-derived.
        gateway = gateway_for([one.url, two.url], upstream={"conversation_affinity": False})
        for i in range(8):
            made = httpx.post(
                gateway.url + "/v1/responses", json={"model": "stub", "input": f"task {i}"}
            ).json()["id"]
            maker = stubs[int(made.split("_")[1])]
            before = len(maker.state.requests)
            follow = httpx.post(
                gateway.url + "/v1/responses",
                json={"model": "stub", "input": "next", "previous_response_id": made},
            )
            assert follow.status_code == 200
            assert len(maker.state.requests) == before + 1  # the turn went to its maker
            for path in (f"/v1/responses/{made}", f"/v1/responses/{made}/cancel"):
                method = "GET" if path.endswith(made) else "POST"
                assert httpx.request(method, gateway.url + path).status_code == 200
                assert maker.state.paths[-1] == path


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_a_proxied_body_that_breaks_off_reaches_the_client_broken(
    stub: StubBackend, gateway_for: GatewayFactory, framing: str
) -> None:
    """The backend dies mid-body on an unguarded path (/v1/embeddings): the client's
    HTTP library reports a broken body (no terminating chunk; fewer bytes than the
    Content-Length passed through), never a 200 with truncated JSON."""
    from support.stub_backend import HALF_EMBEDDING

    gateway = gateway_for(stub.url)
    scenario = "abort-mid-body" + ("-length" if framing == "length" else "")
    received = bytearray()

    def read_all() -> None:
        with httpx.stream(
            "POST", gateway.url + "/v1/embeddings", json={"model": "stub", "input": "hi"},
            headers={"x-stub-scenario": scenario}, timeout=10,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            if framing == "length":
                assert response.headers["content-length"] == str(len(HALF_EMBEDDING) * 2)
            for part in response.iter_raw():
                received.extend(part)

    with pytest.raises(httpx.RemoteProtocolError):
        read_all()
    assert received == HALF_EMBEDDING
