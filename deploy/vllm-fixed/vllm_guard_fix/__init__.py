"""vLLM plugin: Mamba prefix-cache hits honour the speculative-decoding drop.

The defect, in vLLM 0.26 and every vLLM from 0.28 to 0.34 (table and evidence:
the project's docs/fixed-backend.md): ``MambaManager.find_longest_cache_hit`` accepts
``drop_eagle_block`` and never acts on it, and the hybrid coordinator gives Mamba
groups no look-ahead margin ("its finder never drops"). A Mamba hit therefore
lands on the last state below the full-attention candidate, the block a
speculative step may have written over rejected draft positions; answers that
reuse it degenerate into ``!!!!`` or come back empty.

What this plugin does is upstream PR #48375 ("Honor drop_eagle_block in
MambaManager"), verbatim in effect: when the drop is requested, the block-aligned
search loop starts one block lower (``max_num_blocks -= 1`` if it is positive).
That is also what PR #43650 did on vLLM 0.28, the version the field report
validated it on (accuracy unchanged, 0 malformed answers). The hash-unit loop
(fine-grained hits) is left as upstream leaves it.

The flag has to reach the finder for that to matter. On 0.28-0.30 (MTP) and
0.28-0.32 (EAGLE) no KV cache group is annotated as the drafter's, the
coordinator falls back to flagging every group, and Mamba is asked to drop. From
0.31 (MTP) and 0.33 (every method) only the drafter's groups are flagged, so
Mamba is never asked and a finder-only fix does nothing. The decision is made in
``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` (the per-spec
``use_eagle`` bit the lookup loop turns into ``drop_eagle_block``), so that is
where the plugin restores it: with speculative decoding on, Mamba groups request
the drop, as they did on 0.28. Managers' own ``use_eagle`` (what gets cached) is
not touched.

The plugin patches only code whose source it was proven on (``known.py``: the
exact functions of vLLM 0.26 and 0.28-0.34, each checked on vLLM's real coordinator by
``tests/support/fix_proof.py``). Anything else is refused: an ERROR line, and
with ``VLLM_GUARD_FIX_REQUIRE=1`` (the fixed image's default) vLLM does not
start. Evidence at run time: one log line per process, a periodic count of the
lookups it lowered, and ``vllm_guard_fix_*`` series on vLLM's ``/metrics``
(``evidence.py``).

* ``VLLM_GUARD_FIX_DISABLE=1``: do nothing (the server is stock and says so).
* ``VLLM_GUARD_FIX_REQUIRE=1``: refuse to start unless the fix is active.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

from vllm_guard_fix import evidence
from vllm_guard_fix.known import KNOWN_COORDINATORS, STOCK_FINDERS, fingerprint

__all__ = ["Decision", "apply", "decide", "register"]

_PATCHED_MARKER = "__vllm_guard_fix__"


@dataclass(frozen=True)
class Decision:
    status: str  # active | already_active | refused | disabled
    reason: str
    coordinator: str = ""  # which known vLLM's coordinator code this is

    @property
    def refused(self) -> bool:
        return self.status == "refused"


def _function(owner: Any, name: str) -> Any:
    member = inspect.getattr_static(owner, name, None)
    return getattr(member, "__func__", member)


def decide(mamba_manager: Any, coordinator: Any) -> Decision:
    """Whether the installed classes are code this plugin was proven on."""
    finder = _function(mamba_manager, "find_longest_cache_hit")
    split = _function(coordinator, "verify_and_split_kv_cache_groups")
    if getattr(finder, _PATCHED_MARKER, False) or getattr(split, _PATCHED_MARKER, False):
        return Decision("already_active", "already applied in this process")
    try:
        finder_print = fingerprint(finder)
        coordinator_print = tuple(
            fingerprint(_function(coordinator, name))
            for name in (
                "verify_and_split_kv_cache_groups",
                "find_longest_cache_hit",
                "find_longest_cache_hit_per_group",
            )
        )
    except (OSError, TypeError) as exc:
        return Decision("refused", f"cannot read vLLM's source ({exc})")
    if finder_print not in STOCK_FINDERS:
        return Decision(
            "refused",
            "MambaManager.find_longest_cache_hit is not the code this plugin was proven "
            "on (vLLM 0.26, 0.28-0.34); if this vLLM carries an upstream fix, run it stock "
            "with VLLM_GUARD_FIX_DISABLE=1",
        )
    known = KNOWN_COORDINATORS.get(coordinator_print)
    if known is None:
        return Decision(
            "refused",
            "HybridKVCacheCoordinator is not the code of any vLLM this plugin was "
            "proven on (0.26, 0.28-0.34), so it cannot tell whether Mamba lookups are asked "
            "to drop",
        )
    return Decision("active", "MambaManager ignores drop_eagle_block", coordinator=known)


def fixed_finder(original: Any) -> Any:
    """Upstream #48375 in effect: the block-aligned loop starts one block lower.

    Run as a wrapper so the body stays vLLM's own: lowering ``max_length`` to
    ``(max_length // block_size - 1) * block_size`` is exactly ``max_num_blocks
    -= 1`` (nothing else in that loop reads ``max_length``). When the stock search
    did not match the top block, the lowered search returns the same hit, so it is
    run only when the stock hit is the top block.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def find_longest_cache_hit(cls: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        result = original(*bound.args, **bound.kwargs)
        arguments = bound.arguments
        if not arguments.get("drop_eagle_block"):
            return result
        block_size = int(arguments["kv_cache_spec"].block_size)
        alignment = int(arguments["alignment_tokens"])
        if alignment < block_size and block_size % alignment == 0:
            evidence.LOOKUPS.record("hash_unit", 0)  # #48375 leaves this loop alone
            return result
        max_num_blocks = int(arguments["max_length"]) // block_size
        hit_length = int(result[1])
        if max_num_blocks <= 0 or hit_length < max_num_blocks * block_size:
            evidence.LOOKUPS.record("block", 0)
            return result
        arguments["max_length"] = (max_num_blocks - 1) * block_size
        lowered = original(*bound.args, **bound.kwargs)
        evidence.LOOKUPS.record("block", hit_length - int(lowered[1]))
        return lowered

    setattr(find_longest_cache_hit, _PATCHED_MARKER, True)
    return find_longest_cache_hit


def mamba_groups_request_the_drop(original: Any, mamba_spec: type) -> Any:
    """After vLLM splits the groups, Mamba groups ask for the drop when the
    coordinator runs speculative decoding with the EAGLE drop on."""

    @functools.wraps(original)
    def verify_and_split_kv_cache_groups(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if getattr(self, "eagle_group_ids", None):
            for index, group in enumerate(self.attention_groups):
                if isinstance(group.spec, mamba_spec) and not group.use_eagle:
                    self.attention_groups[index] = group._replace(use_eagle=True)
        return result

    setattr(verify_and_split_kv_cache_groups, _PATCHED_MARKER, True)
    return verify_and_split_kv_cache_groups


def apply(mamba_manager: Any, coordinator: Any, mamba_spec: type) -> Decision:
    decision = decide(mamba_manager, coordinator)
    if decision.status == "active":
        finder = _function(mamba_manager, "find_longest_cache_hit")
        mamba_manager.find_longest_cache_hit = classmethod(fixed_finder(finder))
        split = _function(coordinator, "verify_and_split_kv_cache_groups")
        coordinator.verify_and_split_kv_cache_groups = mamba_groups_request_the_drop(
            split, mamba_spec
        )
    return decision


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def register() -> None:
    """The ``vllm.general_plugins`` entry point (runs in every vLLM process)."""
    log = evidence.logger()
    version = evidence.vllm_version()
    if _flag("VLLM_GUARD_FIX_DISABLE"):
        decision = Decision("disabled", "disabled by VLLM_GUARD_FIX_DISABLE")
    else:
        try:
            from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager
            from vllm.v1.kv_cache_interface import MambaSpec
        except ImportError as exc:
            decision = Decision("refused", f"cannot import vLLM's cache manager ({exc})")
        else:
            decision = apply(MambaManager, HybridKVCacheCoordinator, MambaSpec)
    evidence.start(decision.status, version, decision.coordinator)
    if decision.status == "active":
        log.warning(
            "vllm-guard-fix: ACTIVE on vLLM %s (pid %d, coordinator code of vLLM %s): "
            "Mamba groups request the speculative-decoding drop and the Mamba lookup "
            "honours it (upstream #48375); lowered lookups are counted in "
            "vllm_guard_fix_mamba_lookups_total{outcome=\"lowered\"}",
            version, os.getpid(), decision.coordinator,
        )  # fmt: skip
    elif decision.refused:
        log.error("vllm-guard-fix: REFUSED on vLLM %s: %s", version, decision.reason)
    elif decision.status == "disabled":
        log.warning("vllm-guard-fix: NOT ACTIVE on vLLM %s: %s", version, decision.reason)
    if _flag("VLLM_GUARD_FIX_REQUIRE") and decision.status not in ("active", "already_active"):
        raise RuntimeError(
            f"vllm-guard-fix is required (VLLM_GUARD_FIX_REQUIRE=1) but not active on "
            f"vLLM {version}: {decision.reason}. Unset VLLM_GUARD_FIX_REQUIRE to serve "
            "this vLLM as stock."
        )
