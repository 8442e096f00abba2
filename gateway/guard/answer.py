"""What the guard hands the server: a released answer, free of any web framework.

``Guard.handle`` returns a ``WholeAnswer`` (status, headers, body) or a
``StreamedAnswer``, whose ``relay`` sends the held bytes and then the rest of the
upstream stream through two functions the server layer supplies: ``write_now``
writes a chunk to the client at once where the server allows it (False: not now),
``send`` sends it the ordinary way, waiting for the connection. The server layer
(``gateway.server``) turns either into an ASGI response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.upstream.pool import RawHeaders

#: Writes one chunk of a started stream at once; False: the caller must ``send`` it.
ChunkWriter = Callable[[bytes], bool]
#: Sends one chunk of a started stream, waiting for the connection if it must.
ChunkSender = Callable[[bytes], Awaitable[None]]
SSE_MEDIA_TYPE = "text/event-stream"


@dataclass(slots=True)
class WholeAnswer:
    status: int
    body: bytes
    headers: RawHeaders


@dataclass(slots=True)
class StreamedAnswer:
    headers: RawHeaders
    #: Sends the body (``send`` and ``write_now``) and returns its last bytes, which
    #: the server sends with the end of the body in one write.
    relay: Callable[[ChunkSender, ChunkWriter], Awaitable[bytes]]
    #: Bytes are held already: the head may wait for them and leave in the same write.
    body_ready: bool
    #: Awaited once the client has the whole answer (not after a disconnect).
    after_complete: Callable[[], Awaitable[None]]
    #: Runs at the end whatever happened, even if ``relay`` never started.
    on_close: Callable[[], None]
    #: Runs once, before the relay is cancelled, when the client leaves.
    on_client_gone: Callable[[], None]
    status: int = 200
    media_type: str = SSE_MEDIA_TYPE


Answer = WholeAnswer | StreamedAnswer
