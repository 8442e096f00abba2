"""The API adapters as tables: what each reads from an answer and from a stream's
events, and how each writes the gateway's errors. The shapes are vLLM 0.32's
(seen from the tiny test server) and the APIs' own documented fields."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.apis import BY_NAME, CHAT, COMPLETIONS, MESSAGES, RESPONSES
from gateway.apis.base import Usage
from gateway.config import DetectorSettings, SaltReuseSettings
from gateway.detect import DegenerateKind, Detector, StreamInspector
from gateway.errors import DegenerateResponse, NoHealthyBackend, Unauthorized
from gateway.guard.conversations import conversation_key
from gateway.guard.request import parse_guarded
from gateway.wire.sse import SSEParser

DETECTOR = Detector(DetectorSettings())


def response_body(output: list[dict[str, Any]], status: str = "completed", **more: Any) -> dict:
    return {
        "id": "resp_1", "object": "response", "status": status, "output": output,
        "usage": {"input_tokens": 300, "input_tokens_details": {"cached_tokens": 256},
                  "output_tokens": 8},
        **more,
    }  # fmt: skip


def message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (response_body([message_item("Click the submit button.")]), None),
        (response_body([message_item("!" * 24)]), DegenerateKind.PUNCT_RUN),
        (response_body([message_item("")]), DegenerateKind.EMPTY),
        (response_body([]), DegenerateKind.EMPTY),
        (response_body([message_item("s" * 300)]), DegenerateKind.LETTER_RUN),
        (
            response_body([{"type": "function_call", "name": "click", "arguments": '{"x": 1}'}]),
            None,
        ),
        (
            response_body([{"type": "function_call", "name": "click", "arguments": '{"x": '}]),
            DegenerateKind.MALFORMED_TOOL_CALL,
        ),
        (
            response_body(
                [
                    {
                        "type": "reasoning",
                        "content": [{"type": "reasoning_text", "text": "?" * 40}],
                    },
                    message_item("ok"),
                ]
            ),
            DegenerateKind.PUNCT_RUN,
        ),
        (
            # Thinking cut short by max_output_tokens is a model thinking long.
            response_body(
                [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hmm"}]}],
                status="incomplete",
                incomplete_details={"reason": "max_output_tokens"},
            ),
            None,
        ),
    ],
)
def test_responses_answers_are_judged_on_their_output_items(
    body: dict[str, Any], expected: DegenerateKind | None
) -> None:
    assert RESPONSES.inspect_body(DETECTOR, body).kind == expected


def test_responses_reasoning_cut_by_length_is_empty_only_when_configured() -> None:
    detector = Detector(DetectorSettings(empty_with_reasoning_on_length=True))
    body = response_body(
        [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hmm"}]}],
        status="incomplete",
        incomplete_details={"reason": "max_output_tokens"},
    )
    output = dict(RESPONSES.outputs(body))[0]
    assert output.finish_reason == "length"
    assert output.reasoning == "Hmm"
    assert detector.choice_kind(output) == DegenerateKind.EMPTY
    assert DETECTOR.choice_kind(output) is None  # the default: a model thinking long


def anthropic_body(content: list[dict[str, Any]], stop: str = "end_turn") -> dict[str, Any]:
    return {
        "id": "msg_1", "type": "message", "role": "assistant", "content": content,
        "stop_reason": stop,
        "usage": {"input_tokens": 44, "output_tokens": 8, "cache_read_input_tokens": 256,
                  "cache_creation_input_tokens": 0},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (anthropic_body([{"type": "text", "text": "Done: the form is submitted."}]), None),
        (anthropic_body([{"type": "text", "text": "!" * 30}]), DegenerateKind.PUNCT_RUN),
        (anthropic_body([]), DegenerateKind.EMPTY),
        (anthropic_body([{"type": "text", "text": "  "}]), DegenerateKind.EMPTY),
        (
            anthropic_body(
                [{"type": "tool_use", "id": "t1", "name": "click", "input": {"x": 3}}], "tool_use"
            ),
            None,
        ),
        (
            anthropic_body(
                [
                    {"type": "thinking", "thinking": "<unk>" * 20, "signature": ""},
                    {"type": "text", "text": "ok"},
                ]
            ),
            DegenerateKind.SPECIAL_TOKENS,
        ),
    ],
)
def test_messages_answers_are_judged_on_their_content_blocks(
    body: dict[str, Any], expected: DegenerateKind | None
) -> None:
    assert MESSAGES.inspect_body(DETECTOR, body).kind == expected


def test_usage_is_read_in_each_apis_terms() -> None:
    chat = {"usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}
    assert CHAT.read_usage(chat) == Usage(300, 256)
    assert COMPLETIONS.read_usage({"usage": {"prompt_tokens": 3}}) == Usage(3, None)
    assert RESPONSES.read_usage(response_body([])) == Usage(300, 256)
    # Anthropic's input_tokens leaves the cached tokens out: the prompt is the sum.
    assert MESSAGES.read_usage(anthropic_body([])) == Usage(300, 256)
    no_details = {"usage": {"input_tokens": 44, "output_tokens": 1}}
    assert MESSAGES.read_usage(no_details) == Usage(44, None)


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
        for name, data in events
    )


def read_stream(api: Any, raw: bytes) -> tuple[Any, list[Any]]:
    inspector = StreamInspector(DETECTOR)
    reader = api.event_reader(inspector)
    signals = [reader.read(orjson.loads(e.data)) for e in SSEParser().feed(raw) if e.data]
    return reader, [inspector, signals]


def responses_stream(*deltas: str, status: str = "completed") -> bytes:
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_9", "status": "in_progress", "output": []}}  # fmt: skip
    events = [("response.created", created)]
    for number, piece in enumerate(deltas, start=1):
        events.append((
            "response.output_text.delta",
            {"type": "response.output_text.delta", "delta": piece, "output_index": 0,
             "content_index": 0, "sequence_number": number},
        ))  # fmt: skip
    done = response_body([message_item("".join(deltas))], status=status)
    events.append(
        ("response.completed",
         {"type": "response.completed", "sequence_number": len(deltas) + 1, "response": done})
    )  # fmt: skip
    return sse(*events)


def test_responses_stream_is_read_to_its_terminal_event() -> None:
    reader, (inspector, signals) = read_stream(RESPONSES, responses_stream("Click", " it", "."))
    assert reader.answer_id == "resp_9"
    assert [s.ends for s in signals] == [False, False, False, False, True]
    assert signals[-1].usage == Usage(300, 256)
    assert inspector.choices[0].output().content == "Click it."
    assert inspector.final_verdict().kind is None
    # The gateway's own error continues the sequence numbers, in the Responses shape.
    event = reader.error_event(NoHealthyBackend("no backend"))
    assert event.startswith(b"event: error\ndata: ")
    payload = orjson.loads(event.split(b"data: ", 1)[1])
    assert payload["type"] == "error"
    assert payload["sequence_number"] == 5
    assert payload["code"] == "no_healthy_backend"


def test_responses_stream_with_no_text_is_an_empty_answer() -> None:
    _, (inspector, _) = read_stream(RESPONSES, responses_stream())
    assert inspector.final_verdict().kind == DegenerateKind.EMPTY


def test_responses_stream_of_bangs_is_degenerate() -> None:
    _, (inspector, _) = read_stream(RESPONSES, responses_stream(*["!!!!"] * 8))
    assert inspector.final_verdict().kind == DegenerateKind.PUNCT_RUN


def messages_stream(*blocks: tuple[str, str], stop: str = "end_turn") -> bytes:
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "usage": {"input_tokens": 44, "output_tokens": 0}}}),
    ]  # fmt: skip
    for index, (kind, piece) in enumerate(blocks):
        start = {"type": "tool_use", "id": "t", "name": "f", "input": {}} if kind == "tool" else {
            "type": "thinking" if kind == "thinking" else "text"}  # fmt: skip
        delta = {
            "text": {"type": "text_delta", "text": piece},
            "thinking": {"type": "thinking_delta", "thinking": piece},
            "tool": {"type": "input_json_delta", "partial_json": piece},
        }[kind]
        events += [
            ("content_block_start",
             {"type": "content_block_start", "index": index, "content_block": start}),
            ("ping", {"type": "ping"}),
            ("content_block_delta",
             {"type": "content_block_delta", "index": index, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]  # fmt: skip
    events += [
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop},
                           "usage": {"input_tokens": 44, "output_tokens": 9,
                                     "cache_read_input_tokens": 256}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return sse(*events)


@pytest.mark.parametrize(
    ("blocks", "stop", "expected"),
    [
        ([("text", "The form is submitted.")], "end_turn", None),
        ([("text", "!" * 40)], "end_turn", DegenerateKind.PUNCT_RUN),
        ([], "end_turn", DegenerateKind.EMPTY),
        ([("thinking", "Let me think."), ("text", "Yes.")], "end_turn", None),
        ([("tool", '{"x": 1}')], "tool_use", None),
        ([("tool", '{"x": ')], "tool_use", DegenerateKind.MALFORMED_TOOL_CALL),
    ],
)
def test_messages_stream_is_judged_like_the_whole_answer(
    blocks: list[tuple[str, str]], stop: str, expected: DegenerateKind | None
) -> None:
    _, (inspector, signals) = read_stream(MESSAGES, messages_stream(*blocks, stop=stop))
    assert signals[-1].ends
    assert [s.usage for s in signals if s.usage] == [Usage(300, 256)]
    assert inspector.final_verdict().kind == expected


def test_errors_take_each_apis_shape() -> None:
    error = DegenerateResponse("degenerate on every attempt")
    assert orjson.loads(CHAT.error_body(error))["error"]["code"] == "degenerate_response"
    assert orjson.loads(RESPONSES.error_body(error))["error"]["type"] == "degenerate_response"
    assert orjson.loads(MESSAGES.error_body(error)) == {
        "type": "error",
        "error": {"type": "api_error", "message": "degenerate on every attempt"},
    }
    denied = orjson.loads(MESSAGES.error_body(Unauthorized("no key")))
    assert denied["error"]["type"] == "authentication_error"
    overloaded = orjson.loads(MESSAGES.error_body(NoHealthyBackend("none")))
    assert overloaded["error"]["type"] == "overloaded_error"
    reader = MESSAGES.event_reader(StreamInspector(DETECTOR))
    assert reader is not None
    assert reader.error_event(error) == (
        b"event: error\ndata: " + MESSAGES.error_body(error) + b"\n\n"
    )


def test_conversation_keys_read_each_apis_history() -> None:
    settings = SaltReuseSettings()
    turn = [
        {"role": "user", "content": "open the settings"},
        {"role": "assistant", "content": "ok"},
    ]
    later = [*turn, {"role": "user", "content": "next"}]  # the leading messages are the same
    for name in ("chat", "messages"):
        first = conversation_key(name, {"messages": turn}, None, settings)
        assert first is not None
        assert first == conversation_key(name, {"messages": later}, None, settings)
    # Anthropic's system prompt is part of the conversation.
    assert conversation_key("messages", {"messages": turn, "system": "A"}, None, settings) != (
        conversation_key("messages", {"messages": turn, "system": "B"}, None, settings)
    )
    assert conversation_key("responses", {"input": "hello"}, None, settings) is not None
    assert conversation_key("responses", {"input": turn}, None, settings) == conversation_key(
        "responses", {"input": later}, None, settings
    )
    assert conversation_key("responses", {}, None, settings) is None


def test_background_responses_are_marked_unguardable() -> None:
    assert parse_guarded("responses", b'{"input":"x","background":true}').unguardable == (
        "background"
    )
    assert parse_guarded("responses", b'{"input":"x"}').unguardable is None
    assert parse_guarded("messages", b'{"messages":[]}').unguardable is None
    # Only chat and completions are asked to add the usage chunk to a stream.
    for name, api in BY_NAME.items():
        assert api.openai_chunks == (name in ("chat", "completions"))


def test_responses_conversations_are_told_apart_by_their_text_not_their_screenshots() -> None:
    """Responses input items (``message`` items with ``input_text`` / ``input_image``
    parts) are fingerprinted on their text; a sliding screenshot does not change the
    key, whether the body is small or large enough to be scanned instead of decoded."""
    settings = SaltReuseSettings()

    def turn(text: str, shots: int) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"type": "input_text", "text": text}]
        parts += [{"type": "input_image", "image_url": "data:image/png;base64," + "A" * 300_000}
                  for _ in range(shots)]  # fmt: skip
        items = [{"type": "message", "role": "system", "content": "You operate a browser."},
                 {"type": "message", "role": "user", "content": parts}]  # fmt: skip
        return {"model": "m", "input": items}

    keys = {
        (text, shots): conversation_key(
            "responses", parse_guarded("responses", orjson.dumps(turn(text, shots))).body,
            None, settings,
        )
        for text in ("open the settings", "close the window")
        for shots in (0, 2)  # 2 screenshots: over 512 KiB, scanned, not decoded
    }  # fmt: skip
    assert keys["open the settings", 0] == keys["open the settings", 2]
    assert keys["close the window", 0] == keys["close the window", 2]
    assert keys["open the settings", 0] != keys["close the window", 0]
