"""The bug's own mechanism, per token: a sampled token whose logits were NaN.

Argmax over all-NaN logits is token 0 (the ``!`` of the field reports), and its
logprob is NaN too: vLLM's raw logprobs are ``log_softmax`` of the logits, and the
``max(logprob, -9999.0)`` it reports keeps a NaN (a ``-inf`` becomes -9999.0). A
streamed event writes the NaN as ``null`` (pydantic's JSON); a whole body cannot be
written at all (HTTP 400 ``Out of range float values are not JSON compliant``). So a
sampled token's logprob that is ``null`` is a NaN logit, exactly: no content rule
is involved, and no healthy token has one. (A prompt token's logprob may be null:
vLLM has none for the first prompt token, which ``echo`` shows; such requests are
not judged this way.)

The shapes, per API (vLLM 0.32):

* chat: ``choice.logprobs = {"content": [{"token", "logprob", ...}, ...]}``;
* completions: ``choice.logprobs = {"tokens": [...], "token_logprobs": [...], ...}``;
* Responses: ``output_text`` parts and text deltas carry
  ``"logprobs": [{"token", "logprob", "top_logprobs"}, ...]``.
"""

from __future__ import annotations

#: vLLM's answer to a whole body that holds a NaN (its JSON encoder refuses it).
NAN_BODY_ERROR = b"Out of range float values are not JSON compliant"


def sampled_logprob_is_nan(logprobs: object) -> bool:
    """Some sampled token in ``logprobs`` (any API's shape) has a null logprob."""
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if isinstance(content, list):  # chat
            return _any_null_logprob(content)
        token_logprobs = logprobs.get("token_logprobs")
        if isinstance(token_logprobs, list):  # completions
            return None in token_logprobs
        return False
    if isinstance(logprobs, list):  # Responses
        return _any_null_logprob(logprobs)
    return False


def _any_null_logprob(tokens: list[object]) -> bool:
    return any(isinstance(token, dict) and token.get("logprob", 0) is None for token in tokens)
