#!/bin/bash
# The fixed backend and the gateway on a real GPU (issue 35), on any CUDA machine:
#
#   bash tests/perf/gpu/run.sh plugin  [OUT]   # 1. the plugin in its target configuration
#   bash tests/perf/gpu/run.sh gateway [OUT]   # 2. the gateway at GPU speed
#   bash tests/perf/gpu/run.sh stub    [OUT]   # 3. the relay against a GPU-paced stub, no vLLM
#
# Both serve a tiny Qwen3-Next-shaped model (three Gated-DeltaNet layers, one attention
# layer, MoE, one MTP layer; random weights, mk_tiny.py + tinyinit.py) with prefix
# caching and MTP speculative decoding. TEXT_MODEL=1 serves it with trained weights
# instead: recipe/train_text.py first trains target and MTP layer for TRAIN_S seconds
# (default 150) on this GPU on Python's pydoc text (an answer in words to any user
# message, MTP acceptance a trained drafter's) and logs to OUT/train_text.log; TEXT_CHECK=1
# also checks model.safetensors against vLLM's own loaders (vLLM's strict load at start
# checks it too); TEXT_MODEL=keep reuses the weights an earlier run left in /tmp/tiny.
#
# 1. Two servers one after the other, stock (VLLM_GUARD_FIX_DISABLE=1) and fixed
#    (VLLM_GUARD_FIX_REQUIRE=1: vLLM refuses to start unless the plugin is active),
#    each under difftest.py's multi-turn workload (greedy answers of prefix-cache hits
#    vs fresh-salt misses, token ids): divergence, prefix-cache hit rate, and the
#    plugin's counters from vLLM's /metrics.
# 2. One stock server on cores 0-7; vLLM's own `bench serve` (prefix_repetition:
#    4 x 512-token prefixes, 32-token answers, ignore_eos) direct and through a gateway
#    per release policy (auto, the default; adaptive), each gateway on cores of its own,
#    at c=8 and c=64: TTFT, ITL, throughput. CONCS="64 256" POLICIES="off off2" picks the
#    concurrencies and gateways (off2: the guard off, two workers; off2rp: the same with
#    server.reuse_port; logprobs: the defaults with ask_logprobs, exact detection's cost,
#    beside a direct_logprobs route asking vLLM for the same logprobs: vLLM's share);
#    PROMPTS=N runs N prompts per run at every concurrency (default: ROUNDS_PER_CLIENT
#    prompts per client, so c=64's runs are a quarter of c=256's);
#    tests/perf/gpu/bench_routes.py runs them; each gateway's CPU seconds per run from
#    /proc; PROFILE=1 records the "off" gateway with py-spy (its wheel in .gpu/tools/)
#    during each concurrency's run: a collapsed-stack file per concurrency.
# 3. tests/perf/bench_event_rate.py on this machine's CPUs (no GPU, no vLLM): the same
#    relay against a stub that steps like an engine, direct vs through, CPU per event.
#
# Where vLLM is not installed (the lent H200), the bundle built by build.sh is used: carry
# .gpu/ with the checkout. Figures: BENCHMARKS.md, "On a GPU".
set -u
MODE=${1:?usage: run.sh plugin|gateway [OUT]}; OUT=${2:-${OUT:-/tmp/gpu-out}}; mkdir -p "$OUT"
H=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$H/../../.." && pwd); T0=$(date +%s)
BUNDLE=${BUNDLE:-$ROOT/.gpu}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
TEXT_MODEL=${TEXT_MODEL:-0}
say() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }

# -- vLLM, the plugin, the gateway's dependencies -------------------------------------------
SITE=""
if ! python3 -c "import vllm" 2>/dev/null; then
  [ -d /tmp/site/vllm ] || python3 -c "import tarfile;tarfile.open('$BUNDLE/bundle_site.tar.xz').extractall('/tmp/site')" || exit 3
  # The bundle has no FlashAttention: let vllm_flash_attn import (the model runs on TRITON_ATTN).
  python3 - /tmp/site/vllm/vllm_flash_attn/__init__.py <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
open(p, "w").write(s.replace("if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(", "if False:\n    raise ImportError("))
PY
  SITE=/tmp/site
fi
# The plugin, registered as vLLM finds plugins (an entry point), without installing it.
mkdir -p /tmp/plugin-meta/vllm_guard_fix-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm-guard-fix\nVersion: 0.1.0\n' > /tmp/plugin-meta/vllm_guard_fix-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nvllm_guard_fix = vllm_guard_fix:register\n' > /tmp/plugin-meta/vllm_guard_fix-0.1.0.dist-info/entry_points.txt
VLLM_PATH=$SITE:$H/recipe:$ROOT/deploy/vllm-fixed:/tmp/plugin-meta
if ! python3 -c "import pydantic_settings, orjson, redis" 2>/dev/null; then
  mkdir -p /tmp/gwsite
  python3 - "$BUNDLE/wheels" /tmp/gwsite <<'PY'
import pathlib, sys, zipfile
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):  # a wheel is a zip of its site files
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
PY
fi
GATEWAY_PATH=$SITE:/tmp/gwsite:$ROOT
python3 "$H/recipe/mk_tiny.py" /tmp/tiny >/dev/null || exit 5
LOAD=(--load-format dummy)  # random weights (tinyinit.py through TINY_INIT)
if [ "$TEXT_MODEL" != 0 ] && [ "$MODE" != stub ]; then
  # The GPU image's own torch and transformers (the bundle in $SITE has neither).
  if [ "$TEXT_MODEL" = keep ] && [ -f /tmp/tiny/model.safetensors ]; then
    say "serving the weights already in /tmp/tiny"
  else
    say "training on pydoc text for ${TRAIN_S:-150}s"
    python3 "$H/recipe/train_text.py" /tmp/tiny --seconds ${TRAIN_S:-150} --device cuda \
      --no-vllm-check > "$OUT/train_text.log" 2>&1 || { tail -30 "$OUT/train_text.log"; \
      [ "${TEXT_FALLBACK:-0}" = 1 ] || exit 7; say "training failed: random weights"; TEXT_MODEL=0; }
    [ "$TEXT_MODEL" != 0 ] && grep -E "^(trained|final loss|sample|  )" "$OUT/train_text.log" \
      && say "trained"
  fi
  if [ "${TEXT_CHECK:-0}" = 1 ]; then  # vLLM's loaders, from $SITE where the bundle is used
    PYTHONPATH=$SITE python3 "$H/recipe/train_text.py" /tmp/tiny --check >> "$OUT/train_text.log" 2>&1 \
      || { tail -30 "$OUT/train_text.log"; exit 7; }
    grep "^check:" "$OUT/train_text.log" | tail -1
  fi
  cp /tmp/tiny/train_text.json "$OUT/" 2>/dev/null
  [ "$TEXT_MODEL" != 0 ] && LOAD=(--load-format safetensors)
fi
# Random weights (no text model, or its training failed): tinyinit.py's, not vLLM's flat ones.
[ "$TEXT_MODEL" = 0 ] && export TINY_INIT=1 TINY_ALPHA=${TINY_ALPHA:-4.0}
CORES=$(nproc); VLLM_CORES=0-$(( CORES / 2 - 1 ))

# Compile caches (Triton kernels, torch.compile, inductor): a fresh machine spends ~2 of its
# ~5.5 minutes of vLLM start compiling the GDN/MoE kernels. SAVE_CACHE=1 packs them into
# $OUT once vLLM is up; put the parts in $BUNDLE/cache/ and the next call starts from them.
COMPILE_CACHES="root/.triton root/.cache/vllm tmp/torchinductor_root"
if ls "$BUNDLE"/cache/compile_cache.tar.xz.* >/dev/null 2>&1; then
  cat "$BUNDLE"/cache/compile_cache.tar.xz.* | xz -d | tar -C / -xf - && say "compile caches restored"
fi
save_caches() {
  [ "${SAVE_CACHE:-0}" = 1 ] || return 0
  local dest=${CACHE_OUT:-$OUT}
  (cd / && ls -d $COMPILE_CACHES 2>/dev/null | xargs tar -cf - \
    | taskset -c $(( CORES - 4 ))-$(( CORES - 3 )) xz -T2 -6 | split -b 15M - "$dest/compile_cache.tar.xz.") \
    && say "compile caches saved: $(du -shc "$dest"/compile_cache.tar.xz.* | tail -1)"
}

SPID=""
start_vllm() { # tag, env assignments..., then -- and extra flags
  local tag=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" PYTHONPATH=$VLLM_PATH setsid taskset -c $VLLM_CORES python3 -m vllm.entrypoints.cli.main \
    serve /tmp/tiny --served-model-name tiny "${LOAD[@]}" --dtype bfloat16 --max-model-len 4096 \
    --max-num-seqs ${MAX_SEQS:-128} --gpu-memory-utilization 0.30 --gdn-prefill-backend triton \
    --attention-backend TRITON_ATTN --enable-prompt-tokens-details --disable-uvicorn-access-log \
    --port 8000 --enable-prefix-caching \
    --speculative-config '{"method":"mtp","num_speculative_tokens":2,"attention_backend":"TRITON_ATTN"}' \
    "$@" > "$OUT/vllm_$tag.log" 2>&1 & SPID=$!
  for _ in $(seq 1 $(( ${VLLM_START_S:-300} / 2 ))); do
    curl -sf -o /dev/null http://127.0.0.1:8000/health && { say "vLLM $tag up"; return 0; }
    kill -0 $SPID 2>/dev/null || break; sleep 2
  done
  say "vLLM $tag FAILED to start"; grep -v "^INFO\|^(EngineCore" "$OUT/vllm_$tag.log" | tail -30; return 1
}
stop_vllm() { kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -KILL -- -$SPID 2>/dev/null; sleep 2; }
trap 'stop_vllm; kill $(jobs -p) 2>/dev/null' EXIT

if [ "$MODE" = plugin ]; then
  for arm in stock fixed; do
    if [ $arm = stock ]; then fix=VLLM_GUARD_FIX_DISABLE=1; else fix=VLLM_GUARD_FIX_REQUIRE=1; fi
    start_vllm $arm $fix -- --enforce-eager || continue
    grep -h "vllm-guard-fix" "$OUT/vllm_$arm.log" | head -3
    timeout 200 python3 "$H/recipe/difftest.py" --tag $arm --convs ${CONVS:-48} --turns ${TURNS:-3} \
      --out "$OUT/difftest_$arm.json" > /dev/null
    curl -s http://127.0.0.1:8000/metrics | grep -E "^vllm_guard_fix|^vllm:prefix_cache_(hits|queries)_total|^vllm:spec_decode_num_(accepted|draft)_tokens_total" > "$OUT/metrics_$arm.txt"
    say "$arm done"; stop_vllm
  done
  python3 "$H/report.py" plugin "$OUT"
  exit 0
fi

# PROFILE=1 (stub and gateway modes): py-spy from its wheel in the bundle.
if [ "${PROFILE:-0}" = 1 ] && ! command -v py-spy >/dev/null; then
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('$BUNDLE/tools/py_spy-*.whl')[0]).extractall('/tmp/pyspy')"
  install -m 755 /tmp/pyspy/py_spy-*.data/scripts/py-spy /usr/local/bin/py-spy
fi
if [ "$MODE" = stub ]; then
  PYTHONPATH=$GATEWAY_PATH python3 "$ROOT/tests/perf/bench_event_rate.py" --rounds ${ROUNDS:-1} \
    --concurrency ${CONCS:-64,128} --proxy-cpus 2-3 --load-cpus 4-15 --peers ${PEERS:-aiohttp,workers2} \
    $([ "${PROFILE:-0}" = 1 ] && echo --profile "$OUT/profile_stub_off.txt")
  exit 0
fi

# -- 2. the gateway at GPU speed ------------------------------------------------------------
start_vllm gateway-bench VLLM_GUARD_FIX_DISABLE=1 -- || exit 6
save_caches &
port=9000; GATEWAYS=(); declare -A GPIDS
POLICY_LIST=(${POLICIES:-off auto adaptive})  # two cores each, from the middle core up
[ ${#POLICY_LIST[@]} -le 3 ] || { say "at most 3 POLICIES: the client runs on the cores after"; exit 8; }
for policy in "${POLICY_LIST[@]}"; do  # off: the guard off, the relay alone
  first=$(( CORES / 2 + (${#GATEWAYS[@]}) * 2 ))
  workers=1; guard="{stream: {release: $policy}}"
  reuse=false  # off2rp: two workers, a listening socket each (server.reuse_port)
  logprobs=false  # logprobs: the defaults with upstream.backends[].ask_logprobs (exact detection)
  case $policy in off) guard="{mode: \"off\"}";; off2) guard="{mode: \"off\"}"; workers=2;;
    off2rp) guard="{mode: \"off\"}"; workers=2; reuse=true;;
    logprobs) guard="{}"; logprobs=true;; esac
  printf 'upstream:\n  backends: [{name: vllm, url: "http://127.0.0.1:8000", ask_logprobs: %s}]\nguard: %s\nserver: {workers: %s, reuse_port: %s}\n' \
    $logprobs "$guard" $workers $reuse > "$OUT/gateway_$policy.yaml"
  PYTHONPATH=$GATEWAY_PATH taskset -c $first-$(( first + 1 )) python3 -m gateway.cli serve \
    --config "$OUT/gateway_$policy.yaml" --host 127.0.0.1 --port $port > "$OUT/gateway_$policy.log" 2>&1 &
  GATEWAYS+=("$policy=http://127.0.0.1:$port"); GPIDS[$policy]=$!; port=$((port + 1))
done
for g in "${GATEWAYS[@]}"; do
  for _ in $(seq 1 60); do curl -sf -o /dev/null "${g#*=}/readyz" && break; sleep 1; done
done
say "gateways up: ${GATEWAYS[*]}"
# Listen queues (where ss exists; the lent H200 has none) and the kernel's SYN and
# TIME_WAIT settings, beside the TCP counters bench_routes.py records per run: whether a
# first token about 1 s late was a SYN retry (the kernel's first comes after 1 s).
{ command -v ss >/dev/null && ss -ltn; sysctl net.core.somaxconn net.ipv4.tcp_max_syn_backlog net.ipv4.tcp_syncookies \
  net.ipv4.tcp_timestamps net.ipv4.tcp_tw_reuse net.ipv4.ip_local_port_range; } \
  > "$OUT/listen.txt" 2>&1
BENCH_CORES=$(( CORES / 2 + 6 ))-$(( CORES - 1 ))
# What the model writes (random or trained weights; the guard judges it as a real answer).
curl -s http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
  -d '{"model":"tiny","prompt":"Open the settings page and","max_tokens":32,"temperature":0}' \
  > "$OUT/sample.json"
ROUTES=("direct=http://127.0.0.1:8000"); ASK_LOGPROBS=()
# Beside the logprobs gateway, vLLM asked for the same logprobs direct: whose cost it is.
[ -n "${GPIDS[logprobs]:-}" ] && ROUTES+=("direct_logprobs=http://127.0.0.1:8000") \
  && ASK_LOGPROBS=(--ask-logprobs direct_logprobs)
for g in "${GATEWAYS[@]}"; do ROUTES+=("$g@${GPIDS[${g%%=*}]}"); done
PYTHONPATH=$SITE taskset -c $BENCH_CORES python3 "$H/bench_routes.py" --out "$OUT" \
  --concs ${CONCS:-8 64} --rounds ${ROUNDS:-3} --prompts-per-client ${ROUNDS_PER_CLIENT:-8} \
  --prompts ${PROMPTS:-0} "${ASK_LOGPROBS[@]}" \
  $([ "${PROFILE:-0}" = 1 ] && echo --profile off) "${ROUTES[@]}" > "$OUT/bench_routes.log" 2>&1 \
  || { say "bench_routes failed"; grep -v "nanobind\|leaked" "$OUT/bench_routes.log" | tail -20; }
grep '^{"conc"' "$OUT/bench_routes.log" | cut -c1-160
curl -s http://127.0.0.1:8000/metrics | grep -E "^vllm:(spec_decode_num_(accepted|draft)_tokens|prefix_cache_(hits|queries))_total" \
  > "$OUT/vllm_metrics.txt"  # MTP acceptance, prefix-cache hits over the whole run
for g in "${GATEWAYS[@]}"; do  # what each gateway judged: verdicts, continuations
  curl -s "${g#*=}/metrics" | grep -E "^vllm_guard_(requests|continuations|retries)_total" \
    > "$OUT/gateway_metrics_${g%%=*}.txt"
done
python3 "$H/report.py" gateway "$OUT"
