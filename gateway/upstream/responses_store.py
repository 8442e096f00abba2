"""Whether a vLLM keeps Responses answers under their ids, asked once per pod.

vLLM ignores a request's ``store`` unless it was started with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``OpenAIServingResponses``: ``request.store =
False``), and its answers do not say which: ``ResponsesResponse`` has no ``store``
field. So the gateway asks the way a client would find out: one answer of one token
with ``store: true``, then ``GET /v1/responses/{id}``. Found: the store is on; 404:
it is off. Anything else (an error, a timeout, another server) leaves it unknown,
and unknown is treated as "keeps" (streams held ``adaptive``ly, never continued).

The cost: one token of generation per pod, once per process; on a vLLM whose store
is on, one stored answer of a few hundred bytes (vLLM never frees its store).
"""

from __future__ import annotations

import secrets
import urllib.parse

import aiohttp
import orjson

from gateway.upstream.pool import Backend


async def keeps_responses(
    backend: Backend, model: str, timeout_s: float, auth: dict[str, str]
) -> bool | None:
    """True if ``backend`` keeps a stored Responses answer, False if it keeps none,
    None if that could not be told. ``auth``: vLLM's key, where it has one."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # A salt of its own: the probe neither reads a prefix-cache block (a poisoned
    # one would count in vLLM's NaN figure) nor leaves one anyone else reads.
    body = {"model": model, "input": ".", "max_output_tokens": 1, "store": True,
            "cache_salt": secrets.token_hex(8)}  # fmt: skip
    try:
        async with backend.fresh_session.post(
            backend.url + "/v1/responses", data=orjson.dumps(body), timeout=timeout,
            headers={"content-type": "application/json", **auth},
        ) as response:  # fmt: skip
            if response.status != 200:
                return None
            answer_id = orjson.loads(await response.read()).get("id")
        if not isinstance(answer_id, str) or not answer_id:
            return None
        path = "/v1/responses/" + urllib.parse.quote(answer_id, safe="")
        async with backend.fresh_session.get(
            backend.url + path, timeout=timeout, headers=auth
        ) as found:
            if found.status == 200:
                return True
            return False if found.status == 404 else None
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError, AttributeError):
        return None
