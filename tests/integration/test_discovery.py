"""vLLM pods found by DNS (``discover: true``): each address a backend of its own.

Three scripted backends listen on one port at 127.0.0.2, .3 and .4 (Linux routes
all of 127/8 to the loopback): the addresses a headless Service's name would
resolve to. The resolver is the real code path's (``discovery.resolve_addresses``)
with the answers this test controls, as a cluster's DNS would change them when a
pod leaves and another joins. What is tested is the gateway's routing, not vLLM's
answers: scripted backends are enough, and they tell which pod served a request.
"""

from __future__ import annotations

import time

import httpx
from conftest import GatewayFactory, wait_for
from support.pods import Dns, backends_of
from support.stub_backend import StubBackend


def served_by(pods: dict[str, StubBackend], marker: str) -> str:
    """The address of the pod that received the last request carrying ``marker``."""
    hits = [
        (len(server.state.requests), address)
        for address, server in pods.items()
        if any(marker in str(body.get("messages")) for body in server.state.requests)
    ]
    assert hits, marker
    return max(hits)[1]


def test_pods_found_by_dns_are_backends_and_only_a_leaving_pods_conversations_move(
    pods: tuple[int, dict[str, StubBackend]], dns: Dns, gateway_for: GatewayFactory
) -> None:
    port, servers = pods
    dns.answer = ["127.0.0.2", "127.0.0.3"]
    gateway = gateway_for(
        [],
        backends=[{"name": "vllm", "url": f"http://vllm-pods.test:{port}", "discover": True}],
        upstream={"discovery_interval_s": 0.2, "health_interval_s": 0.2},
    )
    assert backends_of(gateway.url) == {"vllm-0": True, "vllm-1": True}

    def turn(conversation: int, step: int) -> str:
        marker = f"conversation {conversation} step {step}"
        messages = [
            {"role": "system", "content": f"agent {conversation}"},
            {"role": "user", "content": f"task {conversation}"},
            {"role": "user", "content": marker},
        ]
        response = httpx.post(
            gateway.url + "/v1/chat/completions", json={"model": "m", "messages": messages}
        )
        assert response.status_code == 200, response.text
        return served_by(servers, marker)

    conversations = range(24)  # fixed: which pod a conversation hashes to is deterministic
    first = {c: turn(c, 0) for c in conversations}
    assert set(first.values()) == {"127.0.0.2", "127.0.0.3"}
    assert {c: turn(c, 1) for c in conversations} == first  # affinity: same pod again

    dns.answer = ["127.0.0.2"]  # the pod at .3 leaves
    assert wait_for(lambda: backends_of(gateway.url) == {"vllm-0": True}, timeout_s=10)
    during = {c: turn(c, 2) for c in conversations}
    assert set(during.values()) == {"127.0.0.2"}
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'vllm_guard_backend_up{backend="vllm-1"' not in metrics  # gone, not "down"
    assert 'backend_address="127.0.0.3:' not in metrics

    dns.answer = ["127.0.0.2", "127.0.0.4"]  # a new pod joins, in the free slot
    assert wait_for(
        lambda: backends_of(gateway.url) == {"vllm-0": True, "vllm-1": True}, timeout_s=10
    )
    after = {c: turn(c, 3) for c in conversations}
    # Affinity hashes the pods' addresses, not their slots: the new pod takes its
    # share (from .2 too), and the departed pod's conversations do not follow its slot.
    assert set(after.values()) == {"127.0.0.2", "127.0.0.4"}
    assert {c for c in conversations if after[c] == "127.0.0.2"} <= {
        c for c in conversations if during[c] == "127.0.0.2"
    }

    dns.answer = None  # a DNS blip: the known pods stay
    time.sleep(1.0)
    assert backends_of(gateway.url) == {"vllm-0": True, "vllm-1": True}
