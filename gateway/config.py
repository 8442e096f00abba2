"""One validated settings model: YAML file, then environment, then CLI flags.

Precedence (highest first): explicit overrides (CLI) > ``VLLM_GUARD_*`` environment
variables (nested with ``__``, e.g. ``VLLM_GUARD_GUARD__MAX_ATTEMPTS=2``) > the YAML
file > defaults.  ``load_settings`` is the only entry point; it raises
``ConfigError`` with plain-language messages.
"""

from __future__ import annotations

import math
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

DEFAULT_BACKEND_URL = "http://127.0.0.1:8000"


class ConfigError(ValueError):
    """The configuration is invalid; the message is meant for a human."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendRole(StrEnum):
    PRIMARY = "primary"
    FIXED = "fixed"


class BackendSettings(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    url: str
    role: BackendRole = BackendRole.PRIMARY
    weight: Annotated[float, Field(gt=0)] = 1.0
    #: The URL's host is a DNS name with one address per vLLM pod (a headless
    #: Service): each address is a backend of its own, named ``<name>-<slot>``,
    #: re-resolved every ``upstream.discovery_interval_s``.
    discover: bool = False
    #: Most addresses taken from the name (slots ``<name>-0`` ... ``-<max-1>``: the
    #: backend label's values stay a bounded set).
    max_replicas: Annotated[int, Field(ge=1, le=256)] = 32
    #: Ask this backend for every guarded answer's sampled-token logprobs (chat,
    #: completions, Responses): a NaN logit is then seen exactly on every answer,
    #: not only where the client asked (``detectors.nan_logits``). What the client
    #: did not ask for is taken out again, byte for byte; the cost is in
    #: BENCHMARKS.md (vLLM computes and writes a logprob per token, and the gateway
    #: reads every event's JSON).
    ask_logprobs: bool = False
    #: Whether this vLLM keeps Responses answers (started with
    #: ``VLLM_ENABLE_RESPONSES_API_STORE=1``). A Responses stream whose client did
    #: not send ``store: false`` is released at its first token and continued only
    #: on a backend that keeps nothing: a kept answer would stay under the id the
    #: client has, degenerate. Unset: asked once per pod (a one-token answer stored,
    #: then looked up: ``gateway.upstream.responses_store``); until known, such
    #: streams are held ``adaptive``ly.
    keeps_responses: bool | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+(/.*)?$", value):
            raise ValueError(f"backend url must look like http://host:port, got {value!r}")
        return value.rstrip("/")


class TimeoutSettings(_Strict):
    connect_s: Annotated[float, Field(gt=0)] = 5.0
    #: Longest silence between two reads of an upstream response. Long generations
    #: stream tokens continuously; a non-streaming request is silent until done. A
    #: stream's silence is checked by one timer per process (``StallWatch``) and seen
    #: within 1.25 x ``read_s``; the time a slow client holds the relay up is not counted.
    read_s: Annotated[float, Field(gt=0)] = 600.0
    #: Time to wait for a free connection from the pool.
    pool_s: Annotated[float, Field(gt=0)] = 30.0


class UpstreamSettings(_Strict):
    backends: list[BackendSettings] = Field(
        default_factory=lambda: [BackendSettings(name="default", url=DEFAULT_BACKEND_URL)]
    )
    #: When set, replaces the client's Authorization header towards the backends
    #: (vLLM's --api-key). A secret: give it by environment from a Secret
    #: (VLLM_GUARD_UPSTREAM__API_KEY); never printed.
    api_key: SecretStr | None = None
    timeouts: TimeoutSettings = TimeoutSettings()
    #: Most connections to one backend (one vLLM pod), streams included; more
    #: requests wait in the gateway for one (vllm_guard_upstream_connection_wait_seconds).
    #: Size it to what one pod runs and queues: vLLM's --max-num-seqs (its default:
    #: 256, or 1024 on large GPUs) plus the requests it should queue itself. There
    #: is no cap on all backends together.
    max_connections_per_backend: Annotated[int, Field(ge=1)] = 1024
    #: An upstream connection idle this long is not used again (aiohttp's sweep closes
    #: it within about twice this long); keep it below the backend's keep-alive timeout
    #: (vLLM/uvicorn: 5 s), so that no request goes out on a connection the backend
    #: is closing. The backend may close it first: its TIME_WAIT is then the pod's.
    keepalive_s: Annotated[float, Field(gt=0)] = 4.0
    health_interval_s: Annotated[float, Field(gt=0)] = 5.0
    #: Conversation-affine routing across primaries: a backend may carry at most this
    #: multiple of its weighted share of the requests in flight before a
    #: conversation that hashes to it goes to the next backend in its ranking.
    affinity_load_factor: Annotated[float, Field(ge=1)] = 1.25
    #: Route a conversation's first attempts to one primary (false: weighted random).
    conversation_affinity: bool = True
    #: How often each backend's own /metrics is scraped (prefix-cache hit ratio).
    metrics_scrape_interval_s: Annotated[float, Field(gt=0)] = 15.0
    #: How often backends with ``discover: true`` are resolved again (pods come, go).
    discovery_interval_s: Annotated[float, Field(gt=0)] = 10.0
    #: Largest single SSE event accepted from a backend (a longer one is a 502, or an
    #: in-band error once the stream is released). vLLM's events are a few hundred bytes.
    max_sse_event_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_connections" in data:
            raise ValueError(
                "upstream.max_connections is now upstream.max_connections_per_backend: "
                "a limit per backend (vLLM pod), with no cap on all of them together"
            )
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        if not self.backends:
            raise ValueError("at least one backend is required")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {names}")
        if not any(b.role is BackendRole.PRIMARY for b in self.backends):
            raise ValueError("at least one backend must have role 'primary'")
        if sum(b.role is BackendRole.FIXED for b in self.backends) > 1:
            raise ValueError("at most one backend may have role 'fixed'")
        return self


class DetectorSettings(_Strict):
    """Thresholds of the degenerate-output detectors (see gateway.detect)."""

    #: A sampled token whose logprob is null (NaN logits) makes the answer
    #: degenerate, whatever its text: seen where the request asks for logprobs.
    nan_logits: bool = True
    punct_run: bool = True
    #: A run (whitespace between repeats allowed) of one repeated ASCII punctuation
    #: character this long is suspicious...
    punct_min_run: Annotated[int, Field(ge=2)] = 12
    #: ...and degenerate when runs of that character make up at least this share of
    #: the visible (non-space) output, or the run ends the output ("click(!!!!...").
    punct_min_share: Annotated[float, Field(gt=0, le=1)] = 0.6
    #: An output that is nothing but one repeated punctuation character is degenerate
    #: from this length on (short corrupted answers: max_tokens 8 gives "!!!!!!!!").
    #: 4, not 3: the legitimate corpus has whole answers "!!!" and "???".
    punct_min_whole: Annotated[int, Field(ge=2)] = 4
    #: A trailing run this long is degenerate whatever precedes it.
    punct_min_tail_run: Annotated[int, Field(ge=2)] = 16
    #: Characters never counted as the repeated one (markdown rules, ellipses,
    #: tables, underlines): long legitimate runs of these are common.
    punct_ignore: str = "-=_.*#~`|+/\\<>"
    #: No content (whitespace only) and no tool call: degenerate whatever the finish
    #: reason, unless there is reasoning and the finish is "length" (see below).
    empty: bool = True
    #: Empty content with reasoning and finish_reason "length" is a model that ran
    #: out of tokens while thinking, not corruption.
    empty_with_reasoning_on_length: bool = False
    repetition: bool = True
    token_loop: bool = True
    #: The output ends with one unit of up to max_unit_chars characters (containing a
    #: letter) repeated at least this many times: "the the the ...".
    token_loop_min_repeats: Annotated[int, Field(ge=4)] = 16
    token_loop_max_unit_chars: Annotated[int, Field(ge=1, le=256)] = 64
    #: One ASCII letter repeated ("ssss..."; whitespace between repeats allowed) in a
    #: run of at least letter_min_run that makes up letter_min_share of the visible
    #: output. Base64 padding and "AAAA" test data inside an answer stay below the
    #: share (the legitimate corpus's longest: 80 of 104 characters, 0.77). While a
    #: stream is still running the run must be 4 x letter_min_run long: what follows
    #: could still dilute it.
    letter_run: bool = True
    letter_min_run: Annotated[int, Field(ge=8)] = 64
    letter_min_share: Annotated[float, Field(gt=0, le=1)] = 0.9
    malformed_tool_call: bool = True
    #: Leaked tokenizer artifacts (<unk>, <pad>, [PAD], <0x00>, <|endoftext|>, U+FFFD):
    #: a run of at least special_min_run of them (whitespace between allowed) that
    #: makes up special_min_share of the visible output or ends it with at least
    #: special_min_tail_run, or an output of nothing but them. One mention is fine.
    special_tokens: bool = True
    special_min_run: Annotated[int, Field(ge=2)] = 4
    special_min_share: Annotated[float, Field(gt=0, le=1)] = 0.6
    special_min_tail_run: Annotated[int, Field(ge=2)] = 16
    #: Extra regular expressions; a match anywhere in a choice's text is degenerate.
    deny_patterns: list[str] = Field(default_factory=list)

    @field_validator("deny_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"deny pattern {pattern!r} is not a valid regex: {exc}") from exc
        return patterns


class GuardMode(StrEnum):
    ENFORCE = "enforce"  # detect, retry, apply the exhausted policy
    OBSERVE = "observe"  # detect and count, never retry
    OFF = "off"  # plain proxy


class ExhaustedPolicy(StrEnum):
    DELIVER = "deliver"
    ERROR = "error"


class RetryTarget(StrEnum):
    SAME = "same"
    FIXED = "fixed"


class AfterRelease(StrEnum):
    """What happens to a released stream that degenerates (docs/guard.md, "Streams")."""

    #: Its unsettled end is held back and, when it turns degenerate, dropped and the
    #: answer continued from the text the client has (a fresh salt); where the answer
    #: cannot be continued, as ``pass``.
    CONTINUE = "continue"
    #: Relayed as it comes, and counted.
    PASS = "pass"
    #: Ended with an in-band error event.
    CUT = "cut"


class RetryBudgetSettings(_Strict):
    """Bounds retries that do not help; never the ones that recover (gateway.guard.budget)."""

    #: Retries are "recovering" while at least this share of recent retries came back
    #: clean; they then run up to max_attempts, however many arrive at once...
    min_recovery_ratio: Annotated[float, Field(ge=0, le=1)] = 0.2
    #: ...or while fewer than this many recent retries failed (nothing to judge yet).
    min_failed: Annotated[float, Field(ge=1)] = 3.0
    #: When retries are not recovering, useless retries (failed, or in flight) in the
    #: window may be at most this fraction of the requests in the window...
    ratio: Annotated[float, Field(ge=0)] = 0.2
    #: ...plus this many per second of window, so a quiet server can still recover.
    min_per_second: Annotated[float, Field(ge=0)] = 1.0
    #: Time constant of the decaying "recent" counts, in seconds.
    window_s: Annotated[float, Field(gt=0)] = 10.0
    #: Largest share of that allowance one client (API key, or address) may hold.
    client_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    #: Clients remembered (LRU); one that falls out starts afresh.
    max_clients: Annotated[int, Field(ge=1)] = 10_000


class SaltReuseSettings(_Strict):
    enabled: bool = True
    #: Also send later first attempts of a conversation with its known-clean salt,
    #: so they stay away from a chain known to be poisoned.
    on_first_attempt: bool = True
    #: How many leading messages (or prompt characters for completions) identify
    #: a conversation.
    fingerprint_messages: Annotated[int, Field(ge=1)] = 2
    fingerprint_prompt_chars: Annotated[int, Field(ge=16)] = 2048
    max_entries: Annotated[int, Field(ge=1)] = 100_000
    ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    #: Secret key of the retry-salt ladder (gateway.guard.salt). Give every worker and
    #: replica the same one (VLLM_GUARD_GUARD__SALT_REUSE__KEY) so they compute the
    #: same salts for a conversation; unset, each process draws its own.
    key: SecretStr | None = None


class ReleasePolicy(StrEnum):
    """When a held stream is released (docs/guard.md, "Streams")."""

    #: Once the text is clearly healthy: at least min_release_chars visible
    #: characters that no longer fit any degenerate pattern.
    ADAPTIVE = "adaptive"
    #: At the first visible token that cannot start one of the bug's own signatures
    #: (a run of punctuation, an empty answer, leaked tokenizer artifacts); longer
    #: patterns (loops) are left to the after-release policy.
    FIRST_TOKEN = "first_token"
    #: ``first_token`` where a corruption after release is recovered by continuing
    #: the answer (``after_release: continue``, an API and a request that can be
    #: continued, an answer that starts with content), ``adaptive`` elsewhere.
    AUTO = "auto"


class StreamSettings(_Strict):
    """The adaptive hold-back (docs/guard.md, "Streams"): a stream's first byte is released
    as soon as its held text is clearly healthy, and held while it is still
    consistent with a degenerate pattern, up to a ceiling."""

    #: Visible characters a stream must show before it can be released...
    min_release_chars: Annotated[int, Field(ge=1)] = 20
    #: ...and the ceiling: held at most this many visible characters, then judged.
    #: null: large enough for every detector to decide (token_loop_min_repeats x
    #: token_loop_max_unit_chars). 0 disables hold-back (streams are then only
    #: inspected and counted).
    holdback_chars: Annotated[int, Field(ge=0)] | None = None
    release: ReleasePolicy = ReleasePolicy.AUTO
    after_release: AfterRelease = AfterRelease.CONTINUE


class ModelSettings(_Strict):
    """Per-model overrides; unset fields inherit the global ones."""

    detectors: DetectorSettings | None = None
    holdback_chars: Annotated[int, Field(ge=0)] | None = None
    release: ReleasePolicy | None = None


class GuardSettings(_Strict):
    mode: GuardMode = GuardMode.ENFORCE
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    on_exhausted: ExhaustedPolicy = ExhaustedPolicy.DELIVER
    retry_target: RetryTarget = RetryTarget.SAME
    #: Share of first attempts sent to the "fixed" backend (0..1).
    canary_weight: Annotated[float, Field(ge=0, le=1)] = 0.0
    budget: RetryBudgetSettings = RetryBudgetSettings()
    salt_reuse: SaltReuseSettings = SaltReuseSettings()
    stream: StreamSettings = StreamSettings()
    detectors: DetectorSettings = DetectorSettings()


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may run on: its affinity, capped by its cgroup's CPU
    quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), rounded up; at least 1. Python's
    ``os.cpu_count`` sees the host's cores, not a container's limit."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_cpu_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time a period the cgroup may use; None where unlimited or unknown."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]  # v2: "max 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 unlimited
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


class ServerSettings(_Strict):
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    #: Serving processes, or "auto": one per CPU this process may use (its CPU
    #: affinity, and its cgroup's CPU limit rounded up: a container limited to 2 CPUs
    #: runs 2; with no limit, every core of the host). One worker carries about 5,000
    #: streamed tokens a second within 2% of direct (docs/deployment.md); a burst of
    #: new requests is set up one after another in a worker, so more workers also
    #: shorten the queue of a burst.
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    #: With workers > 1 (Linux): each worker listens on a socket of its own
    #: (SO_REUSEPORT) and the kernel spreads new connections evenly, where uvicorn's
    #: one shared socket lets the first worker to wake take most of a burst (58 of 64).
    #: The price: a worker whose loop stalls keeps getting its share of new
    #: connections, and a worker that exits resets the connections still queued for
    #: it unless net.ipv4.tcp_migrate_req is 1 (docs/deployment.md). Off: uvicorn's.
    reuse_port: bool = False
    max_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    #: Total size of a request's headers, enforced while they arrive; larger gets 431.
    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    #: A connection must finish sending a request head this long after it opened (or
    #: after its last response); else it is closed (408 if it had started one).
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    #: ...and a request body this long after its head; else it is closed. Both are
    #: checked by one sweep per worker, every quarter of the shorter (at most 1 s).
    body_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    #: Open client connections per worker; past it, new requests get a 503 in OpenAI's
    #: shape. null: half the open-file limit (the rest is for upstream connections).
    max_connections: Annotated[int, Field(ge=1)] | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    #: "text" (human), or "json": one JSON object per line with the request id.
    log_format: Literal["text", "json"] = "text"
    #: One line per request (method, path, status, duration, request id) on the
    #: ``vllm_guard.access`` logger, in ``log_format``. Off: the guard already logs
    #: every request that was not plainly clean.
    access_log: bool = False
    #: vLLM's administrative endpoints (/reset_prefix_cache, /sleep, /collective_rpc,
    #: /v1/load_lora_adapter, ...) and unguarded ways into its generation handlers
    #: (/invocations, /v1/chat/completions/batch) are refused; list here the ones the
    #: gateway should proxy anyway (to whoever may call the gateway).
    allow_vllm_paths: list[str] = Field(default_factory=list)
    #: On SIGTERM: stop accepting, let in-flight requests (streams) finish this long
    #: (fractions of a second count; 0: none), then end them in-band.
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    #: Load balancers and ingress proxies in front of the gateway (addresses or CIDRs).
    #: A request from one of them is counted, for the retry budget's per-client fair
    #: share, as coming from the address it names in X-Forwarded-For (the nearest one
    #: that is not itself a trusted proxy); behind a proxy not listed, every client
    #: is that proxy. Not needed when client API keys are checked (auth).
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=list)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_auto(cls, value: object) -> object:
        return min(usable_cpus(), 64) if value == "auto" else value


_SHA256_HEX = r"^[0-9a-f]{64}$"
KeyHashes = list[Annotated[str, Field(pattern=_SHA256_HEX)]]


class AuthSettings(_Strict):
    #: SHA-256 hex digests of the client API keys (``vllm-guard hash-key``). When set,
    #: every route but /healthz, /readyz and /metrics needs ``Authorization: Bearer KEY``,
    #: and the client's key is never forwarded upstream (use upstream.api_key).
    api_key_sha256: KeyHashes = Field(default_factory=list)


class MetricsSettings(_Strict):
    enabled: bool = True
    #: Where multiprocess-mode files go when workers > 1: the gateway creates its own
    #: fresh subdirectory there (and removes only that). Default: the temp dir.
    multiproc_dir: str | None = None
    #: Serve /metrics on this separate port (and address) instead of the main one.
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    host: str = "127.0.0.1"
    #: SHA-256 hex digests of keys allowed to read /metrics (empty: no key needed).
    api_key_sha256: KeyHashes = Field(default_factory=list)

    @field_validator("multiproc_dir")
    @classmethod
    def _not_a_system_directory(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("/"):
            raise ValueError(f"multiproc_dir must be an absolute path, got {value!r}")
        normalised = "/" + "/".join(p for p in value.split("/") if p and p != ".")
        if normalised in _SYSTEM_DIRECTORIES or ".." in value.split("/"):
            raise ValueError(
                f"multiproc_dir {value!r} is a system directory; use a directory of its own "
                "(e.g. /tmp/vllm-guard-metrics)"
            )
        return value


_SYSTEM_DIRECTORIES = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/proc", "/root",
     "/run", "/sbin", "/sys", "/usr", "/var"}
)  # fmt: skip


class EvidenceSettings(_Strict):
    """Opt-in capture of degenerate attempts, for upstream bug reports."""

    enabled: bool = False
    #: Under /tmp: writable under a read-only root filesystem (the Deployment mounts
    #: an emptyDir there); mount a volume and point this at it to keep evidence.
    path: str = "/tmp/vllm-guard/evidence.jsonl"  # noqa: S108 (a writable default, see above)
    max_bytes: Annotated[int, Field(ge=4096)] = 50 * 1024 * 1024
    backups: Annotated[int, Field(ge=0, le=100)] = 5
    #: Also store the prompt text (otherwise only its fingerprint and token counts).
    include_prompt: bool = False
    max_output_chars: Annotated[int, Field(ge=16)] = 2000


class StateSettings(_Strict):
    """Conversation memory shared by every worker and replica (docs/state.md)."""

    #: redis://[:password@]host:port/db (or rediss://, Valkey alike); null: each
    #: process keeps its own memory. From a secret: VLLM_GUARD_STATE__REDIS_URL.
    redis_url: SecretStr | None = None
    #: Longest wait for one lookup before the request goes on with local memory.
    lookup_timeout_ms: Annotated[float, Field(gt=0, le=1000)] = 5.0
    #: Prefix of every key the gateway writes (several deployments, one Redis).
    key_prefix: str = "vllm-guard:"
    #: After a failure, how often the connection is tried again in the background.
    reconnect_s: Annotated[float, Field(gt=0)] = 5.0

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: SecretStr | None) -> SecretStr | None:
        if url is None or not url.get_secret_value():
            return None  # an empty value (an optional Secret left blank): not shared
        if not url.get_secret_value().startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("state.redis_url must start with redis://, rediss:// or unix://")
        return url


class TracingSettings(_Strict):
    """OpenTelemetry traces (docs/metrics.md, "Traces"): a span per request and one per
    attempt, exported over OTLP. Where to and how is the SDK's standard environment:
    ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``/``_PROTOCOL``/``_HEADERS``, sampling by
    ``OTEL_TRACES_SAMPLER``/``_ARG``, the service by ``OTEL_SERVICE_NAME``."""

    #: Off: the OpenTelemetry packages are not even imported (the ``tracing`` extra
    #: need not be installed), and the request path costs one ``None`` check.
    enabled: bool = False
    #: Export the whole trace of a request that was retried, failed over or continued
    #: after release, even where the sampler (``OTEL_TRACES_SAMPLER``) left it out:
    #: every span is then recorded, and the unsampled ones dropped at their request's
    #: end unless it needed a second attempt (the CPU of recording them is paid).
    keep_retried: bool = True


class _EnvironmentSource(EnvSettingsSource):
    """The environment, where a list may also be given comma-separated
    (``VLLM_GUARD_AUTH__API_KEY_SHA256=<hash>,<hash>``) as well as in JSON."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            # ``field`` is None for a value inside a dict (pydantic-settings passes it).
            if get_origin(getattr(field, "annotation", None)) is not list:
                raise
            return [item.strip() for item in str(value).split(",") if item.strip()]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, env_prefix="VLLM_GUARD_", env_nested_delimiter="__"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _EnvironmentSource(settings_cls)

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    guard: GuardSettings = GuardSettings()
    auth: AuthSettings = AuthSettings()
    metrics: MetricsSettings = MetricsSettings()
    evidence: EvidenceSettings = EvidenceSettings()
    state: StateSettings = StateSettings()
    tracing: TracingSettings = TracingSettings()
    #: Model name -> overrides. Also the bounded set of model label values.
    models: dict[str, ModelSettings] = Field(default_factory=dict)

    def warnings(self) -> list[str]:
        """Settings that are valid but do nothing as configured."""
        out = []
        has_fixed = any(b.role is BackendRole.FIXED for b in self.upstream.backends)
        if self.guard.retry_target is RetryTarget.FIXED and not has_fixed:
            out.append(
                "guard.retry_target is 'fixed' but no backend has role 'fixed': retries "
                "stay on the same backend"
            )
        if self.guard.canary_weight > 0 and not has_fixed:
            out.append(
                "guard.canary_weight is set but no backend has role 'fixed': no first "
                "attempt goes anywhere else"
            )
        if self.guard.mode is not GuardMode.ENFORCE and self.guard.on_exhausted is (
            ExhaustedPolicy.ERROR
        ):
            out.append(
                f"guard.on_exhausted 'error' applies in enforce mode only (mode is "
                f"'{self.guard.mode}')"
            )
        return out

    def detectors_for(self, model: str) -> DetectorSettings:
        override = self.models.get(model)
        if override is not None and override.detectors is not None:
            return override.detectors
        return self.guard.detectors

    def release_for(self, model: str | None) -> ReleasePolicy:
        override = self.models.get(model) if model is not None else None
        if override is not None and override.release is not None:
            return override.release
        return self.guard.stream.release

    def holdback_for(self, model: str | None) -> int:
        """The hold-back ceiling for ``model``, in visible characters (0: off)."""
        override = self.models.get(model) if model is not None else None
        if override is not None and override.holdback_chars is not None:
            return override.holdback_chars
        if self.guard.stream.holdback_chars is not None:
            return self.guard.stream.holdback_chars
        d = self.detectors_for(model) if model is not None else self.guard.detectors
        return max(
            self.guard.stream.min_release_chars,
            d.punct_min_tail_run,
            d.special_min_tail_run * 8,
            d.token_loop_min_repeats * d.token_loop_max_unit_chars,
        )


def _settings_class(file_data: dict[str, Any]) -> type[Settings]:
    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # Settings' own sources (the arguments, then the environment), then the file.
            own = super().settings_customise_sources(
                settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
            )
            return (*own, InitSettingsSource(settings_cls, file_data))

    return _Loaded


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown setting (check the spelling against config/vllm-guard.yaml)"
        source = _environment_variable_for(error["loc"])
        if source is not None:
            where += f" (from the environment variable {source})"
        lines.append(f"  {where}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def _environment_variable_for(loc: tuple[int | str, ...]) -> str | None:
    """The VLLM_GUARD_* variable that set the value at ``loc``, if one did."""
    import os

    for depth in range(len(loc), 0, -1):
        parts = [str(p) for p in loc[:depth] if isinstance(p, str)]
        name = "VLLM_GUARD_" + "__".join(parts).upper()
        if parts and name in os.environ:
            return name
    return None


def load_settings(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> Settings:
    """Load and validate settings; raise ConfigError with a readable message."""
    file_data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        file_data = loaded
    init = _deep_merge({}, overrides or {})
    try:
        loaded = _settings_class(file_data)(**init)
        # A plain Settings (not the per-call loader subclass), so settings compare equal.
        return Settings.model_validate(loaded.model_dump())
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except SettingsError as exc:  # a value the environment source could not decode
        raise ConfigError(_describe_environment_error(exc)) from None


def _describe_environment_error(exc: SettingsError) -> str:
    """pydantic-settings names the field, not the variable: name the variables that
    set it (``error parsing value for field "auth" from source ...``)."""
    field = str(exc).split('"')[1] if str(exc).count('"') >= 2 else ""
    prefix = f"VLLM_GUARD_{field.upper()}"
    names = sorted(n for n in os.environ if n == prefix or n.startswith(prefix + "__"))
    where = ", ".join(names) or "a VLLM_GUARD_* variable"
    return (
        f"invalid configuration:\n  {where}: cannot parse the value (a list takes JSON, "
        f'like ["a", "b"], or comma-separated values)'
    )


#: The path of the file that holds the settings ``vllm-guard serve`` resolved (file,
#: environment, flags) as JSON, secrets included, for the process and each worker it
#: starts: only its owner may read it (``gateway.cli.settings_for_workers``). The
#: environment, which ``/proc/<pid>/environ`` shows and child processes inherit,
#: carries the path, never the secrets.
RESOLVED_SETTINGS_FILE_ENV = "VLLM_GUARD_RESOLVED_SETTINGS_FILE"


def settings_from_environment() -> Settings:
    """This process's settings: those the CLI resolved, else the file named by
    ``VLLM_GUARD_CONFIG`` (or the defaults) with the environment applied."""
    resolved = os.environ.get(RESOLVED_SETTINGS_FILE_ENV)
    if resolved:
        return Settings.model_validate_json(Path(resolved).read_bytes())
    return load_settings(os.environ.get("VLLM_GUARD_CONFIG"))
