"""An upstream stream being read by the guard: what has been held back, what it said.

``StreamState`` reads one attempt's SSE body from the backend: OpenAI chunk streams
on a fast path that recognises a plain text event without parsing its JSON
(``gateway.wire.vllm_events``), every other API's typed events through its
adapter's event reader; it feeds the inspector, keeps the held bytes, reads usage
and the end of the stream, and maps transport failures. ``StallWatch`` times the
silence of every stream this process reads with one timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from gateway.apis import EventReader, Usage
from gateway.apis.base import NO_SIGNAL
from gateway.apis.openai_chunks import read_openai_usage
from gateway.detect import StreamInspector
from gateway.errors import GatewayError, UpstreamProtocolError, sse_error_event
from gateway.periodic import Sweep
from gateway.upstream.pool import Backend, drop_read_timer, transport_error
from gateway.wire.sse import DONE, EventTooLarge, SSEEvent, SSEParser, lf_event
from gateway.wire.vllm_events import NotText, TextEventReader, string_contents

#: Longest wait for the end of a backend's body after ``[DONE]`` (StreamState.finish_reading).
FINISH_READING_S = 1.0


class StallWatch(Sweep["StreamState"]):
    """The silence timeout of every stream this process reads, checked by one timer:
    a stream that has waited ``stall_s`` for the backend's next bytes gets a timeout
    from its pending read. Only time spent *waiting* on the backend counts: a relay
    held up by a slow client is not a stalled backend. Checked every ``stall_s / 4``
    (at most 1 s), so a stall is seen within 1.25 x ``stall_s``."""

    def __init__(self, stall_s: float) -> None:
        super().__init__(min(stall_s / 4, 1.0), self._silent_too_long)
        self.stall_s = stall_s
        #: The event loop's clock (its ``time``), once a stream was added: read on
        #: every network read, so kept as the bound method.
        self.clock: Callable[[], float] = time.monotonic

    def add(self, item: StreamState) -> None:
        super().add(item)
        assert self.loop is not None
        self.clock = self.loop.time

    def _silent_too_long(self, stream: StreamState, now: float) -> bool:
        if stream.response.closed:
            return True  # closed without close(): nothing to time
        since = stream.waiting_since
        if since and now - since >= self.stall_s:
            stream.stalled(self.stall_s)
            return True
        return False


@dataclass(slots=True, eq=False)
class StreamState:
    """An upstream stream being read: what has been held back, and what it said."""

    response: aiohttp.ClientResponse
    backend: Backend
    inspector: StreamInspector
    strip_usage: bool
    #: The API's reader of typed events (Responses, Messages); None: an OpenAI chunk
    #: stream, read by this class's own fast path.
    events: EventReader | None = None
    parser: SSEParser = field(default_factory=SSEParser)
    held: list[bytes] = field(default_factory=list)
    done: bool = False
    usage: Usage | None = None
    upstream_error: bool = False
    _body_ended: bool = False
    text_events: TextEventReader = field(default_factory=TextEventReader)
    #: The process's StallWatch, once ``watch_stalls`` was called.
    stall_watch: StallWatch | None = None
    #: Loop time at which the reader started waiting for the backend; 0: not waiting.
    waiting_since: float = 0.0
    #: Every event is forwarded as its own bytes (a continuation's events are
    #: rewritten one by one), never through the text-event fast path.
    whole_events: bool = False
    #: Takes the logprobs the gateway asked for out of each event (the client did
    #: not ask): every event is then read and forwarded on its own.
    strip_logprobs: Callable[[bytes], bytes] | None = None

    def ended(self) -> bool:
        return self.done or self.upstream_error

    def error_event(self, error: GatewayError) -> bytes:
        """The gateway's error, in band, in this stream's API's shape: ends the stream."""
        return self.events.error_event(error) if self.events is not None else sse_error_event(error)

    def watch_stalls(self, watch: StallWatch) -> None:
        """From here on ``watch`` times out a backend that goes silent mid-stream,
        instead of aiohttp's ``sock_read`` timer (the response head was read under
        it), which is cancelled and re-armed on every network read: a timer handle
        created and freed per streamed token (BENCHMARKS.md). Where aiohttp offers no
        hook for that, its own timer stays and times the stream instead."""
        if not drop_read_timer(self.response):
            return
        self.stall_watch = watch
        watch.add(self)

    def stalled(self, silent_s: float) -> None:
        """The backend said nothing for ``silent_s``: the pending read raises, as with
        aiohttp's own sock_read timer (``transport_error``: UpstreamTimeout)."""
        self.response.content.set_exception(
            aiohttp.ServerTimeoutError(f"no data from the backend for {silent_s:g} s")
        )

    def close(self) -> None:
        """Close the upstream response (its connection, unless read to the end)."""
        if self.stall_watch is not None:
            self.stall_watch.discard(self)
        self.response.close()

    async def finish_reading(self) -> None:
        """After ``[DONE]``, read the backend's body to its end so that its keep-alive
        connection goes back to the pool.

        vLLM ends the chunked body right after ``[DONE]``, but in a separate write that
        usually arrives after the guard stopped reading. Closing a response with
        unread bytes closes its connection: every stream then cost a new TCP
        connection to vLLM (CPU, and a TIME_WAIT socket each). Bounded: a backend
        that holds the body open
        after ``[DONE]`` has its connection closed after ``FINISH_READING_S``.
        """
        content = self.response.content
        if not self.done or self.upstream_error or content.is_eof():
            return
        try:
            async with asyncio.timeout(FINISH_READING_S):
                while await content.readany():
                    pass  # nothing but the chunked terminator is expected
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass  # the connection is closed instead; the client has its answer

    def accept(self, event: SSEEvent) -> bytes | None:
        """Inspect one event; return the bytes to forward, or None to drop it."""
        raw, data = event
        if data is not None and not self.accept_data(data):
            return None
        return raw if self.strip_logprobs is None else self.strip_logprobs(raw)

    def accept_data(self, data: bytes) -> bool:
        """Inspect one event's data; False: drop the event (a usage chunk the client
        did not ask for)."""
        if data == DONE:
            self.done = True
            return True
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamProtocolError("backend sent an SSE event that is not JSON") from None
        if type(payload) is not dict:
            raise UpstreamProtocolError("backend sent an SSE event that is not a JSON object")
        if self.events is not None:
            signal = self.events.read(payload)
            if signal is not NO_SIGNAL:
                if signal.usage is not None:
                    self.usage = signal.usage
                self.done = self.done or signal.ends
                self.upstream_error = self.upstream_error or signal.error
            return True
        if "error" in payload:
            self.upstream_error = True
            return True
        if (raw_usage := payload.get("usage")) is not None:
            tokens = raw_usage.get("completion_tokens") if isinstance(raw_usage, dict) else None
            if isinstance(tokens, int):
                self.inspector.completion_tokens = tokens
            usage = read_openai_usage(payload)
            if usage is not None:
                self.usage = usage
                if self.strip_usage and payload.get("choices") == []:
                    return False
        self.inspector.feed(payload)
        return True

    async def next_batch(self) -> list[bytes] | None:
        """The forwardable events of the next network chunk; None once the stream has
        ended (``[DONE]``, an error event, or the end of the body after either)."""
        if self.done or self.upstream_error or self._body_ended:
            if self._body_ended and not self.ended():
                raise UpstreamProtocolError("backend stream ended before [DONE]")
            return None
        if self.stall_watch is not None:
            self.waiting_since = self.stall_watch.clock()
        try:
            chunk = await self.response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise transport_error(self.backend, exc) from exc
        self.waiting_since = 0.0
        if chunk:
            return self.take(chunk)
        # The end of the body: an unterminated last event is still an event.
        self._body_ended = True
        tail = self.parser.close()
        forward = self.accept(tail) if tail is not None else None
        if forward is not None:
            return [forward]  # the next call says whether [DONE] came
        return await self.next_batch()

    def take(self, chunk: bytes) -> list[bytes]:
        """Inspect one network chunk; return the bytes to forward.

        vLLM's text events (``CONTENT_EVENT``) are read without parsing their JSON and
        forwarded as the chunk's own bytes; every other event goes through the SSE
        parser and ``accept``. A chunk that is exactly one text event is taken whole
        (a paced stream's every read); one that does not start on an event boundary
        or has CR line ends goes to the parser whole, as does every chunk of a typed
        event stream (``events``)."""
        if (
            self.parser.pending
            or self.events is not None
            or self.whole_events
            or self.strip_logprobs is not None
        ):
            return self._take_parsed(chunk)
        events = self.text_events
        head, tail = events.head, events.tail
        if (
            head is not None
            and len(chunk) >= len(head) + len(tail)
            and chunk.startswith(head)
            and chunk.endswith(tail)
        ):
            # Exactly one text event of this stream if what lies between is one JSON
            # string's contents (a paced stream's every read): they hold no unescaped
            # quote, so the tail at the chunk's end is the event's own.
            try:
                text = string_contents(chunk[len(head) : len(chunk) - len(tail)])
            except NotText:
                raise UpstreamProtocolError("backend sent an SSE event that is not JSON") from None
            if text is not None:
                self.inspector.feed_first_text(text)
                return [chunk]
        if b"\r" in chunk:
            return self._take_parsed(chunk)
        inspector = self.inspector
        read_texts = self.text_events.read_run
        forward: list[bytes] = []
        pieces: list[str] = []
        start = pos = 0  # chunk[start:pos] is forwarded unchanged
        end = len(chunk)
        first_choice_seen = inspector.has_first_choice  # changes only in accept()
        while pos < end:
            if first_choice_seen:
                try:
                    pos = read_texts(chunk, pos, pieces)
                except NotText:
                    raise UpstreamProtocolError(
                        "backend sent an SSE event that is not JSON"
                    ) from None
                if pos == end:
                    break
            stop = chunk.find(b"\n\n", pos)
            if stop < 0:
                break  # an event still arriving: the parser keeps it
            if pieces:
                inspector.feed_first_choice(pieces)
                pieces = []
            if chunk.startswith(b"data: ", pos) and chunk.find(b"\n", pos, stop) < 0:
                keep = self.accept_data(chunk[pos + 6 : stop])  # one data line, as vLLM's
            else:
                keep = self.accept(lf_event(chunk[pos:stop])) is not None
            if not keep:  # dropped
                if pos > start:
                    forward.append(chunk[start:pos])
                start = stop + 2
            first_choice_seen = inspector.has_first_choice
            pos = stop + 2
        if pieces:
            inspector.feed_first_choice(pieces)
        if pos > start:
            forward.append(chunk[start:pos])
        if pos < end:
            forward.extend(self._take_parsed(chunk[pos:]))
        return forward

    def _take_parsed(self, chunk: bytes) -> list[bytes]:
        try:
            events = self.parser.feed(chunk)
        except EventTooLarge as exc:
            raise UpstreamProtocolError(f"backend stream: {exc}") from None
        accept = self.accept
        return [f for e in events if (f := accept(e)) is not None]
