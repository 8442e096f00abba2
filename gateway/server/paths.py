"""Which paths reach what: the path as routing sees it, the paths refused whatever
the method (vLLM's administrative endpoints, unguarded ways into its generation
handlers), and a stored Responses answer's id in its path."""

from __future__ import annotations

import re
from collections.abc import Iterable

from gateway.errors import BadRequest, Forbidden, GatewayError

_REPEATED_SLASHES = re.compile(r"/{2,}")


#: vLLM's administrative and development endpoints (vLLM 0.32's routes, and older
#: spellings): they pause, reset, profile, reload or reconfigure the server, or
#: describe it. Closed unless listed in ``server.allow_vllm_paths``.
VLLM_ADMIN_PATHS = frozenset(
    {
        "/abort_requests", "/inference/v1/abort_requests", "/collective_rpc",
        "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
        "/release_kv_cache_memory", "/start_profile", "/stop_profile",
        "/scale_elastic_ep", "/is_scaling_elastic_ep", "/server_info", "/get_world_size",
        "/kv_event_sources", "/update_weights", "/update_weight_version",
        "/start_weight_update", "/start_draft_weight_update", "/finish_weight_update",
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
        "/weight_checker", "/weight_info", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)  # fmt: skip
#: Other ways into vLLM's chat and completions handlers: SageMaker's /invocations
#: dispatches on the body to the same code, and the batch route runs it per item.
#: The guard cannot inspect them, so they are refused unless allowed.
UNGUARDED_SPELLINGS = frozenset({"/invocations", "/v1/chat/completions/batch"})


#: ``/v1/responses/{id}`` and ``/v1/responses/{id}/cancel`` (and ``/input_items``):
#: a stored answer, which lives on the backend that made it.
_STORED_RESPONSE = re.compile(r"v1/responses/([^/]+)(?:/[a-z_]+)?")


def has_dot_segment(path: str) -> bool:
    """``.`` or ``..`` as a path segment (``path`` is already percent-decoded, so
    ``%2e%2e`` counts too). Such a path never reaches a backend: vLLM's router and
    any proxy in between may resolve it differently from the gateway."""
    return any(segment in (".", "..") for segment in path.split("/"))


def route_path(path: str) -> str:
    """The path as routing sees it: repeated slashes collapsed, no trailing slash, so
    ``//v1//chat/completions/`` cannot reach a guarded endpoint unguarded."""
    collapsed = _REPEATED_SLASHES.sub("/", path)
    return collapsed.rstrip("/") or "/"


def stored_answer_id(path: str) -> str | None:
    """The id in ``/v1/responses/{id}`` (and its ``/cancel``, ``/input_items``)."""
    match = _STORED_RESPONSE.fullmatch(route_path("/" + path.lstrip("/")).lstrip("/"))
    return match[1] if match else None


def closed_paths(allowed: Iterable[str]) -> dict[str, GatewayError]:
    """The paths refused whatever the method, each with the error to answer, minus
    those ``server.allow_vllm_paths`` lists."""
    allowed = set(allowed)
    return {
        **{
            path: Forbidden(
                f"{path} is one of vLLM's administrative endpoints; the gateway does not "
                "proxy it unless server.allow_vllm_paths lists it"
            )
            for path in VLLM_ADMIN_PATHS - allowed
        },
        **{
            path: BadRequest(
                f"{path} would reach vLLM's generation handlers without the guard; use "
                "/v1/chat/completions or /v1/completions (or list it in "
                "server.allow_vllm_paths to proxy it unguarded)"
            )
            for path in UNGUARDED_SPELLINGS - allowed
        },
    }
