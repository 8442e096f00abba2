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
import ipaddress
from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network

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


def client_identity(scope: Scope, *, by_key: bool, proxies: TrustedProxies) -> str:
    """Who is asking, for the retry budget's fair share: the API key's digest when
    the gateway checks keys (``by_key``: a verified identity), else the address (the
    one a trusted proxy names, ``TrustedProxies.client_address``)."""
    if by_key:
        return "key:" + (bearer_digest(scope) or "")[:32]
    return "addr:" + proxies.client_address(scope)


class TrustedProxies:
    """``server.trusted_proxies``: whose X-Forwarded-For is believed."""

    def __init__(self, networks: Sequence[IPv4Network | IPv6Network]) -> None:
        self.networks = tuple(networks)

    def trusts(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)

    def client_address(self, scope: Scope) -> str:
        """The peer's address; from a trusted proxy, the nearest address in its
        X-Forwarded-For that is not a trusted proxy itself (the right-most: a client
        can write what it likes to the left of what its proxies appended)."""
        client = scope.get("client")
        peer = str(client[0]) if client else "unknown"
        if not self.networks or not self.trusts(peer):
            return peer
        forwarded: list[str] = [
            hop.strip()
            for name, value in scope["headers"]
            if name == b"x-forwarded-for"
            for hop in value.decode("latin-1").split(",")
        ]
        for hop in reversed(forwarded):
            if hop and not self.trusts(hop):
                return hop[:64]
        return peer
