"""Client keys: who may call the gateway, and who is asking.

Keys are configured as SHA-256 digests (``auth.api_key_sha256``,
``metrics.api_key_sha256``). A request's key is the Bearer token of its
Authorization header, or its ``x-api-key`` header (Anthropic's SDKs send that); it
is hashed once per request and compared with every configured digest in constant
time. The same check guards the API, ``/metrics`` and the separate metrics port.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import Scope

from gateway.server.asgi import header_value

_KEY_DIGEST = "vllm_guard.key_digest"
#: Where a client's key travels. With client keys on, these are the gateway's, never
#: forwarded to a backend (``upstream.api_key`` is what vLLM sees).
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_digest(authorization: str | None, x_api_key: str | None) -> str | None:
    """SHA-256 of the client's key, or None without one."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return hash_key(key.strip())
    api_key = (x_api_key or "").strip()
    return hash_key(api_key) if api_key else None


def digest_allowed(digest: str | None, allowed: Sequence[str]) -> bool:
    """Whether the digest is one of ``allowed``, compared against every one of them
    in constant time (no early stop)."""
    if digest is None:
        return False
    return sum(hmac.compare_digest(digest, h) for h in allowed) > 0


def bearer_digest(scope: Scope) -> str | None:
    """The request's key digest, computed once per request: auth checks it, the
    retry budget keys clients by it."""
    if _KEY_DIGEST in scope:
        digest: str | None = scope[_KEY_DIGEST]
        return digest
    digest = key_digest(header_value(scope, b"authorization"), header_value(scope, b"x-api-key"))
    scope[_KEY_DIGEST] = digest
    return digest


def key_allowed(scope: Scope, allowed: Sequence[str]) -> bool:
    return digest_allowed(bearer_digest(scope), allowed)


def client_identity(scope: Scope, *, by_key: bool) -> str:
    """Who is asking, for the retry budget's fair share: the API key's digest when
    the gateway checks keys (``by_key``: a verified identity), else the address."""
    if by_key:
        return "key:" + (bearer_digest(scope) or "")[:32]
    client = scope.get("client")
    return "addr:" + (client[0] if client else "unknown")
