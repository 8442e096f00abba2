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


def typed_event(name: str, payload: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesEvents:
    """One stream of vLLM's Responses events, numbered from 0."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, name: str, **fields: object) -> bytes:
        payload = {"type": name, "sequence_number": self.number, **fields}
        self.number += 1
        return typed_event(name, payload)

    def head(self) -> bytes:
        return self.event("response.created", response={"id": "resp_stub", "output": []})

    def text(self, word: str) -> bytes:
        return self.event("response.output_text.delta", delta=word, output_index=0)

    def tail(self) -> bytes:
        return self.event(
            "response.completed",
            response={"id": "resp_stub", "status": "completed",
                      "usage": {"input_tokens": 5, "output_tokens": 10}},
        )  # fmt: skip


class MessagesEvents:
    """One stream of vLLM's Messages events: one text block."""

    def head(self) -> bytes:
        message = {"id": "msg_stub", "type": "message", "role": "assistant", "content": [],
                   "model": "stub", "usage": {"input_tokens": 5, "output_tokens": 0}}  # fmt: skip
        return typed_event("message_start", {"type": "message_start", "message": message}) + (
            typed_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
        )  # fmt: skip

    def text(self, word: str) -> bytes:
        delta = {"type": "text_delta", "text": word}
        return typed_event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def tail(self) -> bytes:
        usage = {"input_tokens": 5, "output_tokens": 10}
        return (
            typed_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + typed_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": "end_turn"}, "usage": usage})
            + typed_event("message_stop", {"type": "message_stop"})
        )  # fmt: skip


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


#: What ``abort-mid-body`` sends before the backend dies: the head of an embedding.
HALF_EMBEDDING = b'{"object":"list","data":[{"object":"embedding","embedding":[0.12,0.5'


class BackendDied(Exception):
    """Ends a stub body mid-way: uvicorn closes the connection under it."""


def aborted_body(*, with_length: bool) -> Response:
    """A backend that dies mid-body (chunked, or short of its Content-Length)."""

    async def body() -> AsyncIterator[bytes]:
        yield HALF_EMBEDDING
        await asyncio.sleep(0.05)
        raise BackendDied

    headers = {"content-length": str(len(HALF_EMBEDDING) * 2)} if with_length else None
    return StreamingResponse(body(), media_type="application/json", headers=headers)


def stored_response_id(path: str) -> str | None:
    """The id in ``/v1/responses/{id}`` or ``/v1/responses/{id}/cancel``."""
    parts = path.split("/")
    addressed = len(parts) == 4 or (len(parts) == 5 and parts[4] == "cancel")
    return parts[3] if addressed and parts[1:3] == ["v1", "responses"] else None


def response_not_found(answer_id: str) -> Response:
    """vLLM's answer for a stored response it does not hold (its
    ``_make_not_found_error``, 0.32): for a follow-up, a GET and a cancel alike."""
    error = {"message": f"Response with id '{answer_id}' not found.",
             "type": "invalid_request_error", "param": "response_id", "code": 404}  # fmt: skip
    return JSONResponse({"error": error}, status_code=404)


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
        #: Ids of the Responses answers this stub made: it alone holds them (vLLM's
        #: store is in the memory of the server that made the answer).
        self.stored: set[str] = set()
        #: Paths of the requests for a stored answer this stub does not hold (404).
        self.not_found: list[str] = []
        #: Stored answers whose next read (GET) is answered 503 once: a blip (a pod
        #: restarting its server, an overloaded one) on the pod that holds them.
        self.unavailable_once: set[str] = set()


def build_app(state: StubState) -> Starlette:
    async def scenario_stream(scenario: str) -> AsyncIterator[bytes]:
        state.open_streams += 1
        try:
            yield chunk("", role=True)
            if scenario == "flood":  # 8 MB as fast as the stub can write it
                # Numbered phrases: 36 exact copies of one would be a loop by the
                # detector's own definition (and is now held and continued as one).
                text = "".join(f"lorem{j} ipsum dolor sit amet " for j in range(36))
                for i in range(8000):
                    yield chunk(f"{i:06d} " + text)
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
            if scenario in ("slow-stream", "slow-stream-10s"):  # 2 s or 10 s of ticks
                for _ in range(40 if scenario == "slow-stream" else 200):
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

    async def typed_stream(path: str, scenario: str) -> AsyncIterator[bytes]:
        """A Responses or Messages event stream (vLLM's shapes) of CLEAN_WORDS;
        ``sse-drop`` drops the connection after the words (after release)."""
        state.open_streams += 1
        try:
            events = ResponsesEvents() if path == "/v1/responses" else MessagesEvents()
            yield events.head()
            for word in CLEAN_WORDS:
                yield events.text(word)
                await asyncio.sleep(0.005)
            if scenario == "sse-drop":
                raise ConnectionResetError("stub drops the connection mid-stream")
            yield events.tail()
        finally:
            state.open_streams -= 1

    async def typed_api(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state.requests.append(body)
        scenario = request.headers.get("x-stub-scenario", "clean")
        previous = body.get("previous_response_id")
        if request.url.path == "/v1/responses" and previous and previous not in state.stored:
            return response_not_found(previous)
        if not body.get("stream") and request.url.path == "/v1/responses":
            # A whole answer with an id that names this stub (where it is stored).
            port = request.url.port
            host = (request.url.hostname or "").replace(".", "")  # several pods, one port
            answer_id = f"resp_{port}_{len(state.requests)}_{host}"
            state.stored.add(answer_id)
            answer = {"id": answer_id, "object": "response",
                      "status": "completed", "output": [{"type": "message", "content": [
                          {"type": "output_text", "text": "".join(CLEAN_WORDS)}]}],
                      "usage": {"input_tokens": 5, "output_tokens": 10}}  # fmt: skip
            return JSONResponse(answer)
        return StreamingResponse(
            typed_stream(request.url.path, scenario), media_type="text/event-stream"
        )

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
        stored = stored_response_id(request.url.path)
        if stored is not None and stored not in state.stored:
            state.not_found.append(request.url.path)
            return response_not_found(stored)
        if stored is not None and stored in state.unavailable_once:
            state.unavailable_once.discard(stored)
            return Response(b'{"error": "unavailable"}', status_code=503)
        state.paths.append(request.url.path)
        state.headers.append({":path": request.url.path, **request.headers})
        state.raw_headers.append(request.headers.items())
        scenario = request.headers.get("x-stub-scenario", "")
        if scenario.startswith("abort-mid-body"):
            return aborted_body(with_length=scenario.endswith("-length"))
        answer = JSONResponse({"path": request.url.path, "host": request.headers.get("host")})
        if scenario == "repeated-headers":
            add_repeated_headers(answer)
        return answer

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", typed_api, methods=["POST"]),
            Route("/v1/messages", typed_api, methods=["POST"]),
            Route("/health", health),
            Route("/{rest:path}", anything, methods=["GET", "POST", "PUT", "DELETE"]),
        ]
    )


class StubBackend(ThreadedServer):
    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.state = StubState()
        super().__init__(build_app(self.state), port, grace_s=1, host=host)
