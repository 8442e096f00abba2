"""Salt validation (vLLM's rule) and derivation of retry salts.

A conversation's retry salts form a ladder every worker and replica agrees on:
``salt_n = "vg." + HMAC-SHA256(key, conversation, client salt, n)``. A retry on any
process lands in the cache namespace another process already warmed for that
conversation; rotating after corruption recurs is ``n + 1``. The client's salt
is inside the MAC, so tenants never share a namespace, and the key keeps
outsiders from computing anyone's salts. The key comes from configuration (or
its environment variable); without one each process draws its own, and the
ladder is then per process (docs/state.md).

A request with no conversation to key on gets a fresh random salt, derived from
the client's salt when there is one. Either way the client's own salt is never
sent unchanged on a retry (that would hit the same, possibly poisoned, chain).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

MAX_SALT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\x00")

# vLLM's own messages (vllm/entrypoints/openai/protocol.py), so a client sees the
# same error whether or not the gateway is in front.
EMPTY_SALT_MESSAGE = "Parameter 'cache_salt' must be a non-empty string if provided."
INVALID_SALT_MESSAGE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\\\', or NUL."
)


def salt_problem(salt: object) -> str | None:
    """Return vLLM's error message for an unacceptable salt, or None when it is fine."""
    if not isinstance(salt, str) or not salt:
        return EMPTY_SALT_MESSAGE
    if len(salt) > MAX_SALT_CHARS or not _FORBIDDEN.isdisjoint(salt):
        return INVALID_SALT_MESSAGE
    return None


def fresh_salt(client_salt: str | None) -> str:
    """A new retry salt; derived from the client's salt when there is one."""
    nonce = secrets.token_hex(8)
    if client_salt is None:
        return f"vg.{nonce}"
    tenant = hashlib.sha256(client_salt.encode("utf-8")).hexdigest()[:32]
    return f"vg.{tenant}.{nonce}"


class SaltLadder:
    """``rung(conversation, client_salt, n)``: the n-th retry salt of a conversation."""

    def __init__(self, key: bytes | None) -> None:
        #: False when the key was drawn for this process (no shared ladder).
        self.shared = key is not None
        self._key = key if key is not None else secrets.token_bytes(32)

    def rung(self, conversation: str, client_salt: str | None, n: int) -> str:
        message = "\x00".join((conversation, client_salt or "", str(n))).encode("utf-8")
        return "vg." + hmac.new(self._key, message, hashlib.sha256).hexdigest()[:40]
