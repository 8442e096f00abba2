"""Backend pool: selection, health, the HTTP transport, and upstream error mapping.

The transport is aiohttp: httpx's default transport collapsed under concurrency
where aiohttp held (BENCHMARKS.md, issue #10). Everything upstream goes through
``Backend.open``, which maps every transport failure onto the GatewayError tree in
one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict
from pydantic import SecretStr
from yarl import URL

from gateway.apis import ADAPTERS
from gateway.config import BackendRole, BackendSettings, RetryTarget, UpstreamSettings
from gateway.errors import (
    BackendUnreachable,
    GatewayError,
    NoHealthyBackend,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.periodic import Periodic
from gateway.upstream import discovery
from gateway.upstream.discovery import DiscoveredBackends

log = logging.getLogger(__name__)


def _read_timer_hook_present() -> bool:
    """aiohttp's connection protocol keeps a per-read ``sock_read`` timer that it
    cancels and re-arms on every network read; ``ResponseHandler.read_timeout`` (a
    settable property) and ``start_timeout`` let a stream drop it. Both are aiohttp
    internals (3.9-3.14 have them): checked once here, the only place they are used."""
    try:
        from aiohttp.client_proto import ResponseHandler
    except ImportError:
        return False
    read_timeout = getattr(ResponseHandler, "read_timeout", None)
    return (
        isinstance(read_timeout, property)
        and read_timeout.fset is not None
        and callable(getattr(ResponseHandler, "start_timeout", None))
    )


READ_TIMER_HOOK = _read_timer_hook_present()


def drop_read_timer(response: aiohttp.ClientResponse) -> bool:
    """Stop aiohttp's per-read timer on the response's connection (the caller times
    the stream's silence itself); False, with aiohttp's timer left running (the public
    ``sock_read`` timeout), where the installed aiohttp has no hook for it."""
    connection = response.connection
    if not READ_TIMER_HOOK or connection is None or connection.protocol is None:
        return False
    connection.protocol.read_timeout = None
    connection.protocol.start_timeout()  # re-arms with None: drops the pending one
    return True


#: RFC 9110 9.2.2: methods whose repetition has the effect of one request.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})

#: The paths guarded requests are sent to (a bounded set: their URLs are kept parsed).
GUARDED_UPSTREAM_PATHS = frozenset(ADAPTERS)

#: RFC 9110 hop-by-hop headers plus those the transport recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


@dataclass(slots=True, eq=False)
class Backend:
    settings: BackendSettings
    #: Pooled keep-alive connections: client traffic.
    session: aiohttp.ClientSession
    #: A new connection per request, never pooled: health probes, metrics scrapes,
    #: and the resend after a pooled connection turned out dead. A probe every few
    #: seconds would otherwise leave an idle connection in the pool, which the
    #: backend may close (its keep-alive is 5 s) just as a request picks it up.
    fresh_session: aiohttp.ClientSession
    healthy: bool = True
    failed_probes: int = 0
    #: Guarded requests this process has working on this backend right now.
    in_flight: int = 0
    #: Parsed URLs of the guarded paths on this backend (``_url``).
    parsed_urls: dict[str, URL] = field(default_factory=dict)
    #: Whether this vLLM keeps Responses answers under their ids (its store is on):
    #: the operator's ``keeps_responses``, else learned once by the scrape
    #: (``gateway.upstream.responses_store``); None while not known.
    keeps_responses: bool | None = None
    #: ``host:port`` of the URL: the metrics' ``backend_address`` label (``backend_address``).
    address: str = field(init=False)

    #: A discovered pod that left the pool: requests under way finish, and nothing
    #: writes its per-pod series again (``Metrics.forget_backend`` removed them).
    departed: bool = False

    def __post_init__(self) -> None:
        self.address = backend_address(self.settings.url)
        self.keeps_responses = self.settings.keeps_responses

    @property
    def series_address(self) -> str | None:
        """The ``backend_address`` its per-pod series are written under; None once it
        departed."""
        return None if self.departed else self.address

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def identity(self) -> str:
        """What conversation affinity hashes: the backend's URL, which names the pod
        (a discovered pod's address) the same in every replica and worker, whatever
        order each found the pods in. The name is not: a discovered pod's slot
        (``vllm-0``) depends on the discovery history of the process. Metrics name it
        by ``address``, the same pod's ``host:port``."""
        return self.settings.url

    def mark(self, healthy: bool) -> None:
        if healthy != self.healthy:
            log.warning(
                "backend %s is now %s", self.name, "healthy" if healthy else "out of rotation"
            )
            self.healthy = healthy

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes | AsyncIterator[bytes] | None,
        params: str = "",
        on_resend: Callable[[], None] | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request and return the response with its body still unread.

        A request is sent once, unless sending it again is harmless: a pooled
        keep-alive connection that turns out closed gets an idempotent request (GET,
        HEAD, ...) with a replayable body sent once more, on a new connection
        (``on_resend`` is told). Anything else, a generation above all, is not: the
        backend may have read it (a load balancer's idle timeout cutting a long
        generation looks the same as a keep-alive close), and a resend would make
        vLLM generate it, or store a ``store: true`` answer, twice. Idle pooled
        connections are closed before the backend's keep-alive ends
        (``upstream.keepalive_s``), so that close rarely meets a request.
        """
        url = self._url(path, params)
        try:
            try:
                return await self.session.request(
                    method,
                    url,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    trace_request_ctx=self,
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if (
                    method not in IDEMPOTENT_METHODS
                    or not isinstance(body, bytes | None)  # a streamed body cannot be replayed
                    or isinstance(exc, aiohttp.ClientConnectorError)  # a new connection failed
                ):
                    raise
                log.info(
                    "backend %s closed a connection (%r); resending %s once", self.name, exc, method
                )
                if on_resend is not None:
                    on_resend()
                return await self.fresh_session.request(
                    method, url, headers=headers, data=body, allow_redirects=False
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise transport_error(self, exc) from exc

    def _url(self, path: str, params: str) -> URL:
        """The backend URL of a request; parsed once per path for the guarded paths
        (aiohttp would parse the string on every request)."""
        if params or path not in GUARDED_UPSTREAM_PATHS:
            return URL(self.url + path + (f"?{params}" if params else ""))
        url = self.parsed_urls.get(path)
        if url is None:
            url = self.parsed_urls[path] = URL(self.url + path)
        return url

    async def tokenize(
        self, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> list[int] | None:
        """vLLM's ``/tokenize`` of ``body`` (a prompt, or chat messages rendered by the
        model's template): the token ids, or None where the backend cannot say."""
        answer = await self.ask_json("/tokenize", body, headers)
        tokens = answer.get("tokens") if answer is not None else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens

    async def ask_json(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout_s: float = 5.0,
    ) -> dict[str, Any] | None:
        """A small JSON request to the backend beside a generation (a continuation's
        token counts): the JSON object it answers with 200, else None."""
        sent = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        sent["Content-Type"] = "application/json"  # the session adds none of its own
        try:
            async with self.session.post(
                self.url + path,
                data=orjson.dumps(body),
                headers=sent,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                answer = await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None

    async def probe_health(self, timeout_s: float) -> bool:
        try:
            async with self.fresh_session.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False


def backend_address(url: str) -> str:
    """The ``backend_address`` label of a backend at ``url``: ``host:port`` (the scheme's
    default port when the URL names none; an IPv6 host in brackets), as routing's
    identity (the URL) names it. A discovered pod's is its own address and port, the
    same in every replica whatever slot it holds there, and what a PodMonitor's
    ``__address__`` is for that pod; a configured backend's is its URL's."""
    parsed = URL(url)
    host = parsed.host or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parsed.port}" if parsed.port is not None else host


@contextlib.contextmanager
def map_transport_errors(backend: Backend) -> Iterator[None]:
    """Translate transport exceptions into GatewayErrors, once, for every caller."""
    try:
        yield
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise transport_error(backend, exc) from exc


def transport_error(backend: Backend, exc: TimeoutError | aiohttp.ClientError) -> GatewayError:
    """The GatewayError for a transport exception (``map_transport_errors``, or a hot
    loop's own ``except`` where a context manager per read would cost too much)."""
    error = _transport_error(backend, exc)
    # aiohttp raises these only while it opens a connection (ConnectionTimeoutError:
    # waiting for a pool slot or the TCP handshake): the request was never written.
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        error.may_have_reached_backend = False
    return error


def _transport_error(backend: Backend, exc: TimeoutError | aiohttp.ClientError) -> GatewayError:
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(f"backend {backend.name} did not answer in time")
    if isinstance(exc, aiohttp.ClientConnectorError):
        backend.mark(False)
        return BackendUnreachable(f"backend {backend.name} is unreachable")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return BackendUnreachable(f"backend {backend.name} closed the connection")
    if isinstance(exc, aiohttp.ClientPayloadError):
        # The body broke off (the backend died mid-response): the request reached it,
        # so it is not sent again; after release the stream ends in-band.
        return BackendUnreachable(f"backend {backend.name} broke off its response")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"backend {backend.name} sent an invalid response")
    return BackendUnreachable(f"backend {backend.name} request failed")


def new_session(
    settings: UpstreamSettings,
    *,
    pooled: bool = True,
    trace_configs: list[aiohttp.TraceConfig] | None = None,
) -> aiohttp.ClientSession:
    timeouts = settings.timeouts
    # Below uvicorn's (vLLM's server) 5 s keep-alive, so the gateway never sends on an
    # idle connection the backend is closing (aiohttp's connector does not reuse one
    # idle longer; its sweep closes it within about twice that).
    keepalive: dict[str, Any] = (
        {"keepalive_timeout": settings.keepalive_s} if pooled else {"force_close": True}
    )
    connector = aiohttp.TCPConnector(
        # Per pod (a pod is a host: its address), none for all together: a cap on the
        # whole fleet made requests queue in the gateway while pods had room.
        limit=0,
        limit_per_host=settings.max_connections_per_backend,
        ttl_dns_cache=300,
        enable_cleanup_closed=True,
        **keepalive,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.pool_s + timeouts.connect_s,
            sock_connect=timeouts.connect_s,
            sock_read=timeouts.read_s,
        ),
        auto_decompress=False,
        # One pool serves every client: a cookie a backend (or a sticky-session
        # balancer before it) sets for one client must not ride along on the next.
        # Cookies still pass through as headers, both ways.
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        read_bufsize=2**16,
        trace_configs=trace_configs,
    )


class BackendPool:
    """Named backends with roles; weighted choice among the healthy ones."""

    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        #: Told how long each request waited for a connection to its backend (name,
        #: seconds): set by the server once its metrics exist.
        self.on_connection_wait: Callable[[str, float], None] | None = None
        self.session = new_session(settings, trace_configs=[self._connection_wait_trace()])
        self.fresh_session = new_session(settings, pooled=False)
        self.backends = [
            Backend(b, self.session, self.fresh_session)
            for b in settings.backends
            if not b.discover
        ]
        #: Backends found by DNS (``discover: true``), each address in its slot.
        self.discovered = [DiscoveredBackends(b) for b in settings.backends if b.discover]
        self._members: dict[tuple[int, str], Backend] = {}
        #: Called for each departed backend once it has left the pool: its name, its
        #: address (``Backend.address``), and whether its slot (the name) is already
        #: taken by a pod that joined in the same resolution.
        self.on_departed: list[Callable[[str, str, bool], None]] = []
        self._index()
        self._health = Periodic(settings.health_interval_s, self.check_all, "health check")
        self._discovery = Periodic(settings.discovery_interval_s, self.discover, "discovery")

    def _connection_wait_trace(self) -> aiohttp.TraceConfig:
        """aiohttp's public tracing: a request that finds every connection to its backend
        taken waits in the connector's queue (``upstream.max_connections_per_backend``).
        Its wait (0 for most) is told to ``on_connection_wait`` when it gets a
        connection: a pooled one, or a new one."""
        trace = aiohttp.TraceConfig()

        async def queued(_: object, context: Any, __: object) -> None:
            context.queued_at = asyncio.get_running_loop().time()

        async def connected(_: object, context: Any, __: object) -> None:
            backend = context.trace_request_ctx
            if self.on_connection_wait is None or not isinstance(backend, Backend):
                return
            queued_at = getattr(context, "queued_at", None)
            now = asyncio.get_running_loop().time() if queued_at is not None else 0.0
            self.on_connection_wait(backend.name, 0.0 if queued_at is None else now - queued_at)

        trace.on_connection_queued_start.append(queued)
        trace.on_connection_reuseconn.append(connected)
        trace.on_connection_create_end.append(connected)
        return trace

    def _index(self) -> None:
        self.primaries = [b for b in self.backends if b.settings.role is BackendRole.PRIMARY]
        self.fixed = next((b for b in self.backends if b.settings.role is BackendRole.FIXED), None)

    @property
    def probe_timeout_s(self) -> float:
        """How long a health probe or metrics scrape of one backend may take: a loaded
        vLLM can answer /health slowly, so the connect budget twice over."""
        return self.settings.timeouts.connect_s * 2

    @property
    def conversation_affine(self) -> bool:
        """Several primaries: first attempts follow the conversation (rendezvous)."""
        return self.settings.conversation_affinity and len(self.primaries) > 1

    async def discover(self) -> None:
        """Resolve every ``discover: true`` backend's name again: new addresses join
        (probed first), departed ones leave; a name that does not resolve keeps its set."""
        for group, found in enumerate(self.discovered):
            change = await found.resolve(discovery.resolve_addresses)
            if change is None:
                continue
            joined, departed = change
            gone: list[Backend] = []
            for address in departed:
                backend = self._members.pop((group, address))
                gone.append(backend)
                backend.healthy = False  # requests under way finish; no new ones
                backend.departed = True
                self.backends.remove(backend)
                log.warning("backend %s (%s) left: its address is gone", backend.name, address)
            for address, slot in joined.items():
                backend = Backend(
                    found.backend_settings(address, slot), self.session, self.fresh_session
                )
                backend.healthy = await backend.probe_health(self.probe_timeout_s)
                self._members[(group, address)] = backend
                self.backends.append(backend)
                state = "healthy" if backend.healthy else "not healthy yet"
                log.warning(
                    "backend %s (%s) joined from %s (%s)", backend.name, address, found.host, state
                )
            self._index()
            taken = {b.name for b in self.backends}
            for backend in gone:
                for hook in self.on_departed:
                    # a slot taken again keeps its per-slot series (its new pod's)
                    hook(backend.name, backend.address, backend.name in taken)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def healthy_with_identity(self, identity: str | None) -> Backend | None:
        """The backend known by that identity (``Backend.identity``), if it is in the
        pool and healthy."""
        return next((b for b in self.backends if b.identity == identity and b.healthy), None)

    async def first_holding(
        self, path: str, headers: Mapping[str, str]
    ) -> tuple[Backend | None, bool]:
        """The healthy backend that answers ``GET path`` with 200, asked all at once:
        where a stored answer lives when nobody remembers (vLLM answers 404 for an
        answer it does not hold); and whether every one asked said 404 (a 5xx, a
        timeout or a lost connection says nothing: that pod may hold it). A GET is
        harmless to repeat; the request it is for is sent once, to the backend found."""
        candidates = [b for b in self.backends if b.healthy]
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)

        async def status(backend: Backend) -> int:
            try:
                async with self.session.get(
                    backend.url + path, headers=headers, timeout=timeout, allow_redirects=False
                ) as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                return 0

        statuses = await asyncio.gather(*(status(b) for b in candidates))
        found = next((b for b, s in zip(candidates, statuses, strict=True) if s == 200), None)
        return found, all(s == 404 for s in statuses)

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def choose_first(
        self, canary_weight: float, rng: random.Random, affinity: str | None = None
    ) -> Backend:
        """The backend for a first attempt: the canary share goes to the fixed backend;
        the rest to a primary, by conversation (``affinity``) when there is one, so a
        conversation's turns reuse one replica's prefix cache."""
        fixed = self.fixed
        use_canary = canary_weight > 0 and rng.random() < canary_weight
        if fixed is not None and fixed.healthy and use_canary:
            return fixed
        if affinity is not None:
            chosen = self._by_affinity(affinity)
            if chosen is not None:
                return chosen
        return self._weighted(self.primaries, rng, exclude=None)

    def _by_affinity(self, key: str) -> Backend | None:
        """Weighted rendezvous hashing over the healthy primaries, with bounded load.

        Each backend scores ``-weight / ln(u)`` with ``u`` uniform from a hash of (key,
        ``Backend.identity``): the highest score wins, in proportion to the weights, and when
        a backend leaves or rejoins only the conversations it wins move. A backend
        already carrying more than ``affinity_load_factor`` x its weighted share of
        the requests in flight is passed over for the next in the ranking, so a
        skewed mix cannot pile onto one replica."""
        healthy = [b for b in self.primaries if b.healthy]
        if len(healthy) < 2:
            return healthy[0] if healthy else None
        ranked = sorted(healthy, key=lambda b: _rendezvous_score(key, b), reverse=True)
        total_weight = sum(b.settings.weight for b in healthy)
        in_flight = sum(b.in_flight for b in healthy) + 1
        factor = self.settings.affinity_load_factor
        for backend in ranked:
            share = backend.settings.weight / total_weight
            if backend.in_flight + 1 <= max(1.0, math.ceil(factor * share * in_flight)):
                return backend
        return ranked[0]

    def choose_retry(
        self, previous: Backend, target: RetryTarget, rng: random.Random, *, failover: bool
    ) -> Backend:
        """Backend for the next attempt. A failover avoids the backend that just failed;
        a retry of a degenerate answer stays on the backend that gave it while it is
        healthy, and goes back to it when no other is (it has just answered)."""
        fixed = self.fixed
        if (
            target is RetryTarget.FIXED
            and fixed is not None
            and fixed.healthy
            and not (failover and fixed is previous)
        ):
            return fixed
        if not failover and previous.healthy:
            return previous
        try:
            return self._weighted(self.backends, rng, exclude=previous)
        except NoHealthyBackend:
            if failover:
                raise
            return previous

    def _weighted(
        self, candidates: list[Backend], rng: random.Random, exclude: Backend | None
    ) -> Backend:
        healthy = [b for b in candidates if b.healthy and b is not exclude]
        if not healthy:
            healthy = [b for b in self.backends if b.healthy and b is not exclude]
        if not healthy:
            raise NoHealthyBackend("no healthy backend is available")
        if len(healthy) == 1:
            return healthy[0]
        return rng.choices(healthy, weights=[b.settings.weight for b in healthy])[0]

    async def check_all(self, *, initial: bool = False) -> None:
        # A backend leaves only after two failed probes in a row (a refused
        # connection during a request takes it out at once).
        # Discovery may change the list while the probes are out: the results belong
        # to the backends probed, and one that left meanwhile is not marked.
        probed = list(self.backends)
        timeout = self.probe_timeout_s
        results = await asyncio.gather(*(b.probe_health(timeout) for b in probed))
        current = {id(b) for b in self.backends}
        for backend, ok in zip(probed, results, strict=True):
            if id(backend) not in current:
                continue
            if ok:
                backend.failed_probes = 0
                backend.mark(True)
            else:
                backend.failed_probes += 1
                if initial or backend.failed_probes >= 2 or not backend.healthy:
                    backend.mark(False)

    def start(self) -> None:
        self._health.start()
        if self.discovered:
            self._discovery.start()

    async def stop(self) -> None:
        await self._discovery.stop()
        await self._health.stop()
        await self.session.close()
        await self.fresh_session.close()


#: Raw header pairs in order, repeats kept (ASGI's form of response headers).
RawHeaders = list[tuple[bytes, bytes]]


def _rendezvous_score(key: str, backend: Backend) -> float:
    digest = hashlib.blake2b(f"{key}\x00{backend.identity}".encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
    return -backend.settings.weight / math.log(uniform)


def connection_tokens(values: Iterable[str]) -> frozenset[str]:
    """Header names listed in Connection: hop-by-hop for this connection only
    (RFC 9110, 7.6.1), so a proxy must not forward them."""
    return frozenset(
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    )


def forward_headers(
    incoming: Sequence[tuple[bytes, bytes]],
    *,
    request_id: str,
    api_key: SecretStr | None,
    drop: frozenset[str] = frozenset(),
) -> CIMultiDict[str]:
    """Client request headers (the ASGI scope's raw pairs) as the backend should see
    them; repeats kept in order."""
    skipped = _skipped_request_headers(drop)
    if any(name.lower() == b"connection" for name, _ in incoming):
        named = connection_tokens(
            v.decode("latin-1") for k, v in incoming if k.lower() == b"connection"
        )
        skipped = skipped | {token.encode("latin-1") for token in named}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming:
        lower = name.lower()
        if lower not in skipped:
            out.add(lower.decode("latin-1"), value.decode("latin-1"))
    out["x-request-id"] = request_id
    if api_key is not None:  # upstream.api_key: vLLM's key replaces the client's
        out["authorization"] = f"Bearer {api_key.get_secret_value()}"
    return out


@functools.cache
def _skipped_request_headers(drop: frozenset[str]) -> frozenset[bytes]:
    return frozenset(name.encode("latin-1") for name in HOP_BY_HOP | drop)


_DROPPED_RESPONSE_HEADERS = frozenset(
    name.encode("latin-1") for name in HOP_BY_HOP | {"date", "server"}
)
#: A body relayed byte for byte keeps its length and encoding: a client that reads
#: fewer bytes than Content-Length knows the body broke off.
_DROPPED_VERBATIM_RESPONSE_HEADERS = _DROPPED_RESPONSE_HEADERS - {b"content-length"}
_DROPPED_DECODED_RESPONSE_HEADERS = _DROPPED_RESPONSE_HEADERS | {b"content-encoding"}


def response_headers(upstream: aiohttp.ClientResponse, *, verbatim: bool) -> RawHeaders:
    """The backend's response headers for the client: repeats (Set-Cookie, Vary) kept,
    hop-by-hop ones and those named in Connection dropped; our server adds its own
    Date and Server. Names lower-cased (HTTP header names are ASCII tokens).
    ``verbatim``: the body goes to the client as the backend sent it, so its
    Content-Length and Content-Encoding stay; else the gateway reframes it."""
    dropped = _DROPPED_VERBATIM_RESPONSE_HEADERS if verbatim else _DROPPED_DECODED_RESPONSE_HEADERS
    listed = upstream.headers.getall("connection", ())
    if listed:
        # aiohttp decodes header values as UTF-8 with surrogateescape: back to the bytes.
        named = connection_tokens(listed)
        dropped = dropped | {name.encode("utf-8", "surrogateescape") for name in named}
    return [
        (lower, value)
        for name, value in upstream.raw_headers
        if (lower := name.lower()) not in dropped
    ]
