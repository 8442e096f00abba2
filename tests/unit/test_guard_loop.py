"""The guard loop on its own: a ``Guard`` built from settings, a backend pool and
metrics, no web framework, against a scripted upstream in the test's own event loop
(aiohttp's test server: real HTTP framing on loopback, each response chosen by the
test). What vLLM would do is the test's script; the real vLLM runs in
``tests/integration``. Each test reads the answer the guard hands the server
(``WholeAnswer`` / ``StreamedAnswer``) and the metrics it counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from gateway.config import Settings
from gateway.errors import BackendUnreachable, DegenerateResponse
from gateway.guard.answer import Answer, StreamedAnswer, WholeAnswer
from gateway.guard.budget import RetryTicket
from gateway.guard.loop import Guard
from gateway.guard.request import parse_guarded
from gateway.observe.metrics import Metrics
from gateway.upstream.pool import BackendPool

CLEAN_TEXT = "Open the settings page, then click the blue Save button."
BANGS = "!" * 48


def whole(text: str) -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
    })  # fmt: skip


def chunk(content: str | None = None, finish: str | None = None, **more: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **more}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


def stream_of(*pieces: str) -> list[bytes]:
    usage = {"prompt_tokens": 9, "completion_tokens": len(pieces), "total_tokens": 9}
    return [
        *(chunk(piece) for piece in pieces),
        chunk(finish="stop"),
        b"data: " + orjson.dumps({"id": "chatcmpl-1", "choices": [], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]


@dataclass
class Script:
    """The upstream's answers, one per request, in order; what each request sent."""

    answers: list[Callable[[web.Request], Awaitable[web.StreamResponse]]] = field(
        default_factory=list
    )
    received: list[dict[str, Any]] = field(default_factory=list)
    #: The headers of each request, in the same order.
    headers: list[dict[str, str]] = field(default_factory=list)
    #: Set when a streamed answer's client (the gateway) went away mid-stream.
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)
    #: What GET /health answers: 200 while True, else 503 (a backend that died).
    healthy: bool = True

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        return await self.answers.pop(0)(request)


def answers_whole(text: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=whole(text), content_type="application/json")

    return answer


def answers_stream(
    events: list[bytes], gap_s: float = 0.0, script: Script | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for event in events:
                await response.write(event)
                await asyncio.sleep(gap_s)
        except (ConnectionResetError, asyncio.CancelledError):
            if script is not None:
                script.abandoned.set()
            raise
        return response

    return answer


@contextlib.asynccontextmanager
async def guard_with(
    script: Script,
    *,
    backends: int = 1,
    dead_first: bool = False,
    backend: dict[str, Any] | None = None,
    **guard: Any,
) -> AsyncIterator[Guard]:
    """A Guard in front of ``script``; ``backend``: settings every backend gets."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", script.handle)
    app.router.add_post("/v1/responses", script.handle)
    app.router.add_get("/health", script.health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    urls = [str(server.make_url("")).rstrip("/")] * backends
    if dead_first:  # a backend nothing listens on, first in line
        urls = ["http://127.0.0.1:9", *urls]
    settings = Settings.model_validate({
        "upstream": {"backends": [{"name": f"b{i}", "url": u, **(backend or {})}
                                  for i, u in enumerate(urls)],
                     "conversation_affinity": False},
        "guard": guard,
    })  # fmt: skip
    pool = BackendPool(settings.upstream)
    metrics = Metrics(CollectorRegistry(), models=["m"], backends=pool.names)
    try:
        yield Guard(settings, pool, metrics)
    finally:
        await pool.stop()
        await server.close()


def request(stream: bool = False, **more: Any) -> Any:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "go"}]}
    return parse_guarded("chat", orjson.dumps({**body, **more}))


async def handle(guard: Guard, stream: bool = False) -> Answer:
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "req-1"})
    return await guard.handle(request(stream), headers, started=0.0)


def header(answer: Answer, name: str) -> str:
    return dict(answer.headers)[name.encode()].decode()


async def relayed(answer: Answer) -> bytes:
    """What the client receives of a streamed answer (through ``send`` only)."""
    assert isinstance(answer, StreamedAnswer)
    sent: list[bytes] = []

    async def send(data: bytes) -> None:
        sent.append(data)

    try:
        last = await answer.relay(send, lambda data: False)
        await answer.after_complete()
    finally:
        answer.on_close()
    return b"".join(sent) + last


def metric(guard: Guard, name: str, **labels: str) -> float:
    total = 0.0
    for family in guard.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def content_of(stream: bytes) -> str:
    text = ""
    for line in stream.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def test_a_clean_answer_is_released_after_one_attempt() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            answer = await handle(guard)
            assert isinstance(answer, WholeAnswer)
            assert (answer.status, header(answer, "x-vllm-guard-verdict")) == (200, "clean")
            assert orjson.loads(answer.body)["choices"][0]["message"]["content"] == CLEAN_TEXT
            assert "cache_salt" not in script.received[0]
            assert guard.pool.backends[0].in_flight == 0

    asyncio.run(scenario())


def test_a_degenerate_answer_is_retried_with_a_salt_and_recovered() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            answer = await handle(guard)
            assert isinstance(answer, WholeAnswer)
            assert header(answer, "x-vllm-guard-verdict") == "recovered"
            assert header(answer, "x-vllm-guard-attempts") == "2"
            assert "cache_salt" not in script.received[0]
            assert script.received[1]["cache_salt"].startswith("vg.")
            assert metric(guard, "vllm_guard_degenerate_responses_total", kind="punct_run") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["deliver", "error"])
def test_exhausted_retries_follow_the_policy(policy: str) -> None:
    async def scenario() -> None:
        script = Script([answers_whole(BANGS)] * 3)
        async with guard_with(script, max_attempts=3, on_exhausted=policy) as guard:
            if policy == "error":
                with pytest.raises(DegenerateResponse):
                    await handle(guard)
                assert metric(guard, "vllm_guard_degenerate_refused_total") == 1
            else:
                answer = await handle(guard)
                assert isinstance(answer, WholeAnswer)
                assert header(answer, "x-vllm-guard-verdict") == "degenerate"
                assert metric(guard, "vllm_guard_degenerate_delivered_total") == 1
            assert len(script.received) == 3
            assert guard.pool.backends[0].in_flight == 0

    asyncio.run(scenario())


def test_a_retry_the_budget_refuses_is_not_sent() -> None:
    """A budget with no allowance, and retries known not to recover: the degenerate
    answer is delivered after one attempt and the refusal counted."""

    async def scenario() -> None:
        script = Script([answers_whole(BANGS)])
        budget = {"ratio": 0.0, "min_per_second": 0.0, "min_failed": 1.0}
        async with guard_with(script, budget=budget) as guard:
            # Teach it that retries on b0 do not recover: failures until it refuses.
            for _ in range(5):
                ticket = guard.budget.request_retry("b0", "teacher")
                if not isinstance(ticket, RetryTicket):
                    break
                guard.budget.settle(ticket, recovered=False)
            assert not guard.budget.recovering("b0")
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-verdict") == "degenerate"
            assert len(script.received) == 1
            assert metric(guard, "vllm_guard_retries_refused_total", reason="budget") == 1

    asyncio.run(scenario())


def test_an_unreachable_backend_fails_over_to_the_next() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script, dead_first=True) as guard:
            guard.pool.choose_first = lambda *a, **k: guard.pool.backends[0]  # type: ignore[method-assign]
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-attempts") == "2"
            assert len(script.received) == 1
            assert metric(guard, "vllm_guard_retries_total", reason="backend_error") == 1

    asyncio.run(scenario())


def test_with_no_backend_to_fail_over_to_the_error_is_the_clients() -> None:
    async def scenario() -> None:
        async with guard_with(Script(), dead_first=True) as guard:
            guard.pool.backends[1].healthy = False
            with pytest.raises(BackendUnreachable):
                await handle(guard)
            assert guard.pool.backends[0].in_flight == 0

    asyncio.run(scenario())


def test_a_healthy_stream_is_released_whole_to_the_client() -> None:
    async def scenario() -> None:
        words = [w + " " for w in CLEAN_TEXT.split()]
        script = Script([answers_stream(stream_of(*words))])
        async with guard_with(script) as guard:
            answer = await handle(guard, stream=True)
            assert isinstance(answer, StreamedAnswer)
            assert header(answer, "x-vllm-guard-verdict") == "clean"
            body = await relayed(answer)
            assert content_of(body) == "".join(words)
            assert body.endswith(b"data: [DONE]\n\n")

    asyncio.run(scenario())


def test_a_stream_degenerate_from_its_start_is_held_and_retried() -> None:
    """The client never sees the first attempt's ``!``: it is held back, judged and
    discarded; the retry's stream is the one released."""

    async def scenario() -> None:
        script = Script(
            [answers_stream(stream_of(*["!!!!"] * 12)), answers_stream(stream_of(CLEAN_TEXT))]
        )
        async with guard_with(script) as guard:
            answer = await handle(guard, stream=True)
            assert header(answer, "x-vllm-guard-verdict") == "recovered"
            body = await relayed(answer)
            assert content_of(body) == CLEAN_TEXT
            assert b"!!!!" not in body

    asyncio.run(scenario())


def test_a_stream_that_degenerates_after_release_is_cut_in_band() -> None:
    async def scenario() -> None:
        late = stream_of(CLEAN_TEXT, *["!!!!"] * 20)
        script = Script([answers_stream(late)])
        after_release = {"after_release": "cut", "release": "first_token"}
        async with guard_with(script, stream=after_release) as guard:
            answer = await handle(guard, stream=True)
            body = await relayed(answer)
            assert content_of(body).startswith(CLEAN_TEXT)
            assert b'"code":"degenerate_response"' in body
            assert metric(guard, "vllm_guard_stream_cut_total") == 1

    asyncio.run(scenario())


def test_a_client_that_leaves_mid_attempt_frees_the_backend() -> None:
    """The server cancels ``handle`` when the client leaves (``ClientWatch``): the
    upstream request is closed (the backend sees its client go) and the request's
    in-flight count is given back."""

    async def scenario() -> None:
        script = Script()
        # Whitespace only: nothing visible, so the stream stays held while it runs.
        slow = answers_stream([chunk(" ")] * 200, gap_s=0.02, script=script)
        script.answers.append(slow)
        async with guard_with(script) as guard:
            work = asyncio.ensure_future(handle(guard, stream=True))
            # Held back while it runs (4 s of whitespace): wait until the attempt is on.
            for _ in range(500):
                if guard.pool.backends[0].in_flight == 1 and script.received:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not work.done()
            assert guard.pool.backends[0].in_flight == 1
            work.cancel()
            with pytest.raises(asyncio.CancelledError):
                await work
            assert guard.pool.backends[0].in_flight == 0
            await asyncio.wait_for(script.abandoned.wait(), 5)

    asyncio.run(scenario())


# -- one owner of a request's life: every exit gives back what the request took --------


def answers_stream_held_open(events: list[bytes], open_s: float) -> Any:
    """A stream that sends every event, ``[DONE]`` included, then keeps its body open
    (the gateway's discard waits for the body's end, ``StreamState.finish_reading``)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(open_s)
        return response

    return answer


#: Retries then reserve part of the allowance until their outcome is in (``reserved``).
RESERVING_BUDGET = {"min_per_second": 0.0, "ratio": 10.0, "client_share": 1.0}


def retries_not_recovering(guard: Guard) -> None:
    """Recent retries on b0 failed: the next is granted against the allowance."""
    guard.budget.record_request()
    for _ in range(5):  # past min_failed (3) for the next seconds, decaying over 10 s
        ticket = guard.budget.request_retry("b0", "")
        assert isinstance(ticket, RetryTicket)
        guard.budget.settle(ticket, recovered=False)


def assert_nothing_held(guard: Guard) -> None:
    assert [b.in_flight for b in guard.pool.backends] == [0] * len(guard.pool.backends)
    assert guard.budget.reserved == 0


def test_a_retry_with_no_other_healthy_backend_goes_back_and_gives_everything_back() -> None:
    """The backend that answered degenerate was taken out of rotation meanwhile (a
    health round) and no other is healthy: the retry goes back to it (it has just
    answered) instead of leaving the loop with NoHealthyBackend, the in-flight count
    and the budget's reservation held."""

    async def scenario() -> None:
        script = Script()

        async def degenerate_then_down(request: web.Request) -> web.StreamResponse:
            guard.pool.backends[0].healthy = False  # a health round, during the attempt
            return await answers_whole(BANGS)(request)

        script.answers += [degenerate_then_down, answers_whole(CLEAN_TEXT)]
        async with guard_with(script, budget=RESERVING_BUDGET) as guard:
            retries_not_recovering(guard)
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-verdict") == "recovered"
            assert len(script.received) == 2
            assert_nothing_held(guard)
            assert metric(guard, "vllm_guard_requests_total", verdict="recovered") == 1

    asyncio.run(scenario())


def test_no_healthy_backend_for_a_failover_is_counted_and_gives_everything_back() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script, backends=0, dead_first=True) as guard:
            with pytest.raises(BackendUnreachable):
                await handle(guard)
            assert_nothing_held(guard)
            assert metric(guard, "vllm_guard_requests_total", verdict="error") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("exhausted", [False, True])
def test_a_client_leaving_while_a_degenerate_stream_is_discarded_gives_everything_back(
    exhausted: bool,
) -> None:
    """The degenerate attempt's stream ended with ``[DONE]`` but its body stays open: the
    discard waits for the body's end (up to 1 s) and the client leaves meanwhile, while
    a retry is granted (its budget reservation taken) or, retries exhausted, before the
    policy "error" answers. The cancellation escapes the discard; the in-flight count,
    the reservation and the upstream connection are given back all the same."""

    async def scenario() -> None:
        script = Script()
        script.answers += [
            answers_stream_held_open(stream_of(BANGS), 5.0),
            answers_stream(stream_of(CLEAN_TEXT)),
        ]
        guard_settings: dict[str, Any] = {"budget": RESERVING_BUDGET}
        if exhausted:
            guard_settings |= {"max_attempts": 1, "on_exhausted": "error"}
        async with guard_with(script, **guard_settings) as guard:
            retries_not_recovering(guard)
            work = asyncio.ensure_future(handle(guard, stream=True))
            for _ in range(300):
                if metric(guard, "vllm_guard_degenerate_responses_total") >= 1:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # inside the discard's wait (up to 1 s)
            assert not work.done()
            assert guard.budget.reserved == (0 if exhausted else 1)
            work.cancel()
            with pytest.raises(asyncio.CancelledError):
                await work
            assert_nothing_held(guard)
            assert len(script.received) == 1

    asyncio.run(scenario())


def test_in_flight_follows_the_backend_serving_each_attempt() -> None:
    """A failover's attempt is in flight on the backend that serves it, not on the
    one the request was first routed to."""

    async def scenario() -> None:
        seen: list[list[int]] = []
        script = Script()

        async def clean_noting_in_flight(request: web.Request) -> web.StreamResponse:
            seen.append([b.in_flight for b in guard.pool.backends])
            return await answers_whole(CLEAN_TEXT)(request)

        script.answers.append(clean_noting_in_flight)
        async with guard_with(script, dead_first=True) as guard:
            guard.pool.choose_first = lambda *a, **k: guard.pool.backends[0]  # type: ignore[method-assign]
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-attempts") == "2"
            assert seen == [[0, 1]]  # b0 (dead, first routed) gave its count back
            assert_nothing_held(guard)

    asyncio.run(scenario())


@pytest.mark.parametrize("backend_survives", [True, False])
def test_an_attempt_that_reached_its_backend_is_sent_elsewhere_only_if_the_backend_died(
    backend_survives: bool,
) -> None:
    """The backend read the request and its stream broke off while held. If it still
    answers its health check (a load balancer's cut, a proxy's hiccup), it may have
    generated, or stored, the answer: not sent again, the client gets the error. If
    it does not (it crashed: vLLM's requests and stored answers died with it), the
    request fails over. A backend that could not be connected to is failed over from
    at once (``test_an_unreachable_backend_fails_over``)."""

    async def scenario() -> None:
        async def breaks_off(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(chunk(" "))
            script.healthy = backend_survives
            assert request.transport is not None
            request.transport.close()
            return response

        async def clean_on_the_other(request: web.Request) -> web.StreamResponse:
            script.healthy = True
            return await answers_stream(stream_of(CLEAN_TEXT))(request)

        script = Script([breaks_off, clean_on_the_other])
        async with guard_with(script, backends=2) as guard:
            guard.pool.choose_first = lambda *a, **k: guard.pool.backends[0]  # type: ignore[method-assign]
            if backend_survives:
                with pytest.raises(BackendUnreachable):
                    await handle(guard, stream=True)
                assert len(script.received) == 1
            else:
                answer = await handle(guard, stream=True)
                assert content_of(await relayed(answer)) == CLEAN_TEXT
                assert len(script.received) == 2
                assert not guard.pool.backends[0].healthy
            assert_nothing_held(guard)

    asyncio.run(scenario())


def test_observe_mode_never_cuts_a_stream() -> None:
    """``observe`` detects and counts, never changes an answer: a stream that
    degenerates after release is delivered whole even with ``after_release: cut``."""

    async def scenario() -> None:
        late = stream_of(CLEAN_TEXT, *["!!!!"] * 20)
        script = Script([answers_stream(late)])
        stream = {"after_release": "cut", "release": "first_token"}
        async with guard_with(script, mode="observe", stream=stream) as guard:
            answer = await handle(guard, stream=True)
            body = await relayed(answer)
            assert content_of(body) == CLEAN_TEXT + "!!!!" * 20
            assert b"degenerate_response" not in body
            assert metric(guard, "vllm_guard_stream_cut_total") == 0
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 1

    asyncio.run(scenario())


def test_the_last_attempt_gets_a_fresh_salt_with_two_attempts() -> None:
    """With ``max_attempts: 2`` the retry is the last attempt: a fresh random salt (a
    namespace nobody used cannot hold a corrupt state), not the conversation's
    ladder rung, which two processes with one key would both compute."""

    async def retry_salt() -> str:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        settings = {"max_attempts": 2, "salt_reuse": {"key": "one-key"}}
        async with guard_with(script, **settings) as guard:
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-verdict") == "recovered"
            salt: str = script.received[1]["cache_salt"]
            return salt

    first, second = asyncio.run(retry_salt()), asyncio.run(retry_salt())
    assert first.startswith("vg.")
    assert second.startswith("vg.")
    assert first != second  # the same ladder rung in both processes before the fix
