"""Deploy artefacts validated by real tools: promtool, hadolint, kubernetes-validate,
a real Prometheus answering every dashboard panel, and the Dockerfile's install steps."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import GatewayFactory, RunningVLLM, openai_client, scraped_metric, wait_for
from support.prometheus import PrometheusServer
from support.servers import free_port, wait_http
from support.stub_backend import StubBackend
from support.workload import run_workload

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_BASE = K8S / "base"
BIN = Path(sys.executable).parent


def run(*command: str, cwd: Path = ROOT) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_promtool_config_rules_and_rule_tests() -> None:
    prom = DEPLOY / "prometheus"
    assert "SUCCESS" in run("promtool", "check", "config", "prometheus.yml", cwd=prom)
    assert "19 rules found" in run("promtool", "check", "rules", "alerts.yml", cwd=prom)
    assert "SUCCESS" in run("promtool", "test", "rules", "alerts_test.yml", cwd=prom)


def test_every_alert_has_a_tested_runbook_section_and_is_listed() -> None:
    """Each alert's runbook_url anchors a section of deploy/RUNBOOK.md, its rule test
    exists (alerts_test.yml names it), and every page that lists the alerts lists it."""
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    runbook = (DEPLOY / "RUNBOOK.md").read_text()
    anchors = {line[3:].strip().lower() for line in runbook.splitlines() if line.startswith("## ")}
    tests = (DEPLOY / "prometheus" / "alerts_test.yml").read_text()
    listings = [ROOT / "docs" / "metrics.md", DEPLOY / "README.md"]
    for rule in alerts:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        assert rule["annotations"]["runbook_url"].rsplit("#", 1)[1] in anchors, name
        assert f"alertname: {name}" in tests, name
        for listing in listings:
            assert name in listing.read_text(), f"{name} not in {listing.name}"


def test_prometheusrule_carries_the_tested_rules(tmp_path: Path) -> None:
    resource = yaml.safe_load((K8S_BASE / "prometheusrule.yaml").read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(resource["spec"]))
    assert "19 rules found" in run("promtool", "check", "rules", str(rules))


def test_the_kustomize_base_carries_the_tested_dashboard() -> None:
    copy = json.loads((K8S_BASE / "vllm-guard-overview.json").read_text())
    assert copy == dashboard()


def test_hadolint_passes() -> None:
    run(str(BIN / "hadolint"), "Dockerfile", "deploy/vllm-fixed/Dockerfile")


def test_the_fixed_image_fails_closed() -> None:
    """The fixed image must not serve as "fixed" when the plugin refused to patch."""
    dockerfile = (DEPLOY / "vllm-fixed" / "Dockerfile").read_text()
    env = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("ENV ")]
    assert "VLLM_GUARD_FIX_REQUIRE=1" in env
    assert not any(e.startswith("VLLM_GUARD_FIX_DISABLE") for e in env)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize``: the objects a user's ``kubectl apply -k`` would create."""
    return [d for d in yaml.safe_load_all(run("kubectl", "kustomize", str(directory))) if d]


def test_kustomize_base_renders_and_validates(tmp_path: Path) -> None:
    objects = kustomize(K8S_BASE)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["ConfigMap", "ConfigMap", "Deployment", "Service", "Service",
                            "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
                            "PrometheusRule"])  # fmt: skip
    core = [o for o in objects if o["kind"] not in ("ServiceMonitor", "PrometheusRule")]
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(core))
    output = run(str(BIN / "kubernetes-validate"), "--strict", str(rendered))
    for kind in ("deployment", "service", "horizontalpodautoscaler", "poddisruptionbudget",
                 "configmap"):  # fmt: skip
        assert f"passed for resource {kind}/vllm-guard" in output
    assert "passed for resource service/vllm-headless" in output
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    # A span names its pod, when tracing is turned on (the chart's variables alike).
    assert env["K8S_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == (
        "k8s.pod.name=$(K8S_POD_NAME),k8s.namespace.name=$(K8S_NAMESPACE_NAME)"
    )


def test_kustomize_overlay_labels_the_monitoring_objects_for_kube_prometheus_stack() -> None:
    objects = kustomize(K8S / "overlays" / "kube-prometheus-stack")
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (resource,) = [o for o in objects if o["kind"] == kind]
        assert resource["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_k8s_objects_fit_together() -> None:
    objects = kustomize(K8S_BASE)
    headless = next(o for o in objects if o["metadata"]["name"] == "vllm-headless")
    docs = {o["kind"]: o for o in objects if o["kind"] != "ConfigMap" and o is not headless}
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    deployment = docs["Deployment"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == "vllm-guard"
    spread = pod["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitor = docs["ServiceMonitor"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= docs["Service"]["metadata"]["labels"].items()
    )
    service_ports = {p["name"] for p in docs["Service"]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    # The config map the pods mount is the generated one, its name hashed from the
    # config (a change rolls the pods).
    (volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    config_name = volume["configMap"]["name"]
    assert config_name.startswith("vllm-guard-")
    assert config_name in config_maps
    config_text = config_maps[config_name]["data"]["vllm-guard.yaml"]
    config = yaml.safe_load(config_text)
    # The backends point at the headless Service, each pod found by DNS.
    assert headless["spec"]["clusterIP"] == "None"
    (discovered,) = [b for b in config["upstream"]["backends"] if b.get("discover")]
    host = discovered["url"].split("//")[1].split(":")[0]
    assert host.startswith(f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.")
    grace = config["server"]["shutdown_grace_s"]
    pre_stop = 5  # the preStop pause
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + grace + 5
    dashboard_map = config_maps["vllm-guard-dashboard"]
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    config_file = Path("/tmp") / f"vllm-guard-k8s-{time.time_ns()}.yaml"
    config_file.write_text(config_text)
    checked = run(str(BIN / "vllm-guard"), "check-config", str(config_file))
    assert "OK" in checked
    assert "warning" not in checked
    compose_config = DEPLOY / "compose" / "vllm-guard.yaml"
    checked = run(str(BIN / "vllm-guard"), "check-config", str(compose_config))
    assert "OK" in checked
    assert "warning" not in checked


def test_compose_stack_is_coherent() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"vllm", "vllm-fixed", "vllm-guard", "prometheus", "grafana"} <= services.keys()
    assert services["vllm-fixed"]["profiles"] == ["fixed"]
    for name in ("vllm-guard", "prometheus", "grafana"):  # never all interfaces by default
        assert all(p.startswith("${HOST_BIND:-127.0.0.1}:") for p in services[name]["ports"])
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert any("vllm-overview.json" in v for v in services["grafana"]["volumes"])
    flags = services["vllm"]["command"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--mamba-cache-mode=align", "--enable-chunked-prefill"):  # fmt: skip
        assert flag in flags
    assert any(f.startswith("--speculative-config=") and '"mtp"' in f for f in flags)
    for service in services.values():  # every mounted file exists
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / "compose" / source).exists(), source
    gateway = services["vllm-guard"]["environment"]  # tracing: off unless asked for
    assert gateway["VLLM_GUARD_TRACING__ENABLED"] == "${TRACING:-false}"
    assert gateway["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].startswith("${OTLP_TRACES_ENDPOINT:-http")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in scrape["scrape_configs"]
               for c in job["static_configs"] for t in c["targets"]}  # fmt: skip
    assert targets <= services.keys()


def substitute(expr: str, model: str, backend: str) -> str:
    return (
        expr.replace("$namespace", ".*")  # the test's Prometheus adds no namespace label
        .replace("$job", "vllm-guard")  # Grafana's All: the gateways' jobs only
        .replace("$instance", ".*")
        .replace("$model", model)
        .replace("$backend", backend)
        .replace("$__rate_interval", "5m")
        .replace("$__range", "10m")
    )


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "vllm-guard-overview.json").read_text())
    return data


def vllm_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "vllm-overview.json").read_text())
    return data


def test_dashboard_shape() -> None:
    board = dashboard()
    assert board["title"] == "vllm-guard overview"
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"namespace", "job", "instance", "model", "backend"} <= names
    titles = " | ".join(p["title"] for p in board["panels"])
    for needed in ("the bug's rate", "Requests affected", "delivered", "Recovered",
                   "retries refused", "hit rate", "corrupted vs. clean", "Attempts", "latency",
                   "overhead", "first token", "Backend up", "vllm-guard-fix per backend",
                   "lookups lowered", "recovery ratio", "by verdict", "per gateway pod",
                   "answered itself", "CPU per", "Memory per"):  # fmt: skip
        assert needed in titles, needed


@pytest.mark.vllm
def test_every_dashboard_panel_returns_data(vllm: RunningVLLM, gateway_for: GatewayFactory) -> None:
    gateway = gateway_for(
        vllm.url,
        guard={"budget": {"ratio": 1.0, "min_per_second": 5.0}},
        upstream={"metrics_scrape_interval_s": 1.0},
    )
    vllm_target = vllm.url.removeprefix("http://")
    targets = {"vllm-guard": f"127.0.0.1:{gateway.port}", "vllm": vllm_target}
    with PrometheusServer(targets, labels={"vllm": {"backend": "vllm0"}}) as prom:
        prom.wait_for_scrape_after(time.time(), "vllm-guard")  # scraping before traffic starts
        client = openai_client(gateway.url)
        seed = int(time.time()) % 100_000
        # p=0.4 per cached block: corruption in every run (at 0.15, not always)
        poison = {"vllm_xargs": {"vg_poison_rate": 0.4}}
        for stream in (False, True):
            run_workload(
                client, vllm.model, episodes_count=4, steps=3, concurrency=4, seed=seed + stream,
                extra_body=poison, max_tokens=12, stream=stream,
            )  # fmt: skip
        abandoned = {"model": vllm.model, "max_tokens": 1900, "ignore_eos": True, "stream": True,
                     "messages": [{"role": "user", "content": "a client that leaves"}]}  # fmt: skip
        url = gateway.url + "/v1/chat/completions"
        disconnects = "vllm_guard_client_disconnects_total"
        for _ in range(3):  # a stalled machine can let vLLM finish before the client leaves
            with httpx.stream("POST", url, json=abandoned, timeout=60) as response:
                assert response.status_code == 200, response.read()
                next(response.iter_raw())
            if wait_for(lambda: bool(scraped_metric(gateway.url, disconnects)), timeout_s=10):
                break
        else:
            raise AssertionError("the gateway did not see the client leave")
        refused = httpx.post(
            url, content=b"{not json", headers={"content-type": "application/json"}
        )
        assert refused.status_code == 400  # one the gateway answers itself
        time.sleep(2)
        prom.wait_for_scrape_after(time.time(), "vllm-guard")
        empty = []
        for panel in dashboard()["panels"]:
            for target in panel["targets"]:
                expr = substitute(target["expr"], vllm.model, "vllm0")
                if not prom.query(expr):
                    empty.append(f"{panel['title']}: {expr}")
        # vLLM's own dashboard, provisioned beside ours (speculative decoding is off on
        # the test server, so its acceptance panel is empty by design).
        for panel in vllm_dashboard()["panels"]:
            if "Speculative" in panel["title"]:
                continue
            for target in panel["targets"]:
                expr = target["expr"].replace("$model_name", vllm.model)
                expr = expr.replace("$__rate_interval", "5m")
                if not prom.query(expr):
                    empty.append(f"vLLM: {panel['title']}: {expr}")
        assert empty == [], "panels without data:\n" + "\n".join(empty)
        for variable in ("model", "backend"):
            values = httpx.get(prom.url + f"/api/v1/label/{variable}/values").json()["data"]
            assert values, variable


def test_dockerfile_install_steps_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    """The Dockerfile's own RUN pip install lines, in a new venv, then serve /healthz."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    installs = [
        line.split("RUN ", 1)[1].split("&&")[0].strip()
        for line in text.splitlines()
        if line.startswith("RUN pip install")
    ]
    assert len(installs) == 2
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    for command in installs:
        command = command.replace("/app/requirements.lock", str(DEPLOY / "requirements.lock"))
        command = re.sub(r"(\s)/app(\s|$)", rf"\g<1>{ROOT}\g<2>", command)
        run(str(venv / "bin" / "python"), "-m", *command.split())
    # The lock holds the tracing extra: the image traces with no other install, over
    # either OTLP protocol (tracing.enabled and the OTEL_* variables).
    for protocol in ("http/protobuf", "grpc"):
        traced = (
            f"import os; os.environ['OTEL_EXPORTER_OTLP_TRACES_PROTOCOL'] = {protocol!r}\n"
            "from gateway.config import TracingSettings\n"
            "from gateway.observe.tracing import start_tracing\n"
            "start_tracing(TracingSettings(enabled=True)).shutdown()\n"
        )
        run(str(venv / "bin" / "python"), "-c", traced, cwd=tmp_path)
    port = free_port()
    with StubBackend() as stub:
        process = subprocess.Popen(
            [str(venv / "bin" / "vllm-guard"), "serve", "--config", "config/vllm-guard.yaml",
             "--backend", stub.url, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", 60, process)
        finally:
            process.terminate()
            process.wait(timeout=20)
    assert shutil.which("vllm-guard", path=str(venv / "bin"))
