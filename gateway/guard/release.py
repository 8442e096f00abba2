"""When a held-back stream is released: the guard's release policy.

A guarded stream is held back until the guard can decide: the inspector
(``gateway.detect.stream``) says whether what is held is degenerate already or
clearly healthy; this module decides what to do with that, per policy:

* ``adaptive``: released once every choice is clearly healthy
  (``release_decision``), held while it could still become one of the bug's
  signatures;
* ``first_token``: also released as soon as every choice's first visible character
  cannot start a signature (``first_token_release``);
* ``auto`` (the default): ``first_token`` where the guard can continue the answer
  after release (``gateway.guard.tail``) and it starts with content, else
  ``adaptive``;
* either way, at the hold-back's ceiling in visible characters, or when the held
  bytes are full (a flood of whitespace shows no characters), the inspector's
  verdict on what is held decides: the hold-back never outlasts its ceiling.
"""

from __future__ import annotations

from gateway.detect import CLEAN, StreamInspector, Verdict


def hold_decision(
    inspector: StreamInspector,
    min_release_chars: int,
    expected_choices: int,
    ceiling: int,
    *,
    full: bool = False,
    first_token: bool = False,
    content_only: bool = False,
) -> Verdict | None:
    """A degenerate verdict (reject), CLEAN (release) or None (keep holding)."""
    decision = inspector.release_decision(min_release_chars, expected_choices)
    if (
        decision is None
        and first_token
        and inspector.first_token_release(expected_choices, content_only=content_only)
    ):
        decision = CLEAN
    if decision is None and (inspector.visible_chars >= ceiling or full):
        decision = inspector.holdback_verdict()
    return decision
