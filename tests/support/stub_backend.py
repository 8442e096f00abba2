"""A scripted backend for what a real vLLM cannot produce on demand.

The scenario is chosen per request with the ``x-stub-scenario`` header (the
gateway forwards request headers). Everything else about the real behaviour is
tested against real vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support.servers import ThreadedServer


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, str] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    payload = {
        "id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": "stub",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }  # fmt: skip
    return b"data: " + orjson.dumps(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"
SCRAPED_PATHS = frozenset({"/metrics", "/version", "/v1/models"})
CLEAN_WORDS = ["The ", "button ", "is ", "at ", "the ", "top ", "right ", "of ", "the ", "page. "]


def add_repeated_headers(response: Response) -> None:
    """Two Set-Cookie, two Vary, and a header the backend marks hop-by-hop."""
    response.raw_headers += [
        (b"set-cookie", b"a=1; Path=/"),
        (b"set-cookie", b"b=2; Path=/"),
        (b"vary", b"Accept-Encoding"),
        (b"vary", b"Authorization"),
        (b"connection", b"x-backend-internal"),
        (b"x-backend-internal", b"do-not-forward"),
    ]


class StubState:
    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self.headers: list[dict[str, str]] = []
        #: Every request's header pairs as received, repeats included.
        self.raw_headers: list[list[tuple[str, str]]] = []
        self.paths: list[str] = []
        #: The client port of every completion request: one per connection used.
        self.client_ports: list[int] = []
        self.open_streams = 0
        #: When set, every completion request plays this scenario (the header aside).
        self.forced_scenario: str | None = None


def build_app(state: StubState) -> Starlette:
    async def scenario_stream(scenario: str) -> AsyncIterator[bytes]:
        state.open_streams += 1
        try:
            yield chunk("", role=True)
            if scenario == "flood":  # 8 MB as fast as the stub can write it
                for i in range(8000):
                    yield chunk(f"{i:06d} " + "lorem ipsum dolor sit amet " * 36)
            if scenario == "stall-early":  # silent after its first event, headers sent
                await asyncio.sleep(3600)
            if scenario == "sse-garbage":
                yield b"data: {this is not json\n\n"
                return
            if scenario == "big-event":  # one 64 KiB event, sent in 1 KiB pieces
                event = chunk("x" * 65536)
                for start in range(0, len(event), 1024):
                    yield event[start : start + 1024]
            for word in CLEAN_WORDS:
                yield chunk(word)
                await asyncio.sleep(0.005)
            if scenario == "stall-late":  # silent mid-answer, connection open
                await asyncio.sleep(3600)
            if scenario == "sse-drop":
                raise ConnectionResetError("stub drops the connection mid-stream")
            if scenario == "late-bang":
                for _ in range(30):
                    yield chunk("!")
            if scenario == "slow-stream":
                for _ in range(40):
                    yield chunk("tick ")
                    await asyncio.sleep(0.05)
            yield chunk(finish="stop")
            yield b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":10}}\n\n'
            yield DONE
            if scenario == "late-end":
                # The chunked body's terminator well after [DONE] (a buffering proxy
                # between gateway and vLLM can split them so).
                await asyncio.sleep(0.05)
        finally:
            state.open_streams -= 1

    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state.requests.append(body)
        state.headers.append({":path": request.url.path, **request.headers})
        state.raw_headers.append(request.headers.items())
        state.client_ports.append(request.client.port if request.client else 0)
        scenario = state.forced_scenario or request.headers.get("x-stub-scenario", "clean")
        if scenario == "503":
            return JSONResponse(
                {"error": {"message": "overloaded", "type": "ServiceUnavailable", "param": None,
                           "code": 503}},
                status_code=503,
            )  # fmt: skip
        if scenario == "hang":
            await asyncio.sleep(3600)
        if scenario == "not-json":
            return Response(b"<html>oops</html>", media_type="text/html")
        if scenario == "truncated-json":
            return Response(b'{"id": "cmpl-stub", "choices": [{"ind', media_type="application/json")
        if scenario == "empty-body":
            return Response(b"", media_type="application/json")
        if body.get("stream"):
            return StreamingResponse(scenario_stream(scenario), media_type="text/event-stream")
        if scenario == "bang":  # what a poisoned prefix-cache hit answers
            return JSONResponse(
                {"id": "cmpl-stub", "object": "chat.completion", "model": "stub",
                 "choices": [{"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant", "content": "!" * 16}}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}}
            )  # fmt: skip
        answer = JSONResponse(
            {
                "id": "cmpl-stub", "object": "chat.completion", "model": "stub",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "".join(CLEAN_WORDS)}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15},
            }
        )  # fmt: skip
        if scenario == "set-cookie":  # e.g. a sticky-session load balancer in front of vLLM
            answer.set_cookie("lb-session", "tenant-a-affinity")
        if scenario == "repeated-headers":
            add_repeated_headers(answer)
        return answer

    async def health(request: Request) -> Response:
        return Response(b"")

    async def anything(request: Request) -> Response:
        if request.url.path in SCRAPED_PATHS:  # the gateway's own backend scrape
            return Response(b"{}", media_type="application/json")
        state.paths.append(request.url.path)
        state.headers.append({":path": request.url.path, **request.headers})
        state.raw_headers.append(request.headers.items())
        answer = JSONResponse({"path": request.url.path, "host": request.headers.get("host")})
        if request.headers.get("x-stub-scenario") == "repeated-headers":
            add_repeated_headers(answer)
        return answer

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/{rest:path}", anything, methods=["GET", "POST", "PUT", "DELETE"]),
        ]
    )


class StubBackend(ThreadedServer):
    def __init__(self, port: int | None = None) -> None:
        self.state = StubState()
        super().__init__(build_app(self.state), port, grace_s=1)
