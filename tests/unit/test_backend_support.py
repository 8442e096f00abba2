"""The probe's check of whether a target can take ``ask_logprobs`` (issue 40)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.tools.backend_support import _per_token_logprobs, support_row

SAMPLED = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]


@pytest.mark.parametrize(
    ("api", "payload", "expected"),
    [
        ("chat", {"choices": [{"logprobs": {"content": SAMPLED}}]}, True),
        ("chat", {"choices": [{"logprobs": None}]}, False),  # asked, not given
        ("chat", {"choices": [{"logprobs": {"content": []}}]}, False),
        ("completions", {"choices": [{"logprobs": {"token_logprobs": [-0.1, -0.2]}}]}, True),
        ("completions", {"choices": [{"text": "Hi"}]}, False),
        ("responses", {"output": [{"type": "message", "content": [
            {"type": "output_text", "text": "Hi", "logprobs": SAMPLED}]}]}, True),
        ("responses", {"output": [{"type": "message", "content": [
            {"type": "output_text", "text": "Hi"}]}]}, False),
        ("responses", {"output": []}, False),
    ],
)  # fmt: skip
def test_per_token_logprobs_are_read_in_each_apis_place(
    api: str, payload: dict[str, Any], expected: bool
) -> None:
    assert _per_token_logprobs(api, payload) is expected


def test_the_row_says_what_ask_logprobs_may_do() -> None:
    assert support_row({"chat": True, "completions": True, "responses": True}).endswith(
        "(ask_logprobs: true is supported)"
    )
    assert "marked yes only" in support_row({"chat": True, "responses": False})
    assert "n/a" in support_row({"chat": True, "responses": None})
    assert support_row({"chat": None}).endswith("(leave ask_logprobs off)")
