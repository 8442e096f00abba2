"""Salt validation (vLLM's rule) and derivation of retry salts.

A retry salt is always fresh random text that vLLM accepts. When the client sent
its own salt, the retry salt is derived from a digest of it, so two tenants never
share a salted cache chain, and the client's salt itself is never sent unchanged
on a retry (that would hit the same, possibly poisoned, chain).
"""

from __future__ import annotations

import hashlib
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
