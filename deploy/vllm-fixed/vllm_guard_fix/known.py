"""The vLLM code this plugin was proven on, by source fingerprint.

``fingerprint`` is the first 16 hex digits of SHA-256 over a function's source
(``inspect.getsource``, dedented). Each entry below was produced from the
released wheel of that vLLM version and is exercised on that version's real
coordinator and block pool by ``tests/support/fix_proof.py``
(``tests/integration/test_fix_versions.py``). Code that matches none of them is
refused: the plugin cannot know what it would change there.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

# MambaManager.find_longest_cache_hit: identical in 0.28.0 through 0.34.0 (it
# accepts drop_eagle_block and never reads it); 0.26.0's differs only in asserting
# that the block hashes are a list (0.28 accepts any Sequence).
STOCK_FINDERS = frozenset({"67e47ec6b455a0b6", "b2447e9a9d42af39"})

# HybridKVCacheCoordinator (verify_and_split_kv_cache_groups, find_longest_cache_hit,
# find_longest_cache_hit_per_group) -> the vLLM version(s) it comes from. In all of
# them the lookup loop passes ``drop_eagle_block = use_eagle and idx not in
# eagle_verified`` from the per-spec ``use_eagle`` bit, and adds no margin for
# Mamba specs.
KNOWN_COORDINATORS: dict[tuple[str, str, str], str] = {
    ("1c72ecd3671f3933", "f0a4c6bc1fbb513b", "7153fe23293e8690"): "0.26",
    ("3c6f027318370e5a", "f0a4c6bc1fbb513b", "7153fe23293e8690"): "0.28",
    ("49f34a201c8a62d0", "0a552910a031f356", "e4fc12b295b2922c"): "0.29",
    ("fb9a45156244a06a", "0c850b2ba80bfc9f", "443181acc2382087"): "0.30",
    ("2e977de860f1c56a", "a96587d70e28f2bd", "0953f4a28bdde936"): "0.31",
    ("d28f48d3c98d73a4", "7726210f10e0836d", "e69ee1afd1799d15"): "0.32",
    ("8eb92a0dea67c115", "7726210f10e0836d", "e69ee1afd1799d15"): "0.33-0.34",
}


def fingerprint(function: Any) -> str:
    source = inspect.cleandoc(inspect.getsource(function))
    return hashlib.sha256(source.encode()).hexdigest()[:16]
