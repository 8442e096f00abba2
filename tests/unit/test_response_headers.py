"""The backend's response headers as the client gets them (``upstream.response_headers``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.upstream.pool import response_headers


def upstream_with(raw: list[tuple[bytes, bytes]]) -> Any:
    """What response_headers reads of an aiohttp ClientResponse: its raw pairs, and its
    decoded headers (aiohttp decodes values as UTF-8 with surrogateescape)."""
    decoded: CIMultiDict[str] = CIMultiDict(
        (k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for k, v in raw
    )
    return SimpleNamespace(raw_headers=tuple(raw), headers=CIMultiDictProxy(decoded))


def test_hop_by_hop_named_and_server_headers_are_dropped_repeats_kept() -> None:
    upstream = upstream_with(
        [
            (b"Content-Type", b"text/event-stream"),
            (b"Connection", b"keep-alive, X-Internal"),
            (b"X-Internal", b"secret"),
            (b"Keep-Alive", b"timeout=5"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Date", b"Thu, 03 Dec 2026 23:00:00 GMT"),
            (b"Server", b"uvicorn"),
            (b"Set-Cookie", b"a=1"),
            (b"Set-Cookie", b"b=2"),
            (b"Content-Encoding", b"gzip"),
            (b"Content-Length", b"42"),
        ]
    )
    assert response_headers(upstream, verbatim=True) == [
        (b"content-type", b"text/event-stream"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"content-encoding", b"gzip"),
        (b"content-length", b"42"),  # a verbatim body keeps its length
    ]
    reframed = response_headers(upstream, verbatim=False)
    assert (b"content-encoding", b"gzip") not in reframed
    assert (b"content-length", b"42") not in reframed


def test_a_connection_header_that_is_not_ascii_is_no_error() -> None:
    """A token outside Latin-1 (a backend's mistake) names no header we forward, and
    is no reason to fail the request."""
    upstream = upstream_with([(b"Connection", "x-\u00fc\u20ac".encode()), (b"X-Kept", b"1")])
    assert response_headers(upstream, verbatim=True) == [(b"x-kept", b"1")]
