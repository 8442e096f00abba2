"""Prove vllm-guard-fix on one vLLM version's real prefix-cache coordinator.

Run with the Python of the vLLM test environment and, for another version, that
version's unpacked source first on ``PYTHONPATH`` (``fix_versions.sh``): the
coordinator, managers and block pool are pure Python, so they import beside the
installed torch. Prints one JSON object.

For each speculative method (none, ``mtp``, ``eagle``) and each case, the real
``HybridKVCacheCoordinator`` is built over a full-attention group, an align-mode
Mamba group and the drafter's full-attention layer, its groups annotated by this
version's own annotation code; a real ``BlockPool`` is filled with the case's
cached blocks and Mamba states; and ``find_longest_cache_hit`` runs three ways:

* ``stock``: vLLM as released;
* ``plugin``: after ``vllm_guard_fix.apply``;
* ``reference``: upstream #48375's text (``max_num_blocks -= 1`` when
  ``drop_eagle_block`` and ``max_num_blocks > 0``) compiled into this version's
  finder, with the Mamba groups annotated as drafter-flagged groups in the
  config, the way vLLM 0.28 flags them for MTP (no code of the plugin involved).
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import torch
import vllm.v1.core.single_type_kv_cache_manager as managers
from vllm.v1.core import kv_cache_coordinator as coordinators
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

HASH_UNIT = 16
NUM_BLOCKS = 256

# name -> (mamba block size, prompt tokens, full-attention cached tokens,
#          Mamba state positions, partial hash hits allowed)
CASES: dict[str, tuple[int, int, int, tuple[int, ...], bool]] = {
    "contiguous": (16, 100, 96, (16, 32, 48, 64, 80, 96), False),
    "sparse": (16, 100, 96, (32, 64), False),
    "ceiling_not_block_multiple": (16, 90, 80, (16, 32, 48, 64, 80), False),
    "block_ne_hash_unit": (64, 200, 192, (64, 128, 192), False),
    "hash_unit_loop_sparse": (64, 200, 192, (176,), True),
    "hash_unit_loop_contiguous": (64, 200, 192, tuple(range(16, 193, 16)), True),
    "nothing_cached_for_mamba": (16, 100, 96, (), False),
}


def _make(cls: type, **values: Any) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def _specs(mamba_block: int, method: str) -> dict[str, Any]:
    attention = {"block_size": HASH_UNIT, "num_kv_heads": 1, "head_size": 8,
                 "dtype": torch.float32}  # fmt: skip
    specs = {
        "model.layers.0.attn": _make(FullAttentionSpec, **attention),
        "model.layers.1.linear_attn": _make(
            MambaSpec,
            block_size=mamba_block,
            shapes=((1, 4),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=1 if method != "none" else 0,
        ),
    }
    if method != "none":  # the drafter's attention layer registers after the target's
        drafter = _make(FullAttentionSpec, **attention)
        if any(f.name == "is_draft" for f in fields(FullAttentionSpec)):
            object.__setattr__(drafter, "is_draft", True)
        specs["drafter.layers.0.attn"] = drafter
    return specs


def _annotate(method: str, specs: dict[str, Any], groups: list[Any]) -> str:
    """This version's own rule for which groups hold the drafter's layers."""
    if method == "none":
        return "no speculative decoding"
    speculative = SimpleNamespace(
        method=method, disable_eagle_block_drop=False,
        use_eagle=lambda: True, use_eagle_block_drop=lambda: True,
        needs_eagle_block_drop=lambda: True,
    )  # fmt: skip
    config = SimpleNamespace(
        speculative_config=speculative,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3_5")),
    )
    annotate = getattr(kv_cache_utils, "_annotate_eagle_groups", None)
    if annotate is not None:
        parameters = inspect.signature(annotate).parameters
        if "use_trailing_layer_fallback" in parameters:  # 0.31-0.32
            trailing = kv_cache_utils._uses_trailing_mtp_layers(config)
            annotate(config, specs, groups, use_trailing_layer_fallback=trailing)
            return "kv_cache_utils._annotate_eagle_groups (trailing-layer rule for MTP)"
        annotate(config, specs, groups)  # 0.29-0.30: DeepseekV4 fallback off
        return "kv_cache_utils._annotate_eagle_groups"
    annotate_v4 = getattr(kv_cache_utils, "_annotate_eagle_groups_deepseek_v4", None)
    if annotate_v4 is not None:  # 0.28
        annotate_v4(config, specs, groups)
        return "kv_cache_utils._annotate_eagle_groups_deepseek_v4"
    # 0.33-0.34: inline in kv_cache_planning.get_kv_cache_groups (is_draft specs);
    # the three lines, as released:
    draft_layer_names = {name for name, spec in specs.items() if spec.is_draft}
    for group in groups:
        group.is_eagle_group = not draft_layer_names.isdisjoint(group.layer_names)
    return "kv_cache_planning: groups holding is_draft layers"


def _config(specs: dict[str, Any], method: str, flag_mamba: bool) -> tuple[Any, str]:
    groups = [
        _make(KVCacheGroupSpec, layer_names=[name], kv_cache_spec=spec)
        for name, spec in specs.items()
    ]
    rule = _annotate(method, specs, groups)
    if flag_mamba and any(g.is_eagle_group for g in groups):
        # Where no group is annotated, vLLM's fallback flags them all already.
        for group in groups:
            if isinstance(group.kv_cache_spec, MambaSpec):
                group.is_eagle_group = True
    return _make(KVCacheConfig, num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                 kv_cache_groups=groups), rule  # fmt: skip


def _coordinator(config: Any, method: str, mamba_block: int, partial: bool) -> Any:
    values = {
        "kv_cache_config": config, "max_model_len": 4096, "max_in_flight_tokens": 4096,
        "use_eagle": method != "none", "enable_caching": True,
        "enable_kv_cache_events": False, "dcp_world_size": 1, "pcp_world_size": 1,
        "scheduler_block_size": max(HASH_UNIT, mamba_block), "hash_block_size": HASH_UNIT,
        "allow_partial_hash_hits": partial,
    }  # fmt: skip
    parameters = inspect.signature(coordinators.get_kv_cache_coordinator).parameters
    coordinator = coordinators.get_kv_cache_coordinator(
        **{k: v for k, v in values.items() if k in parameters}
    )
    assert isinstance(coordinator, coordinators.HybridKVCacheCoordinator)
    if "allow_partial_hash_hits" not in parameters and not partial:
        coordinator.enable_partial_hash_hits = False  # 0.28-0.31 decide it alone
        for manager in coordinator.single_type_managers:
            manager.cache_hit_alignment_tokens = coordinator._cache_hit_alignment_tokens
    return coordinator


def _fill(coordinator: Any, hashes: list[bytes], attention_tokens: int,
          states: tuple[int, ...]) -> None:  # fmt: skip
    pool = coordinator.block_pool
    alignment = coordinator._cache_hit_alignment_tokens
    next_block = iter(pool.blocks[1:])
    for group_id, group in enumerate(coordinator.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        manager_cls = type(coordinator.single_type_managers[group_id])
        view = resolve_block_hashes(
            hashes, pool.hash_block_size, spec.block_size,
            supports_fine_grained_hash_lookup=manager_cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment,
        )  # fmt: skip
        fine = alignment < spec.block_size and spec.block_size % alignment == 0
        unit = alignment if (fine and isinstance(spec, MambaSpec)) else spec.block_size
        if isinstance(spec, MambaSpec):
            positions = states
        else:
            positions = tuple(range(unit, attention_tokens + 1, unit))
        for tokens in positions:
            key = kv_cache_utils.make_block_hash_with_group_id(view[tokens // unit - 1], group_id)
            pool.cached_block_hash_to_block.insert(key, next(next_block))


def _hit(method: str, case: str, flag_mamba: bool = False) -> dict[str, Any]:
    mamba_block, prompt, attention_tokens, states, partial = CASES[case]
    specs = _specs(mamba_block, method)
    config, rule = _config(specs, method, flag_mamba)
    coordinator = _coordinator(config, method, mamba_block, partial)
    hashes = [f"block-{i}".encode() for i in range(prompt // HASH_UNIT)]
    _fill(coordinator, hashes, attention_tokens, states)
    _, hit, *_ = coordinator.find_longest_cache_hit(hashes, prompt - 1)
    # The per-group lookup (KV-connector / disaggregated-prefill path) reads the same
    # per-spec bit: each group on its own, the Mamba group is group 1.
    _, per_group = coordinator.find_longest_cache_hit_per_group(hashes, prompt - 1)
    mamba_drop = any(
        g.use_eagle for g in coordinator.attention_groups if isinstance(g.spec, MambaSpec)
    )
    return {"hit": int(hit), "mamba_per_group_hit": int(per_group[1]),
            "mamba_asked_to_drop": mamba_drop, "annotation": rule,
            "partial_hash_hits": bool(coordinator.enable_partial_hash_hits)}  # fmt: skip


def _reference_finder() -> Any:
    """Upstream #48375's change, compiled into this version's own finder."""
    stock = inspect.getattr_static(managers.MambaManager, "find_longest_cache_hit")
    source = textwrap.dedent(inspect.getsource(stock.__func__))
    anchor = "    max_num_blocks = max_length // block_size\n"
    assert source.count(anchor) == 1, "finder changed: the reference needs a new anchor"
    patched = source.replace(
        anchor,
        anchor + "    if drop_eagle_block and max_num_blocks > 0:\n        max_num_blocks -= 1\n",
    )
    namespace = dict(vars(managers))
    exec(compile(patched, "<upstream #48375>", "exec"), namespace)
    return classmethod(namespace["find_longest_cache_hit"])


def main() -> None:
    methods = ("none", "mtp", "eagle")
    stock = {m: {c: _hit(m, c) for c in CASES} for m in methods}

    original = inspect.getattr_static(managers.MambaManager, "find_longest_cache_hit")
    managers.MambaManager.find_longest_cache_hit = _reference_finder()
    reference = {m: {c: _hit(m, c, flag_mamba=True) for c in CASES} for m in methods}
    managers.MambaManager.find_longest_cache_hit = original

    import vllm_guard_fix
    from vllm_guard_fix import evidence

    decision = vllm_guard_fix.apply(
        managers.MambaManager, coordinators.HybridKVCacheCoordinator, MambaSpec
    )
    plugin: dict[str, dict[str, Any]] = {}
    for m in methods:
        plugin[m] = {}
        for c in CASES:
            before = dict(evidence.LOOKUPS.lookups)
            result = _hit(m, c)
            result["counted"] = {
                f"{path}/{outcome}": n - before.get((path, outcome), 0)
                for (path, outcome), n in evidence.LOOKUPS.lookups.items()
                if n != before.get((path, outcome), 0)
            }
            plugin[m][c] = result
    second = vllm_guard_fix.apply(
        managers.MambaManager, coordinators.HybridKVCacheCoordinator, MambaSpec
    )
    print(json.dumps({
        "python_path": sys.path[:2],
        "vllm_file": inspect.getfile(managers),
        "decision": {"status": decision.status, "reason": decision.reason,
                     "coordinator": decision.coordinator},
        "second_apply": second.status,
        "stock": stock, "reference": reference, "plugin": plugin,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
