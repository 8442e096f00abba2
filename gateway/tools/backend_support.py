"""What a target supports of what the gateway can ask of it: the probe's last rows.

A backend's ``ask_logprobs`` (``nan_logits`` in docs/guard.md) asks vLLM for every
answer's sampled-token logprob, so that a NaN logit is seen on every request. Each
API answers that ask its own way, and a server may refuse it (vLLM refuses
Responses logprobs for gpt-oss models; another server may ignore the field). The
probe asks once per API, as the gateway would (salted apart from every cached
prefix: a poisoned block would answer with vLLM's 400 for a NaN, which says the
bug, not the support), and says whether per-token logprobs came back.
"""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
import orjson

#: Each API's ask, as the gateway makes it (``ApiAdapter.logprobs_ask``).
_ASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2,
        "logprobs": True, "top_logprobs": 0}),
    "completions": ("/v1/completions", {"prompt": "Say hello.", "max_tokens": 2, "logprobs": 0}),
    "responses": ("/v1/responses", {
        "input": "Say hello.", "max_output_tokens": 2, "store": False,
        "include": ["message.output_text.logprobs"], "top_logprobs": 0}),
}  # fmt: skip


def _per_token_logprobs(api: str, payload: dict[str, Any]) -> bool:
    """The answer carries a logprob per sampled token in the API's own place."""
    if api == "responses":
        parts = [
            part
            for item in payload.get("output") or ()
            if isinstance(item, dict)
            for part in item.get("content") or ()
            if isinstance(part, dict) and part.get("type") == "output_text"
        ]
        return bool(parts) and all(isinstance(p.get("logprobs"), list) for p in parts)
    choices = payload.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") if isinstance(choices[0], dict) else None
    if not isinstance(logprobs, dict):
        return False
    tokens = logprobs.get("content") if api == "chat" else logprobs.get("token_logprobs")
    return isinstance(tokens, list) and len(tokens) > 0


async def logprobs_support(
    session: aiohttp.ClientSession, target: str, model: str | None, headers: dict[str, str]
) -> dict[str, bool | None]:
    """Per API: True where the target answered the ask with per-token logprobs,
    False where it refused it (a 4xx) or answered without them, None where it could
    not be told (an error, a timeout, an API the target does not serve)."""
    found: dict[str, bool | None] = {}
    for api, (path, ask) in _ASKS.items():
        body = {**ask, "cache_salt": secrets.token_hex(8), **({"model": model} if model else {})}
        try:
            async with session.post(target + path, json=body, headers=headers) as response:
                if response.status == 404:
                    found[api] = None  # not served here
                elif 400 <= response.status < 500:
                    found[api] = False
                elif response.status == 200:
                    found[api] = _per_token_logprobs(api, orjson.loads(await response.read()))
                else:
                    found[api] = None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            found[api] = None
    return found


def support_row(found: dict[str, bool | None]) -> str:
    """One line for the probe's table, and what it means for ``ask_logprobs``."""
    said = {True: "yes", False: "no", None: "n/a"}
    apis = ", ".join(f"{api} {said[value]}" for api, value in found.items())
    served = [value for value in found.values() if value is not None]
    if served and all(served):
        verdict = "ask_logprobs: true is supported"
    elif any(served):
        verdict = "ask_logprobs works for the APIs marked yes only"
    else:
        verdict = "leave ask_logprobs off"
    return f"{apis} ({verdict})"
