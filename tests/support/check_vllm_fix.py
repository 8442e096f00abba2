"""Run with the vLLM virtualenv's Python: exercise the plugin on vLLM's real
prefix-cache manager classes and print the results as JSON.

Builds a real ``BlockPool`` holding N cached blocks of a prompt and asks the real
``MambaManager`` and ``FullAttentionManager`` lookups for the longest hit, with
and without ``drop_eagle_block``, before and after the plugin is applied.
"""

from __future__ import annotations

import json
import sys

import torch
import vllm_guard_fix
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

BLOCK = 16
CACHED_BLOCKS = 6


def pool_with_cached_prompt() -> tuple[BlockPool, list[BlockHash]]:
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=BLOCK)
    hashes = [BlockHash(bytes([i]) * 32) for i in range(CACHED_BLOCKS + 2)]
    for i in range(CACHED_BLOCKS):  # the first 6 blocks of the prompt are cached
        block = pool.blocks[i + 1]
        key = make_block_hash_with_group_id(hashes[i], 0)
        block.set_block_hash(key, (i + 1) * BLOCK)
        pool.cached_block_hash_to_block.insert(key, block)
    return pool, hashes


def lookup(manager: type, spec: object, drop: bool) -> int:
    pool, hashes = pool_with_cached_prompt()
    _, hit = manager.find_longest_cache_hit(
        block_hashes=hashes, max_length=len(hashes) * BLOCK, kv_cache_group_ids=[0],
        block_pool=pool, kv_cache_spec=spec, drop_eagle_block=drop, alignment_tokens=BLOCK,
    )  # fmt: skip
    return int(hit)


def table() -> dict[str, int]:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return {
        "mamba_spec_on": lookup(MambaManager, mamba, True),
        "mamba_spec_off": lookup(MambaManager, mamba, False),
        "full_spec_on": lookup(FullAttentionManager, full, True),
        "full_spec_off": lookup(FullAttentionManager, full, False),
    }


class AlreadyFixedManager(MambaManager):
    """A vLLM where upstream merged the fix: the lookup reads drop_eagle_block."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
        kv_cache_spec, drop_eagle_block, alignment_tokens, **kw,
    ):  # fmt: skip
        if drop_eagle_block:
            max_length -= kv_cache_spec.block_size
        return super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
            False, alignment_tokens, **kw,
        )  # fmt: skip


class RenamedManager:
    @classmethod
    def find_longest_cache_hit(cls, hashes, limit):  # a refactored upstream
        return [], 0


def main() -> None:
    before = table()
    decision = vllm_guard_fix.apply(MambaManager)
    after = table()
    again = vllm_guard_fix.decide(MambaManager)
    fixed_upstream = vllm_guard_fix.decide(AlreadyFixedManager)
    renamed = vllm_guard_fix.decide(RenamedManager)
    json.dump(
        {
            "block_size": BLOCK, "cached_blocks": CACHED_BLOCKS,
            "before": before, "after": after,
            "applied": decision.apply, "reason": decision.reason,
            "second_apply": again.apply,
            "on_fixed_upstream": {"apply": fixed_upstream.apply, "refused": fixed_upstream.refused,
                                  "reason": fixed_upstream.reason},
            "on_renamed": {"apply": renamed.apply, "refused": renamed.refused,
                           "reason": renamed.reason},
        },
        sys.stdout,
    )  # fmt: skip


if __name__ == "__main__":
    main()
