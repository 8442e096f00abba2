"""Conversation-affine routing: rendezvous hashing over the healthy primaries, weights
respected, bounded load, and only a leaving backend's conversations move."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from gateway.config import UpstreamSettings
from gateway.upstream.pool import BackendPool

KEYS = [f"conversation-{i}" for i in range(3000)]  # fixed: the tests are deterministic


def with_pool(backends: list[dict[str, Any]], check: Callable[[BackendPool], None]) -> None:
    async def run() -> None:
        pool = BackendPool(UpstreamSettings.model_validate({"backends": backends}))
        try:
            check(pool)
        finally:
            await pool.session.close()
            await pool.fresh_session.close()

    asyncio.run(run())


def assignment(pool: BackendPool) -> dict[str, str]:
    rng = random.Random(0)
    return {key: pool.choose_first(0.0, rng, affinity=key).name for key in KEYS}


THREE = [{"name": n, "url": f"http://{n}:8000"} for n in ("a", "b", "c")]


def test_a_conversation_always_lands_on_the_same_backend() -> None:
    def check(pool: BackendPool) -> None:
        first, second = assignment(pool), assignment(pool)
        assert first == second
        counts = Counter(first.values())
        assert set(counts) == {"a", "b", "c"}
        assert all(800 < n < 1200 for n in counts.values()), counts  # ~1000 each

    with_pool(THREE, check)


def test_a_backend_that_leaves_moves_only_its_own_conversations() -> None:
    def check(pool: BackendPool) -> None:
        before = assignment(pool)
        pool.backends[1].healthy = False  # b leaves
        during = assignment(pool)
        moved = {k for k in KEYS if before[k] != during[k]}
        assert moved == {k for k in KEYS if before[k] == "b"}
        pool.backends[1].healthy = True  # ...and rejoins: everything goes back
        assert assignment(pool) == before

    with_pool(THREE, check)


def test_weights_are_respected() -> None:
    weighted = [
        {"name": "big", "url": "http://big:8000", "weight": 3.0},
        {"name": "small", "url": "http://small:8000", "weight": 1.0},
    ]

    def check(pool: BackendPool) -> None:
        counts = Counter(assignment(pool).values())
        assert 0.70 < counts["big"] / len(KEYS) < 0.80, counts  # 75% expected

    with_pool(weighted, check)


def test_bounded_load_spills_a_skewed_mix_to_the_next_backend() -> None:
    """Every conversation hashing to one backend cannot pile onto it: past 1.25x its
    share of the requests in flight, the next backend in the ranking takes them."""

    def check(pool: BackendPool) -> None:
        rng = random.Random(0)
        home = pool.choose_first(0.0, rng, affinity="hot")
        for backend in pool.backends:
            backend.in_flight = 0
        chosen = []
        for _ in range(30):  # one hot conversation, 30 requests at once
            backend = pool.choose_first(0.0, rng, affinity="hot")
            backend.in_flight += 1
            chosen.append(backend.name)
        counts = Counter(chosen)
        assert counts[home.name] == max(counts.values())
        assert counts[home.name] <= 1.25 * 30 / 3 + 1
        assert len(counts) == 3

    with_pool(THREE, check)


def test_without_a_conversation_the_choice_is_weighted_random() -> None:
    def check(pool: BackendPool) -> None:
        rng = random.Random(1)
        counts = Counter(pool.choose_first(0.0, rng).name for _ in range(3000))
        assert set(counts) == {"a", "b", "c"}

    with_pool(THREE, check)


def test_discovered_addresses_take_the_lowest_free_slots() -> None:
    """Each address of a ``discover: true`` backend is a backend ``<name>-<slot>``: a
    departed address frees its slot, the next new one takes it; IPv6 addresses are
    bracketed in the URL; beyond ``max_replicas`` addresses are left out."""
    from gateway.config import BackendSettings
    from gateway.upstream.discovery import DiscoveredBackends

    settings = BackendSettings(
        name="vllm", url="http://pods.test:8000/", discover=True, max_replicas=3
    )
    found = DiscoveredBackends(settings)
    answers = iter(
        [["10.0.0.1", "10.0.0.2"], ["10.0.0.2"], ["10.0.0.2", "fd00::7", "10.0.0.9", "10.0.0.8"]]
    )

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("pods.test", 8000)
        return next(answers)

    async def run() -> list[Any]:
        return [await found.resolve(resolver) for _ in range(3)]

    first, second, third = asyncio.run(run())
    assert first == ({"10.0.0.1": 0, "10.0.0.2": 1}, [])
    assert second == ({}, ["10.0.0.1"])
    assert third == ({"fd00::7": 0, "10.0.0.9": 2}, [])  # 10.0.0.8: no slot left
    backend = found.backend_settings("fd00::7", 0)
    assert (backend.name, backend.url, backend.discover) == (
        "vllm-0",
        "http://[fd00::7]:8000",
        False,
    )


def test_replicas_with_different_discovery_histories_map_conversations_to_the_same_pod(
    monkeypatch: Any,
) -> None:
    """Replica A saw pods .1 and .2, then .1 was replaced by .3; replica B started after
    that. The same pods carry swapped slot names in the two replicas (A: .3 took
    slot 0; B: .2 did), yet every conversation goes to the same pod from both:
    affinity hashes the pod's address, not its slot."""
    from gateway.upstream import discovery
    from gateway.upstream.pool import Backend

    answers: dict[str, list[list[str]]] = {
        "a": [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"]],
        "b": [["10.0.0.2", "10.0.0.3"]],
    }
    replica = "a"

    async def resolver(host: str, port: int) -> list[str]:
        return answers[replica].pop(0)

    async def healthy(self: Backend, timeout_s: float) -> bool:
        return True

    monkeypatch.setattr(discovery, "resolve_addresses", resolver)
    monkeypatch.setattr(Backend, "probe_health", healthy)
    pods = [{"name": "vllm", "url": "http://pods.test:8000", "discover": True}]

    async def run() -> None:
        nonlocal replica
        pools = []
        for replica in ("a", "a", "b"):
            if replica == "b" or not pools:
                pools.append(BackendPool(UpstreamSettings.model_validate({"backends": pods})))
            await pools[-1].discover()
        a, b = pools
        try:
            slots = [{x.url: x.name for x in pool.backends} for pool in pools]
            assert slots[0] == {"http://10.0.0.2:8000": "vllm-1", "http://10.0.0.3:8000": "vllm-0"}
            assert slots[1] == {"http://10.0.0.2:8000": "vllm-0", "http://10.0.0.3:8000": "vllm-1"}
            rng = random.Random(0)
            on_a = [a.choose_first(0.0, rng, affinity=key).url for key in KEYS]
            on_b = [b.choose_first(0.0, rng, affinity=key).url for key in KEYS]
            assert on_a == on_b
            assert 1200 < on_a.count("http://10.0.0.2:8000") < 1800  # both pods used
        finally:
            for pool in pools:
                await pool.session.close()
                await pool.fresh_session.close()

    asyncio.run(run())


def test_a_pod_leaving_during_a_health_round_marks_no_healthy_pod_down(monkeypatch: Any) -> None:
    """Discovery runs while a health round's probes are out: pod .1 leaves and a dead
    pod .9 joins. The round's results belong to the pods it probed: .2 stays healthy,
    .9 stays out of rotation, and the round does not raise."""
    from gateway.upstream import discovery
    from gateway.upstream.pool import Backend

    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.9"]]
    probes_out = asyncio.Event()
    release = asyncio.Event()
    in_round = False

    async def resolver(host: str, port: int) -> list[str]:
        return answers.pop(0)

    async def probe(self: Backend, timeout_s: float) -> bool:
        alive = not self.url.startswith("http://10.0.0.9")
        if in_round:
            probes_out.set()
            await release.wait()
        return alive

    monkeypatch.setattr(discovery, "resolve_addresses", resolver)
    monkeypatch.setattr(Backend, "probe_health", probe)
    pods = [{"name": "vllm", "url": "http://pods.test:8000", "discover": True}]

    async def run() -> None:
        nonlocal in_round
        pool = BackendPool(UpstreamSettings.model_validate({"backends": pods}))
        try:
            await pool.discover()
            in_round = True
            health_round = asyncio.ensure_future(pool.check_all())
            await probes_out.wait()
            in_round = False
            await pool.discover()  # .1 leaves, .9 (dead) joins, while the probes are out
            release.set()
            await health_round
            state = {b.url: b.healthy for b in pool.backends}
            assert state == {"http://10.0.0.2:8000": True, "http://10.0.0.9:8000": False}
        finally:
            await pool.session.close()
            await pool.fresh_session.close()

    asyncio.run(run())
