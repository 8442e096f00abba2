"""Continuing a released stream (issue 33): the unsettled end the rolling hold-back
keeps, the continuation request each API gets, the splice of its events into the
client's stream, and the guard loop doing it against a scripted backend.

The scripted backend stands in for what the real vLLM cannot do on demand here (a
continuation that degenerates again, a backend with no ``/tokenize``); the real
path is ``tests/integration/test_continuation_vllm.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from test_guard_loop import (
    CLEAN_TEXT,
    Script,
    answers_stream,
    chunk,
    content_of,
    guard_with,
    handle,
    metric,
    relayed,
    stream_of,
)

from gateway.apis import BY_NAME, ApiAdapter
from gateway.apis.base import ReleasedPart, RenderedPrompt, event_bytes
from gateway.apis.messages import MessagesSplice
from gateway.apis.openai_chunks import ChunkSplice
from gateway.apis.responses import ResponsesSplice
from gateway.config import DetectorSettings
from gateway.detect import Detector, StreamInspector
from gateway.detect.text import unsettled_start
from gateway.guard.continuation import Continuation, rendered_prompt_ids
from gateway.guard.loop import Guard
from gateway.guard.tail import MAX_TAIL_BYTES, TailHold

DETECTOR = Detector(DetectorSettings())
CANDIDATES = DETECTOR.candidates

# -- the unsettled end --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ("Open the settings page", ""),
        ("Open the settings page.", ""),  # "." is never a run's character
        ("Wow!", "!"),
        ("Wow! !  !", "! !  !"),  # whitespace between repeats is part of the run
        ("Wow \n!!", " \n!!"),  # and the whitespace before it
        ("Really?!", "!"),  # a run is one character: "?" is settled by "!"
        ("Save it,", ","),
        ("line one\n", "\n"),  # a template may strip it from the continued text
        ("tabs \t ", " \t "),
        ("!!!!", "!!!!"),
        ("text<unk>", "<unk>"),
        ("text <unk> <pad>", " <unk> <pad>"),
        ("text <|endof", " <|endof"),  # an artifact still arriving
        ("a [PA", " [PA"),
        ("bytes\ufffd", "\ufffd"),
        ("x < y and a > b", ""),
        ("<div>", ""),
        ("", ""),
        ("   ", "   "),
        ("日本語!", "!"),
    ],
)
def test_unsettled_end(text: str, held: str) -> None:
    assert text[unsettled_start(text, CANDIDATES) :] == held


# -- the rolling hold-back ----------------------------------------------------------


def fed(tail: TailHold, *pieces: str) -> list[bytes]:
    """Feed each piece as one event, as StreamState does; what the tail sends."""
    sent: list[bytes] = []
    for piece in pieces:
        event = chunk(piece)
        tail.inspector.feed(orjson.loads(event[6:]))
        sent.extend(tail.take([event]))
    return sent


def new_tail() -> TailHold:
    inspector = StreamInspector(DETECTOR)
    inspector.open_choice(0)
    return TailHold(CANDIDATES, inspector)


def test_the_tail_sends_settled_text_at_once_and_holds_an_unsettled_end() -> None:
    tail = new_tail()
    assert content_of(b"".join(fed(tail, "Open", " the"))) == "Open the"
    assert fed(tail, " door!") == []  # could start a run of "!"
    assert tail.holding
    assert content_of(b"".join(fed(tail, " Now"))) == " door! Now"  # settled
    assert not tail.holding
    assert tail.released_text == "Open the door! Now"
    assert tail.released_events == 4


def test_the_tail_drops_a_degenerate_end_and_keeps_what_was_sent() -> None:
    tail = new_tail()
    fed(tail, "Open", " the door", "\n")
    assert fed(tail, "!!!", "!!!") == []
    assert tail.released_text == "Open the door"  # the newline went with the run
    tail.drop()
    assert not tail.holding
    assert tail.released_events == 2


def test_the_tail_lets_go_of_a_stream_it_cannot_continue() -> None:
    tail = new_tail()
    fed(tail, "Wow!")
    reasoning = chunk(reasoning_content="hmm")  # a field a continuation cannot resume
    event = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}\n\n'
    tail.inspector.feed(orjson.loads(event[6:]))
    assert reasoning
    assert tail.take([event]) == [chunk("Wow!"), event]
    assert not tail.continuable
    assert fed(tail, "!!!") == [chunk("!!!")]  # passes as it comes


def test_the_tail_releases_a_flood_it_cannot_settle() -> None:
    tail = new_tail()
    assert content_of(b"".join(fed(tail, "ok"))) == "ok"
    piece = " " * 1000
    sent = fed(tail, *[piece] * (MAX_TAIL_BYTES // 1000 + 1))
    assert len(sent) > 50  # the held whitespace let go of at MAX_TAIL_BYTES


# -- the continuation request ---------------------------------------------------------

CHAT = BY_NAME["chat"]
COMPLETIONS = BY_NAME["completions"]


def continued(
    api: ApiAdapter,
    body: dict[str, Any],
    released: str,
    tokens: int,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any] | None:
    """What the request's continuation plan asks vLLM for (None: it has no plan, or
    the plan cannot continue it)."""
    plan = api.continuation_plan(body)
    return None if plan is None else plan.request_fields(released, tokens, prompt_ids)


def rendered_prompt(api: ApiAdapter, body: dict[str, Any]) -> RenderedPrompt | None:
    plan = api.continuation_plan(body)
    return None if plan is None else plan.prompt_check


USER = [{"role": "user", "content": "go"}]


@pytest.mark.parametrize(
    ("extra", "limits"),
    [
        ({}, {}),
        ({"max_tokens": 40}, {"max_tokens": 33}),
        ({"max_completion_tokens": 40, "min_tokens": 10}, {"max_completion_tokens": 33,
                                                           "min_tokens": 3}),
        ({"max_tokens": 5}, {"max_tokens": 1}),  # at least one: the held tokens were spent
        ({"min_tokens": 3}, {"min_tokens": 0}),
    ],
)  # fmt: skip
def test_a_chat_continuation_asks_for_the_rest_of_the_answer(
    extra: dict[str, Any], limits: dict[str, int]
) -> None:
    released = "café 日本語\n  x"
    fields = continued(CHAT, {"messages": USER, **extra}, released, 7)
    assert fields == {
        "messages": [*USER, {"role": "assistant", "content": released}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        **limits,
    }


def test_a_client_continuing_its_own_message_has_the_text_appended() -> None:
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    fields = continued(CHAT, body, " forty", 1)
    assert fields is not None
    assert fields["messages"][-1] == {"role": "assistant", "content": "The answer is forty"}


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "a+"}},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"echo": True},
        {"prompt_logprobs": 1},
        {"continue_final_message": True},  # with a last message that is not text
    ],
)
def test_a_request_whose_answer_a_continuation_would_change_is_not_continued(
    extra: dict[str, Any],
) -> None:
    messages = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    body = {"messages": messages if "continue_final_message" in extra else USER, **extra}
    assert continued(CHAT, body, "text", 1) is None
    if "continue_final_message" not in extra:
        assert CHAT.continuation_plan(body) is None
    assert continued(CHAT, {"messages": USER, "response_format": {"type": "text"}}, "a", 1)


def test_a_completions_continuation_is_the_prompt_and_the_text() -> None:
    assert continued(COMPLETIONS, {"prompt": "Once upon"}, " a time\n", 3) == {
        "prompt": "Once upon a time\n",
        "max_tokens": 13,  # vLLM's default of 16, less the 3 generated
    }
    assert continued(COMPLETIONS, {"prompt": ["a", "b"]}, "x", 1) is None
    assert continued(COMPLETIONS, {"prompt": "p", "suffix": "s"}, "x", 1) is None


# -- the splice -----------------------------------------------------------------------

OPENING = (
    b'data: {"id":"chatcmpl-orig","object":"chat.completion.chunk","created":111,'
    b'"model":"m","system_fingerprint":"fp-1","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-orig","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
)


def continuation_event(**fields: Any) -> bytes:
    body = {"id": "chatcmpl-new", "object": "chat.completion.chunk", "created": 222,
            "model": "m", **fields}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_the_splice_gives_the_continuation_the_answers_identity() -> None:
    splice = ChunkSplice.of(ReleasedPart(OPENING, OPENING, "Hi", tokens=6))
    assert splice is not None
    role = continuation_event(
        choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}]
    )  # fmt: skip
    assert splice.event(role) is None  # the client has its role chunk
    text = splice.event(continuation_event(choices=[{"index": 0, "delta": {"content": " 日本\n"}}]))
    assert text is not None
    out = orjson.loads(text[6:])
    assert (out["id"], out["created"], out["system_fingerprint"]) == ("chatcmpl-orig", 111, "fp-1")
    assert out["choices"][0]["delta"] == {"content": " 日本\n"}  # the text byte for byte
    usage = {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}
    spliced = splice.event(continuation_event(choices=[], usage=usage))
    assert spliced is not None
    assert orjson.loads(spliced[6:])["usage"] == {
        "prompt_tokens": 14, "completion_tokens": 36, "total_tokens": 50,
    }  # fmt: skip
    assert splice.event(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


# -- the guard loop -------------------------------------------------------------------

BANG_RUN = ["!!!!"] * 20


def paced(events: list[bytes]) -> Any:
    """A stream whose events arrive one by one, as vLLM paces its tokens (an answer
    that arrives whole is judged whole while it is held: no release to recover)."""
    return answers_stream(events, gap_s=0.005)


FIRST_TOKEN = {"release": "first_token"}


def assistant_text(sent: dict[str, Any]) -> str:
    message = sent["messages"][-1]
    assert message["role"] == "assistant"
    text: str = message["content"]
    return text


def test_a_stream_that_degenerates_after_release_is_continued() -> None:
    async def scenario() -> None:
        late = stream_of("Open", " the", " café", "\n", *BANG_RUN)
        script = Script([paced(late), answers_stream(stream_of(" 日本 settings."))])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            continuation = script.received[1]
            # Continued from exactly the text the client had (the held newline went
            # with the run), with a fresh salt, under the original's identity.
            assert assistant_text(continuation) == "Open the café"
            assert continuation["continue_final_message"] is True
            assert continuation["add_generation_prompt"] is False
            assert continuation["cache_salt"]
            assert "cache_salt" not in script.received[0]
            assert content_of(body) == "Open the café 日本 settings."
            assert body.count(b'"finish_reason":"stop"') == 1
            assert body.endswith(b"data: [DONE]\n\n")
            assert b"error" not in body
            assert metric(guard, "vllm_guard_continuations_total", outcome="clean") == 1
            assert metric(guard, "vllm_guard_requests_total", verdict="recovered") == 1
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 0
            assert guard.pool.backends[0].in_flight == 0

    asyncio.run(scenario())


def test_a_continuation_that_degenerates_is_continued_again() -> None:
    async def scenario() -> None:
        script = Script([
            paced(stream_of(CLEAN_TEXT, *BANG_RUN)),
            paced(stream_of(" More", *BANG_RUN)),
            answers_stream(stream_of(" Done.")),
        ])  # fmt: skip
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert assistant_text(script.received[2]) == CLEAN_TEXT + " More"
            assert content_of(body) == CLEAN_TEXT + " More Done."
            assert metric(guard, "vllm_guard_continuations_total", outcome="degenerate") == 1
            assert metric(guard, "vllm_guard_continuations_total", outcome="clean") == 1
            salts = {r["cache_salt"] for r in script.received[1:]}
            assert len(salts) == 2

    asyncio.run(scenario())


def test_a_stream_with_no_attempt_left_is_relayed_as_before() -> None:
    async def scenario() -> None:
        script = Script([paced(stream_of(CLEAN_TEXT, *BANG_RUN))])
        async with guard_with(script, stream=FIRST_TOKEN, max_attempts=1) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == CLEAN_TEXT + "".join(BANG_RUN)
            assert metric(guard, "vllm_guard_continuations_total", outcome="refused") == 1
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 1
            assert len(script.received) == 1

    asyncio.run(scenario())


def test_a_stream_that_ends_on_a_short_degenerate_run_is_continued() -> None:
    """A run that only the final verdict calls degenerate (a whole answer of a few
    ``!`` after text would not be; a trailing run of 16 is) is still held at the end."""

    async def scenario() -> None:
        script = Script([
            paced(stream_of("Hello", " " + "!" * 16)),
            answers_stream(stream_of(" world.")),
        ])  # fmt: skip
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == "Hello world."
            assert assistant_text(script.received[1]) == "Hello"

    asyncio.run(scenario())


# -- the default release: the first token, where a continuation can recover ----------


def answers_then_pauses(first: list[bytes], rest: list[bytes], go_on: asyncio.Event) -> Any:
    """A stream that sends ``first``, then waits for ``go_on`` before the rest."""

    async def answer(request: Any) -> Any:
        from aiohttp import web

        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in first:
            await response.write(event)
        await go_on.wait()
        for event in rest:
            await response.write(event)
        return response

    return answer


REASONING_FIRST = b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"Hm"}}]}\n\n'


@pytest.mark.parametrize(
    ("first", "released_at_once"),
    [
        ([chunk("Open")], True),  # content that cannot start a signature
        ([chunk("!")], False),  # could be the start of a run of "!"
        ([REASONING_FIRST], False),  # reasoning cannot be continued: held adaptively
    ],
)
def test_by_default_a_stream_is_released_at_its_first_token_where_it_can_be_continued(
    first: list[bytes], released_at_once: bool
) -> None:
    """With the defaults (release: auto, after_release: continue) the first token is
    released while the backend has sent nothing more, unless it could start a
    signature or the answer starts with reasoning. The backend is paused until the
    test lets it go on: no timing decides the outcome (a held stream cannot be
    released without more text; 0.3 s only bounds how long the test looks)."""

    async def scenario() -> None:
        go_on = asyncio.Event()
        rest = stream_of(" the settings page and click Save, then close it.")
        script = Script([answers_then_pauses(first, rest, go_on)])
        async with guard_with(script) as guard:
            handling = asyncio.ensure_future(handle(guard, stream=True))
            done, _ = await asyncio.wait({handling}, timeout=0.3 if not released_at_once else 5)
            assert bool(done) == released_at_once
            go_on.set()
            body = await relayed(await handling)
            assert content_of(body).endswith("close it.")

    asyncio.run(scenario())


# -- Responses ------------------------------------------------------------------------

RESPONSES = BY_NAME["responses"]


def responses_event(kind: str, **fields: Any) -> bytes:
    return event_bytes(kind, {"type": kind, **fields})


RESPONSES_OPENING = b"".join([
    responses_event("response.created", sequence_number=0,
                    response={"id": "resp_orig", "created_at": 111, "output": []}),
    responses_event("response.output_item.added", sequence_number=1, output_index=0,
                    item={"id": "msg_orig", "type": "message", "content": []}),
    responses_event("response.output_text.delta", sequence_number=2, item_id="msg_orig",
                    delta="Hi"),
])  # fmt: skip


def test_the_responses_splice_continues_the_clients_response() -> None:
    latest = responses_event("response.output_text.delta", sequence_number=5, delta=" there")
    released = ReleasedPart(RESPONSES_OPENING, latest, "Hi there", tokens=3)
    splice = ResponsesSplice.of(released)
    assert splice is not None

    def rewritten(kind: str, **fields: Any) -> dict[str, Any] | None:
        out = splice.event(responses_event(kind, sequence_number=0, **fields))
        return None if out is None else orjson.loads(out.split(b"data: ", 1)[1])

    assert rewritten("response.created", response={"id": "resp_new"}) is None
    assert rewritten("response.in_progress", response={"id": "resp_new"}) is None
    assert rewritten("response.output_item.added", item={"id": "msg_new"}) is None
    assert rewritten("response.content_part.added", item_id="msg_new") is None
    delta = rewritten("response.output_text.delta", item_id="msg_new", delta=" 日本")
    assert delta == {"type": "response.output_text.delta", "sequence_number": 6,
                     "item_id": "msg_orig", "delta": " 日本"}  # fmt: skip
    done = rewritten("response.output_text.done", item_id="msg_new", text=" 日本")
    assert done is not None
    assert (done["text"], done["sequence_number"]) == ("Hi there 日本", 7)
    part = rewritten("response.content_part.done", item_id="msg_new",
                     part={"type": "output_text", "text": " 日本"})  # fmt: skip
    assert part is not None
    assert part["part"]["text"] == "Hi there 日本"
    message = {"id": "msg_new", "type": "message",
               "content": [{"type": "output_text", "text": " 日本"}]}  # fmt: skip
    completed = rewritten("response.completed", response={
        "id": "resp_new", "created_at": 222, "output": [message],
        "usage": {"input_tokens": 20, "output_tokens": 10, "total_tokens": 30},
    })  # fmt: skip
    assert completed is not None
    response = completed["response"]
    assert (response["id"], response["created_at"]) == ("resp_orig", 111)
    assert response["output"][0]["id"] == "msg_orig"
    assert response["output"][0]["content"][0]["text"] == "Hi there 日本"
    assert response["usage"] == {"input_tokens": 17, "output_tokens": 13, "total_tokens": 30}
    assert completed["sequence_number"] == 9


def test_a_responses_answer_is_continued_only_when_vllm_does_not_store_it() -> None:
    """issue 41 item 4: by the client's store: false, or by the answer's own word."""
    body = {"input": "go", "store": False, "max_output_tokens": 30}
    fields = continued(RESPONSES, body, "Partial\n", 4)
    assert fields == {
        "input": [
            {"role": "user", "content": "go"},
            {"type": "message", "role": "assistant", "status": "in_progress",
             "content": [{"type": "output_text", "text": "Partial\n", "annotations": []}]},
        ],
        "store": False,
        "max_output_tokens": 26,
    }  # fmt: skip
    plan = RESPONSES.continuation_plan(body)
    assert plan is not None
    assert all(plan.holds_on(keeps) for keeps in (True, False, None))  # the client's word
    # The Agents SDK's default store: continued only on a backend known to keep
    # nothing (VLLM_ENABLE_RESPONSES_API_STORE unset); the continuation itself is
    # never stored (its id is never given out).
    for default_store in ({"input": "go"}, {"input": "go", "store": True}):
        plan = RESPONSES.continuation_plan(default_store)
        assert plan is not None
        assert plan.holds_on(False)
        assert not plan.holds_on(True)
        assert not plan.holds_on(None)
        fields = plan.request_fields("Partial", 1, None)
        assert fields is not None
        assert fields["store"] is False
    for refused in ({"text": {"format": {"type": "json_schema"}}},
                    {"tool_choice": "required"}, {"background": True}):  # fmt: skip
        assert RESPONSES.continuation_plan({**body, **refused}) is None


def test_a_continuation_split_inside_a_character_reaches_the_client_whole() -> None:
    """The continuation's bytes arrive cut inside a UTF-8 character and inside an
    event: the client still gets exactly the released text followed by the
    continuation's text, byte for byte."""

    async def scenario() -> None:
        continuation = b"".join(stream_of(" 日本語", " end."))
        cut = continuation.index(" 日本語".encode()) + 2  # inside "日"
        pieces = [continuation[:cut], continuation[cut:]]
        script = Script([paced(stream_of("Open", " café", *BANG_RUN)), paced(pieces)])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == "Open café 日本語 end."
            assert assistant_text(script.received[1]) == "Open café"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("unit", "times"),
    [
        (["the cat sat on the mat. "], 20),  # an n-gram loop, one event a sentence
        ([" the", " cat", " sat", " on", " the", " mat."], 20),  # token by token
        (["I", "'m", " sorry", ",", " I", " can", "'t", " help", " with", " that", "."], 20),
        ([" the"], 40),  # a token loop
        ([" Hello", "!"], 40),
    ],
)
def test_a_stream_that_loops_after_release_is_continued_from_its_first_copy(
    unit: list[str], times: int
) -> None:
    """The copies after the first are held as they come (they could become a loop);
    once the detector calls it a loop they are dropped and the answer continued from
    the end of the first copy, with a fresh salt (issue 39: before, the loop was
    relayed and counted)."""

    async def scenario() -> None:
        loop = unit * times
        script = Script([paced(stream_of("Story:", *loop, "\n")), paced(stream_of(" The end."))])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            released = assistant_text(script.received[1])
            # The client has the first copy (and at most the few characters of the
            # second that showed before it could be called a repeat), never a loop.
            assert released.startswith("Story:" + "".join(unit).rstrip()), released
            assert len(released) <= len("Story:") + len("".join(unit)) + 4, released
            assert content_of(body) == released + " The end."
            assert script.received[1]["cache_salt"]
            assert metric(guard, "vllm_guard_continuations_total", outcome="clean") == 1
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 0

    asyncio.run(scenario())


def test_legitimate_repetition_is_delayed_at_most_never_dropped() -> None:
    """Repetition that breaks off goes out whole with the token that breaks it."""

    async def scenario() -> None:
        pieces = ["No", ",", " no", ",", " no", ",", " no", "!", " Rows:", "\n| a | 1 |",
                  "\n| a | 1 |", "\n| a | 1 |", "\n| b | 2 |", " Done."]  # fmt: skip
        script = Script([paced(stream_of(*pieces))])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == "".join(pieces)
            assert len(script.received) == 1

    asyncio.run(scenario())


# -- Messages (continued by token ids) ------------------------------------------------

MESSAGES = BY_NAME["messages"]


@pytest.mark.parametrize(
    ("body", "rendered"),
    [
        ({"system": "Be terse.", "messages": [{"role": "user", "content": "hi"}]},
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]),
        ({"system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                     {"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": "go"}]},
         [{"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
          {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]),
        # What the gateway does not render as vLLM converts it: not continued.
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}, None),
        ({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
         None),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, None),
        ({"messages": [{"role": "system", "content": "inline"},
                       {"role": "user", "content": "hi"}]}, None),
    ],
)  # fmt: skip
def test_a_messages_conversation_is_rendered_as_vllm_converts_it(
    body: dict[str, Any], rendered: list[dict[str, Any]] | None
) -> None:
    prompt = rendered_prompt(MESSAGES, {"model": "m", **body})
    if rendered is None:
        assert prompt is None
        assert MESSAGES.continuation_plan(body) is None
        return
    assert prompt is not None
    assert prompt.tokenize == {"messages": rendered, "add_generation_prompt": True, "model": "m"}
    assert prompt.count_path == "/v1/messages/count_tokens"
    assert prompt.count_body["messages"] == body["messages"]


def test_a_messages_continuation_gives_vllm_the_prompt_as_token_ids() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "kv_transfer_params": {"other": 1}}  # fmt: skip
    assert continued(MESSAGES, body, "Hello", 5, None) is None  # no ids: not continued
    assert continued(MESSAGES, body, "Hello", 5, [1, 2, 3]) == {
        "kv_transfer_params": {"other": 1, "prompt_token_ids": [1, 2, 3]},
        "max_tokens": 35,
    }


def spliced_usage(splice: MessagesSplice, usage: dict[str, int]) -> Any:
    """The usage of a continuation's ``message_delta`` as the client gets it."""
    delta = event_bytes("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage,
    })  # fmt: skip
    out = splice.event(delta)
    assert out is not None
    return orjson.loads(out.split(b"data: ", 1)[1])["usage"]


def test_the_messages_splice_continues_the_clients_message() -> None:
    splice = MessagesSplice(ReleasedPart(b"", b"", "Hi there", tokens=3))
    assert splice is not None
    start = event_bytes("message_start", {"type": "message_start", "message": {"id": "new"}})
    block = event_bytes("content_block_start", {
        "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""},
    })  # fmt: skip
    text = event_bytes("content_block_delta", {
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": " 日本"},
    })  # fmt: skip
    stop = event_bytes("message_stop", {"type": "message_stop"})
    assert splice.event(start) is None  # the client has its message_start
    assert splice.event(block) is None  # and its text block, still open
    assert splice.event(text) == text
    assert splice.event(stop) == stop
    usage = {"input_tokens": 13, "output_tokens": 10, "cache_read_input_tokens": 7}
    rewritten = spliced_usage(splice, usage)
    # 20 prompt tokens (13 + 7 cached) less the 3 of the released text, 7 of them cached.
    assert rewritten == {"input_tokens": 10, "output_tokens": 13, "cache_read_input_tokens": 7}


def test_the_messages_splice_takes_the_released_tokens_from_the_prompts_end() -> None:
    """The continuation's prompt is the client's prompt and then the released text,
    whose tokens vLLM wrote to the cache when they filled a block: what the client
    is told is the prompt's own split, the released tokens taken from the uncached
    end first, then from the cache writes (a real vLLM gave input_tokens 0 and one
    cache write too many when only the uncached part was reduced)."""
    splice = MessagesSplice(ReleasedPart(b"", b"", "Hi there", tokens=4))
    usage = {"input_tokens": 3, "output_tokens": 10, "cache_creation_input_tokens": 640,
             "cache_read_input_tokens": 0}  # fmt: skip
    rewritten = spliced_usage(splice, usage)
    assert rewritten == {
        "input_tokens": 0, "output_tokens": 14,
        "cache_creation_input_tokens": 639, "cache_read_input_tokens": 0,
    }  # fmt: skip


@pytest.mark.parametrize(("counted", "continued"), [(3, True), (4, False), (None, False)])
def test_a_rendered_prompt_is_used_only_when_vllm_counts_it_the_same(
    counted: int | None, continued: bool
) -> None:
    """The gateway renders a Messages conversation for /tokenize the way vLLM converts
    it; vLLM's own count_tokens for the request must agree, else no continuation."""

    class Backend:
        async def tokenize(self, body: dict[str, Any], headers: Any) -> list[int]:
            return [5, 6, 7]

        async def ask_json(self, path: str, body: dict[str, Any], headers: Any) -> Any:
            return None if counted is None else {"input_tokens": counted}

    rendered = rendered_prompt(MESSAGES, {"messages": [{"role": "user", "content": "hi"}]})
    assert rendered is not None
    ids = asyncio.run(rendered_prompt_ids(Backend(), rendered, {}))  # type: ignore[arg-type]
    assert (ids == [5, 6, 7]) is continued


def breaks_after(events: list[bytes]) -> Any:
    """A stream that sends ``events`` one by one, then drops the connection."""

    async def answer(request: Any) -> Any:
        from aiohttp import web

        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0.005)
        assert request.transport is not None
        request.transport.close()
        return response

    return answer


def test_healthy_text_held_when_the_stream_breaks_reaches_the_client_before_the_error() -> None:
    """The held end is healthy until a detector says otherwise: a stream that breaks
    off while "Wow!" is held still gets it, then the in-band error."""

    async def scenario() -> None:
        script = Script([breaks_after([chunk("Open"), chunk(" the door. Wow!")])])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == "Open the door. Wow!"
            assert body.index(b"Wow!") < body.index(b'"error"')

    asyncio.run(scenario())


def test_a_continuation_the_backend_refuses_never_sends_the_degenerate_end() -> None:
    async def scenario() -> None:
        async def refuses(request: Any) -> Any:
            from aiohttp import web

            return web.Response(status=500, text="boom")

        script = Script([paced(stream_of(CLEAN_TEXT, *BANG_RUN)), refuses])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == CLEAN_TEXT
            assert b'"error"' in body
            assert metric(guard, "vllm_guard_continuations_total", outcome="error") == 1
            # Two attempts, each counted once: the degenerate one and the refused one.
            assert metric(guard, "vllm_guard_upstream_duration_seconds_count") == 2

    asyncio.run(scenario())


# -- issue 39: a first token that is safe by construction ----------------------------


def handle_body(guard: Guard, **more: Any) -> Any:
    """``handle`` for a chat stream with extra body fields."""
    from multidict import CIMultiDict

    from gateway.guard.request import parse_guarded

    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    request = parse_guarded("chat", orjson.dumps({**body, **more}))
    return guard.handle(request, CIMultiDict({"x-request-id": "req-1"}), started=0.0)


def test_a_read_that_ends_in_a_bang_run_is_never_released_whole() -> None:
    """Several events in one read, the last of them the start of a '!' run: the first
    release sends only what the tail has settled, so the run is never sent. Here the
    whole read ends unsettled, nothing is released, and the run becomes a whole retry
    (before: the read went out whole, '!' included, at the first token)."""

    async def scenario() -> None:
        go_on = asyncio.Event()
        burst = b"".join(stream_of("The", " capital", " of France is", " !!!!!!", "!!!!!!")[:5])
        script = Script([
            answers_then_pauses([burst], stream_of(*BANG_RUN), go_on),
            answers_stream(stream_of("Paris", " is the capital.")),
        ])  # fmt: skip
        async with guard_with(script) as guard:  # the defaults: release auto
            handling = asyncio.ensure_future(handle(guard, stream=True))
            done, _ = await asyncio.wait({handling}, timeout=0.3)
            assert not done  # held: the read ends unsettled
            go_on.set()
            body = await relayed(await handling)
            assert "!" not in content_of(body)
            assert content_of(body) == "Paris is the capital."
            assert script.received[1]["cache_salt"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "signature",
    ["<unk>", "<pad>", "[PAD]", "[UNK]", "<0x0A>", "<|endoftext|>", "\ufffd", "ss"],
)
def test_every_signature_family_is_held_whole_and_continued(signature: str) -> None:
    """Each special-token family and a run of one letter, after a healthy start, is
    held from its first character and the answer continued from the healthy text
    ('[PAD]' was held from its ']' only: '[PAD' reached the client)."""

    async def scenario() -> None:
        pieces = [" " + signature] * 20 if signature != "ss" else ["ss"] * 200
        script = Script([
            paced(stream_of("Open", " the", " settings", " page", *pieces)),
            answers_stream(stream_of(" and click Save.")),
        ])  # fmt: skip
        # A run of one letter is held from its third letter ("pages" is a word).
        healthy = "Open the settings page" + ("ss" if signature == "ss" else "")
        async with guard_with(script) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == healthy + " and click Save."
            assert assistant_text(script.received[1]) == healthy
            assert metric(guard, "vllm_guard_continuations_total", outcome="clean") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "more",
    [
        # A client continuing its own message whose content is parts: the
        # continuation could not append to it.
        {"continue_final_message": True, "add_generation_prompt": False,
         "messages": [{"role": "user", "content": "go"},
                      {"role": "assistant", "content": [{"type": "text", "text": "Open"}]}]},
        {"response_format": {"type": "json_object"}},  # structured output
        {"echo": True},
        # Over LARGE_BODY: only partly decoded, so fields that forbid a continuation
        # could hide in it: no plan.
        {"messages": [{"role": "user", "content": "x" * (600 * 1024)}]},
    ],
)  # fmt: skip
def test_a_request_with_no_continuation_plan_is_held_and_retried_not_released(
    more: dict[str, Any],
) -> None:
    """Released at the first token, then refused: these requests were released at
    once, and when they turned the continuation was refused and the corruption
    delivered. With no plan they are held as ``adaptive`` holds them, and the
    corruption is retried whole."""

    async def scenario() -> None:
        script = Script([
            paced(stream_of("Open", *BANG_RUN)),
            answers_stream(stream_of("Open the settings page and click Save.")),
        ])  # fmt: skip
        async with guard_with(script) as guard:
            body = await relayed(await handle_body(guard, **more))
            assert "!" not in content_of(body)
            assert len(script.received) == 2
            assert "continue_final_message" not in script.received[1] or more.get(
                "continue_final_message"
            )
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 0
            assert metric(guard, "vllm_guard_continuations_total") == 0

    asyncio.run(scenario())


def test_the_plan_is_what_the_continuation_accepts() -> None:
    """A request has a continuation plan (decided before release) exactly when its
    answer can be continued (asked after the corruption): the requests that were
    released early and then refused have none, and every plan gives a continuation."""
    bodies: list[tuple[str, dict[str, Any], bool]] = [
        ("completions", {"prompt": [1, 2, 3]}, False),
        ("completions", {"prompt": ["a", "b"]}, False),
        ("completions", {"prompt": "go"}, True),
        ("chat", {"messages": []}, False),
        ("chat", {"messages": USER}, True),
        ("chat", {"messages": [*USER, {"role": "assistant", "content": [{"type": "text"}]}],
                  "continue_final_message": True}, False),
        ("responses", {"store": False, "input": {"role": "user"}}, False),
        ("responses", {"store": False, "input": "go"}, True),
        ("messages", {"messages": USER, "kv_transfer_params": "x"}, False),
        ("messages", {"messages": USER}, True),
    ]  # fmt: skip
    for api, body, planned in bodies:
        plan = BY_NAME[api].continuation_plan(body)
        assert (plan is not None) is planned, (api, body)
        assert plan is None or plan.request_fields("Open", 1, [1, 2]) is not None


def test_a_continuation_teaches_the_salt_memory() -> None:
    """After a continuation recovered an answer, the conversation's next turn starts
    on the salt that recovered it, as after a whole retry (before: back into the
    poisoned cache)."""

    async def scenario() -> None:
        script = Script([
            paced(stream_of("Open", " the", *BANG_RUN)),
            answers_stream(stream_of(" settings page.")),
            answers_stream(stream_of("Next turn.")),
        ])  # fmt: skip
        async with guard_with(script) as guard:
            await relayed(await handle(guard, stream=True))
            await relayed(await handle(guard, stream=True))
            continued_salt = script.received[1]["cache_salt"]
            assert script.received[2].get("cache_salt") == continued_salt

    asyncio.run(scenario())


def test_with_holdback_zero_nothing_is_held_or_continued() -> None:
    """``holdback_chars: 0`` means inspect and count only, continuation included."""

    async def scenario() -> None:
        script = Script([paced(stream_of("Open", *BANG_RUN))])
        async with guard_with(script, stream={"holdback_chars": 0}) as guard:
            body = await relayed(await handle(guard, stream=True))
            assert content_of(body) == "Open" + "".join(BANG_RUN)
            assert len(script.received) == 1

    asyncio.run(scenario())


def responses_stream(pieces: list[str], *, response_id: str, first: int = 0) -> list[bytes]:
    """A Responses stream's opening events and a text delta per piece (no end)."""
    opening = [
        ("response.created", {"response": {"id": response_id, "created_at": 1, "output": []}}),
        ("response.output_item.added", {"output_index": 0, "item": {"id": "msg_" + response_id,
                                        "type": "message", "content": []}}),
    ]  # fmt: skip
    deltas = [("response.output_text.delta", {"item_id": "msg_" + response_id, "delta": piece})
              for piece in pieces]  # fmt: skip
    return [
        responses_event(kind, sequence_number=first + number, **fields)
        for number, (kind, fields) in enumerate([*opening, *deltas])
    ]


def test_an_error_after_a_responses_continuation_keeps_the_clients_numbering() -> None:
    """A continued Responses stream that breaks ends with the gateway's error event
    numbered on from the client's last event (it took the continuation's own
    backend numbering, which starts again at 0: the numbers went backwards)."""

    async def scenario() -> None:
        from multidict import CIMultiDict

        from gateway.guard.request import parse_guarded

        script = Script([
            paced(responses_stream(["Open", " the", " door", *BANG_RUN], response_id="a")),
            breaks_after(responses_stream([" now", " please"], response_id="b")),
        ])  # fmt: skip
        body = {"model": "m", "stream": True, "store": False, "input": "go"}
        request = parse_guarded("responses", orjson.dumps(body))
        async with guard_with(script) as guard:
            headers = CIMultiDict({"x-request-id": "req-1"})
            answer = await guard.handle(request, headers, started=0.0)
            sent = await relayed(answer)
            events = [
                orjson.loads(line[6:]) for line in sent.split(b"\n") if line.startswith(b"data: ")
            ]
            assert len(script.received) == 2  # continued
            numbers = [e["sequence_number"] for e in events]
            assert events[-1]["type"] == "error"
            assert numbers == list(range(len(events)))

    asyncio.run(scenario())


def responses_completed(pieces: list[str], *, response_id: str) -> list[bytes]:
    events = responses_stream(pieces, response_id=response_id)
    completed = {"id": response_id, "created_at": 1, "status": "completed", "output": [],
                 "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}  # fmt: skip
    return [*events, responses_event("response.completed", sequence_number=len(events),
                                     response=completed)]  # fmt: skip


@pytest.mark.parametrize("keeps", [False, True, None])
def test_a_default_store_responses_stream_is_continued_where_vllm_keeps_nothing(
    keeps: bool | None,
) -> None:
    """issue 41 item 4: the Agents SDK's default ``store`` (absent here). On a vLLM
    that keeps nothing (started without ``VLLM_ENABLE_RESPONSES_API_STORE``: it sets
    ``request.store = False``) the stream is released at its first token and its
    bang run continued. On one that keeps answers, or is not known to keep none:
    held adaptively and retried whole, never continued (the id the client has
    would name the degenerate original)."""

    async def scenario() -> None:
        from multidict import CIMultiDict

        from gateway.guard.request import parse_guarded

        first = responses_stream(["Open", " the", " door", *BANG_RUN], response_id="a")
        script = Script([
            paced(first), paced(responses_completed([" now", " please"], response_id="b")),
        ])  # fmt: skip
        request = parse_guarded("responses", orjson.dumps({"model": "m", "stream": True,
                                                           "input": "go"}))  # fmt: skip
        async with guard_with(script, backend={"keeps_responses": keeps}) as guard:
            headers = CIMultiDict({"x-request-id": "req-1"})
            sent = await relayed(await guard.handle(request, headers, started=0.0))
        assert b"!!!!" not in sent
        again = script.received[1]
        if keeps is not False:
            assert again["input"] == "go"  # a whole retry
        else:
            assert again["input"][-1]["status"] == "in_progress"  # continued from the text
            assert again["input"][-1]["content"][0]["text"] == "Open the door"
            assert again["store"] is False
            assert b'"delta":" now"' in sent
            assert b'"id":"a"' in sent
            assert b'"id":"b"' not in sent

    asyncio.run(scenario())


def test_a_failover_asks_its_own_backend_for_the_prompt_check() -> None:
    """Messages' prompt check asks the attempt's backend: after a failover from a pod
    whose check is still running or failed, the new pod is asked (the old check would
    hold the first release on a pod that may never answer); a check that succeeded
    holds for every pod of the model."""

    async def scenario() -> None:
        from multidict import CIMultiDict

        from gateway.guard.request import parse_guarded

        async with guard_with(Script([]), backends=2) as guard:
            first, second = guard.pool.backends
            request = parse_guarded("messages", orjson.dumps({"model": "m", "messages": USER}))
            plan = request.api.continuation_plan(request.body)
            assert plan is not None
            continuation = Continuation(plan, request, CIMultiDict(), guard.metrics)
            assert continuation.needs_prompt_check(first)
            running: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
            continuation.start_prompt_check(first, running)
            assert not continuation.needs_prompt_check(first)
            assert continuation.needs_prompt_check(second)  # still running on the first
            failed: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
            continuation.start_prompt_check(second, failed)
            assert running.cancelled()  # the replaced check is not left running
            failed.set_result(None)
            assert continuation.needs_prompt_check(first)  # failed on the second: ask again
            done: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
            continuation.start_prompt_check(first, done)
            done.set_result([1, 2, 3])
            assert not continuation.needs_prompt_check(second)  # the model's rendering holds

    asyncio.run(scenario())


# -- an echoed prompt ---------------------------------------------------------------


def echo_chat(n: int, messages: list[dict[str, Any]]) -> Any:
    from gateway.guard.request import parse_guarded

    body = {"model": "m", "stream": True, "n": n, "echo": True, "messages": messages}
    return parse_guarded("chat", orjson.dumps(body))


def choice_event(index: int, **delta: str) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": None}]}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_chat_echo_without_an_assistant_turn_is_not_taken_for_an_echo() -> None:
    """vLLM's chat echoes only a trailing assistant message with content: with a
    user's last message the first text is the answer, released at its first token as
    without ``echo`` (it was held, its first text taken for an echo)."""

    async def scenario() -> None:
        from multidict import CIMultiDict

        go_on = asyncio.Event()
        rest = stream_of(" the settings page and click Save.")
        script = Script([answers_then_pauses([chunk("Open")], rest, go_on)])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            request = echo_chat(1, USER)
            handling = asyncio.ensure_future(
                guard.handle(request, CIMultiDict({"x-request-id": "r"}), started=0.0)
            )
            done, _ = await asyncio.wait({handling}, timeout=0.5)
            go_on.set()
            await relayed(await handling)
            assert done, "held: the answer's first text was taken for an echo"

    asyncio.run(scenario())


@pytest.mark.parametrize("n", [1, 2])
def test_each_choices_echo_counts_for_nothing(n: int) -> None:
    """With ``n`` choices each echoes the prompt, in its own read: every echo counts
    for nothing (the second one counted as answer text and, with a prompt longer than
    the ceiling, released the stream before its '!' run)."""
    prompt = " ".join(f"word{i}" for i in range(200))  # 1,100 visible: over the ceiling
    messages = [*USER, {"role": "assistant", "content": prompt}]
    indexes = range(n)
    events = [
        *[choice_event(i, role="assistant", content="") for i in indexes],
        *[choice_event(i, content=prompt) for i in indexes],
        *[choice_event(i, content=" Sure") for i in indexes],
    ]
    bangs = [choice_event(0, content="!!!!") for _ in range(40)]
    done = b"data: [DONE]\n\n"

    async def scenario() -> None:
        from multidict import CIMultiDict

        script = Script([answers_stream([*events, *bangs, done], gap_s=0.01),
                         answers_stream([*events, done])])  # fmt: skip
        async with guard_with(script) as guard:
            answer = await guard.handle(
                echo_chat(n, messages), CIMultiDict({"x-request-id": "r"}), started=0.0
            )
            sent = await relayed(answer)
            assert b"!!!!" not in sent
            assert len(script.received) == 2  # retried whole
            assert metric(guard, "vllm_guard_degenerate_delivered_total") == 0

    asyncio.run(scenario())
