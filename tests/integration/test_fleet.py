"""The chart's own topology keeps the promises one process keeps: several gateways
(replicas) in front of vLLM pods found by DNS, whose addresses change while they
run, sharing one real ``redis-server`` or not.

The pods are scripted backends on one port at 127.0.0.2-.4 (the addresses a headless
Service's name resolves to; Linux routes 127/8 to the loopback). They model vLLM's
Responses store as vLLM 0.32 has it (``entrypoints/openai/responses/serving.py``): an
answer made with ``store`` lives in the memory of the server that made it; a
follow-up by ``previous_response_id``, a GET or a cancel of its id anywhere else is
a 404 "Response with id '...' not found.". Where they differ: they store every
answer (vLLM only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` and ``store`` true), and
their answers are canned. The real vLLM's store is tested in ``test_apis_vllm.py``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import GatewayFactory, RunningRedis, scraped_metric, wait_for
from support.pods import ADDRESSES, Dns, backends_of
from support.stub_backend import StubBackend


def replica(gateway_for: GatewayFactory, port: int, affinity: bool = True, **sections: Any) -> Any:
    """One gateway replica in front of the pods' name, as the chart deploys it."""
    return gateway_for(
        [],
        backends=[{"name": "vllm", "url": f"http://vllm-pods.test:{port}", "discover": True}],
        upstream={
            "discovery_interval_s": 0.2,
            "health_interval_s": 0.2,
            "conversation_affinity": affinity,
        },
        **sections,
    )


def slots_of(gateway: Any) -> dict[str, str]:
    """Each discovered pod's slot name -> the last part of its address."""
    pool = gateway.runtime.pool
    return {b.name: "." + b.url.split(":")[1].rsplit(".", 1)[1] for b in pool.backends}


def test_replicas_with_different_discovery_histories_send_a_conversation_to_one_pod(
    pods: tuple[int, dict[str, StubBackend]], dns: Dns, gateway_for: GatewayFactory
) -> None:
    """Replica A saw pods .2 and .3, then .2 was replaced by .4; replica B started
    after that. The same two pods have swapped slot names in A and B; every
    conversation still goes to the same pod from both (with slot names hashed, none
    did in the review's reproduction)."""
    port, servers = pods
    dns.answer = ["127.0.0.2", "127.0.0.3"]
    a = replica(gateway_for, port)
    dns.answer = ["127.0.0.3", "127.0.0.4"]
    assert wait_for(lambda: slots_of(a) == {"vllm-0": ".4", "vllm-1": ".3"}, 10)
    b = replica(gateway_for, port)
    assert slots_of(b) == {"vllm-0": ".3", "vllm-1": ".4"}  # the same names, swapped

    def pod_serving(gateway_url: str, conversation: int) -> str:
        marker = f"conversation {conversation} via {gateway_url}"
        messages = [
            {"role": "system", "content": f"agent {conversation}"},
            {"role": "user", "content": f"task {conversation}"},
            {"role": "user", "content": marker},
        ]
        response = httpx.post(
            gateway_url + "/v1/chat/completions", json={"model": "m", "messages": messages}
        )
        assert response.status_code == 200, response.text
        (address,) = [
            address
            for address, server in servers.items()
            if any(marker in str(body.get("messages")) for body in server.state.requests)
        ]
        return address

    conversations = range(24)  # fixed: deterministic hashing
    on_a = {c: pod_serving(a.url, c) for c in conversations}
    on_b = {c: pod_serving(b.url, c) for c in conversations}
    assert on_a == on_b
    assert set(on_a.values()) == {"127.0.0.3", "127.0.0.4"}


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "asked"])
def test_responses_chains_hold_across_replicas(
    pods: tuple[int, dict[str, StubBackend]],
    dns: Dns,
    gateway_for: GatewayFactory,
    redis_server: RunningRedis,
    shared: bool,
) -> None:
    """An agent's Responses chain alternates between two replicas: every follow-up
    (``previous_response_id``), GET and cancel reaches the pod that stores the answer
    and gets a 200. With Redis the other replica knows the pod from Redis (never
    asks); without, it asks the pods which holds the answer and remembers it. Before
    issue 32 only the replica that released an answer knew: the other hashed the id,
    right for 1 pod in 3 here (all 24 right by chance: (1/3)^24)."""
    port, servers = pods
    dns.answer = list(ADDRESSES)
    state = {"state": {"redis_url": redis_server.url, "lookup_timeout_ms": 1000}} if shared else {}
    # Affinity off: where an answer lives must be known, not re-derived.
    sections: dict[str, Any] = {"guard": {"salt_reuse": {"key": "fleet-key"}}, **state}
    a = replica(gateway_for, port, affinity=False, **sections)
    b = replica(gateway_for, port, affinity=False, **sections)
    for gateway in (a, b):
        assert wait_for(lambda g=gateway: len(backends_of(g.url)) == 3, 10)
    holder_of = {}
    for i in range(8):
        maker, other = (a, b) if i % 2 == 0 else (b, a)
        made = httpx.post(
            maker.url + "/v1/responses", json={"model": "stub", "input": f"task {i}"}
        ).json()["id"]
        (holder,) = [s for s in servers.values() if made in s.state.stored]
        holder_of[made] = holder
        if shared:  # the chain's entry is written in the background
            assert wait_for(
                lambda m=made: (
                    redis_server.command("EXISTS", f"vllm-guard:answer:{m}") == b":1\r\n"
                ),
                5,
            )
        before = len(holder.state.requests)
        follow = httpx.post(
            other.url + "/v1/responses",
            json={"model": "stub", "input": "next", "previous_response_id": made},
        )
        assert follow.status_code == 200, follow.text
        assert len(holder.state.requests) == before + 1
        for gateway in (other, maker, other):
            for path in (f"/v1/responses/{made}", f"/v1/responses/{made}/cancel"):
                method = "GET" if path.endswith(made) else "POST"
                answer = httpx.request(method, gateway.url + path)
                assert answer.status_code == 200, (path, answer.text)
                assert holder.state.paths[-1] == path
    asked = sum(
        scraped_metric(g.url, "vllm_guard_answer_homes_total", source="asked") for g in (a, b)
    )
    if shared:
        assert asked == 0
        assert all(not s.state.not_found for s in servers.values())
    else:
        assert asked == 8  # once per answer, by the replica that did not make it
    unknown = httpx.post(
        a.url + "/v1/responses",
        json={"model": "stub", "input": "next", "previous_response_id": "resp_nobody"},
    )
    assert unknown.status_code == 404
    assert scraped_metric(a.url, "vllm_guard_answer_homes_total", source="not_found") == 1
    asked_pods = sum(len(s.state.not_found) for s in servers.values())
    again = httpx.post(
        a.url + "/v1/responses",
        json={"model": "stub", "input": "next", "previous_response_id": "resp_nobody"},
    )
    assert again.status_code == 404
    # Not asked again for a while: a client repeating an unknown id costs no GET per pod.
    assert sum(len(s.state.not_found) for s in servers.values()) == asked_pods
    assert scraped_metric(a.url, "vllm_guard_answer_homes_total", source="not_found") == 2


def test_a_pod_that_could_not_say_is_asked_again_and_odd_ids_are_refused(
    pods: tuple[int, dict[str, StubBackend]], dns: Dns, gateway_for: GatewayFactory
) -> None:
    """The pod holding an answer answers the lookup with a 503 once (a blip): that
    says nothing about the answer, so it is not remembered as "not found" (it was,
    for 30 s: every follow-up, GET and cancel of it went where routing sent them,
    and 404'd); the next follow-up asks again and reaches the answer. An id no
    server gives (over 256 characters, or with other characters) is refused with a
    400 before any pod is asked (each unknown id cost a GET per pod, remembered)."""
    port, servers = pods
    dns.answer = list(ADDRESSES)
    maker = replica(gateway_for, port, affinity=False)
    other = replica(gateway_for, port, affinity=False)
    for gateway in (maker, other):
        assert wait_for(lambda g=gateway: len(backends_of(g.url)) == 3, 10)
    made = httpx.post(maker.url + "/v1/responses", json={"model": "stub", "input": "go"})
    answer_id = made.json()["id"]
    (holder,) = [s for s in servers.values() if answer_id in s.state.stored]
    holder.state.unavailable_once.add(answer_id)
    follow = {"model": "stub", "input": "next", "previous_response_id": answer_id}
    httpx.post(other.url + "/v1/responses", json=follow)  # the lookup meets the 503
    assert scraped_metric(other.url, "vllm_guard_answer_homes_total", source="unanswered") == 1
    again = httpx.post(other.url + "/v1/responses", json=follow)
    assert again.status_code == 200, again.text
    assert scraped_metric(other.url, "vllm_guard_answer_homes_total", source="asked") == 1
    asked = sum(len(s.state.not_found) for s in servers.values())
    for odd in ("resp_" + "a" * 300, "resp_../../admin", "resp_a b"):
        refused = httpx.post(
            other.url + "/v1/responses", json={**follow, "previous_response_id": odd}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "previous_response_id"
    assert sum(len(s.state.not_found) for s in servers.values()) == asked
