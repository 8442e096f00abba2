"""The client side of a released stream.

Starlette's StreamingResponse watches for a client disconnect with an anyio task
group per response (two tasks and a cancel scope), a large share of a streamed
request's CPU in profiles (BENCHMARKS.md). ``RelayResponse`` does the same job with
one watcher task: when the client goes away it cancels the relay, whose
``finally`` closes the upstream response so vLLM aborts the generation.

The relay is a coroutine that sends body frames itself (``pump``), not an
iterator of chunks: each event then crosses one await instead of two async
generators.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.guard.answer import Answer, ChunkWriter, StreamedAnswer, WholeAnswer


def body_frame(chunk: bytes) -> Message:
    """An ASGI body frame of a response with more to come."""
    return {"type": "http.response.body", "body": chunk, "more_body": True}


class ClientGone(Exception):
    """The client disconnected before the response started."""


#: ASGI scope key of the request's ``ServerHooks``, under the gateway's own server
#: protocol (``gateway.server.uvicorn_edge``). Under any other server ClientWatch watches
#: ``receive()`` with a task and every body frame goes through ``send()``.
SERVER_HOOKS = "vllm_guard.server_hooks"

#: Writes one chunk of a started streamed response at once; False: use ``send()``.
BodyWriter = ChunkWriter


def never_direct(chunk: bytes) -> bool:
    """The BodyWriter where the server offers none: every frame goes through send()."""
    return False


class ServerHooks:
    """What the gateway's server protocol offers a request beyond ASGI, in its scope;
    this base offers nothing, the protocol's subclass (``gateway.server.uvicorn_edge``) does.

    ``on_client_gone``: set by the app, called from the protocol's
    ``connection_lost`` while the response is incomplete, so the app learns that its
    client left without a task waiting on ``receive()`` (a task created, stepped and
    cancelled per request). ``write_body``: writes one chunk of a started chunked
    response to the transport at once, as ``send()`` would frame it, without an
    ASGI message and an await per streamed event; False when ``send()`` must take
    it (the connection is paused for flow control, the client is gone, the
    response is not a started chunked one). ``hold_head``: called just before
    ``send()`` of ``http.response.start`` when body bytes follow without waiting:
    the head then goes out in the same write as the first of them (one syscall,
    not two). ``abort``: closes the connection of a response that broke off, before
    its end (no terminating chunk)."""

    __slots__ = ("on_client_gone",)

    def __init__(self) -> None:
        self.on_client_gone: Callable[[], None] | None = None

    def write_body(self, chunk: bytes) -> bool:
        return False

    def hold_head(self) -> None:
        pass

    def abort(self) -> None:
        """Close the connection under a started response that broke off, so the client
        sees a broken body; this base leaves it to the server (uvicorn closes a
        connection whose app returned before completing its response, and logs it)."""


def server_hooks(scope: Mapping[str, object]) -> ServerHooks | None:
    """The request's ServerHooks, under the gateway's own server protocol."""
    hooks = scope.get(SERVER_HOOKS)
    return hooks if isinstance(hooks, ServerHooks) else None


def hold_head(scope: Scope) -> None:
    """Under the gateway's server protocol, the response head that ``send()`` writes
    next leaves with the first body bytes (call only when they follow at once)."""
    hooks = server_hooks(scope)
    if hooks is not None:
        hooks.hold_head()


class ClientWatch:
    """Cancels the request's own task when the client leaves: the guard's attempts
    while the answer is prepared (``guard``), then the relay of a released stream
    (``RelayResponse``), which takes the same watch over. Told by the server
    protocol's ``ServerHooks`` where there are some, else by one watcher task per
    request that waits on ``receive()``; one for both phases, not one each."""

    __slots__ = ("_hooks", "_watcher", "complete", "gone", "on_gone", "task")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        #: The client left (and ``task`` was cancelled).
        self.gone = False
        #: The response is complete: a disconnect from now on is not a client leaving.
        self.complete = False
        #: Runs once, before the task is cancelled, when the client leaves.
        self.on_gone: Callable[[], None] | None = None
        self._hooks = server_hooks(scope)
        self._watcher: asyncio.Task[None] | None = None
        if self._hooks is not None:
            self._hooks.on_client_gone = self._client_left
        else:
            self._watcher = task.get_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left()

    def _client_left(self) -> None:
        if self.complete or self.gone:
            # uvicorn answers receive() with http.disconnect once the response is
            # complete: that is the end of a stream the client read, not a client
            # that left (a keep-alive connection stays open after it).
            return
        self.gone = True
        if self.on_gone is not None:
            self.on_gone()
        self.task.cancel()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._hooks is not None:
            self._hooks.on_client_gone = None

    async def guard(self, work: Awaitable[Answer]) -> Answer:
        """Await ``work``; cancel it (closing its upstream request) if the client
        leaves, raising ClientGone. A streamed answer takes the watch over (its
        response, ``RelayResponse.for_answer``); for a whole one the watch ends here."""
        try:
            result = await work
        except asyncio.CancelledError:
            if self.gone:
                self.task.uncancel()
                self.close()
                raise ClientGone from None
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        if self.gone:  # the client left just as the work finished
            self.task.uncancel()
            self.close()
            if isinstance(result, StreamedAnswer):
                result.on_close()  # a released stream nobody will read: close its upstream
            raise ClientGone
        if not isinstance(result, StreamedAnswer):
            self.close()
        return result


class RelayResponse(Response):
    """The ASGI response that relays a guard's streamed answer (``StreamedAnswer``
    says what each of its parts does)."""

    def __init__(self, answer: StreamedAnswer, watch: ClientWatch | None = None) -> None:
        self.answer = answer
        #: The request's ClientWatch, which this response takes over (else its own).
        self.watch = watch
        # Starlette's own initialisation (status, media type, background; its headers
        # are replaced below): a subclass that skipped it would break silently when
        # a Starlette release adds an attribute there.
        super().__init__(None, answer.status, media_type=answer.media_type)
        # Raw pairs, so repeated headers (Set-Cookie, Vary) survive.
        self.raw_headers = list(answer.headers)
        if not any(k == b"content-type" for k, _ in answer.headers):
            self.raw_headers.append((b"content-type", answer.media_type.encode("latin-1")))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = self.answer
        watch = self.watch or ClientWatch(scope, receive)
        watch.on_gone = answer.on_client_gone
        hooks = server_hooks(scope)
        try:
            if answer.body_ready and hooks is not None:
                hooks.hold_head()
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )

            async def send_chunk(chunk: bytes) -> None:
                await send(body_frame(chunk))

            last = await answer.relay(
                send_chunk, never_direct if hooks is None else hooks.write_body
            )
            if hooks is None:
                # A pump that found every chunk already buffered never waited, so a
                # client that left meanwhile (the server drops sends to a closed
                # connection) has woken the watcher task but not yet been seen: let
                # it run before the last frame makes every receive() say
                # "disconnect". (The server hooks are told from connection_lost, which
                # runs only while this task waits: a departure is seen already.)
                await asyncio.sleep(0)
            watch.complete = True
            await send({"type": "http.response.body", "body": last, "more_body": False})
            await answer.after_complete()
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # the server is stopping this request, not the client
            watch.task.uncancel()
        finally:
            watch.close()
            answer.on_close()


def answer_response(answer: Answer, watch: ClientWatch | None = None) -> Response:
    """The ASGI response of a guard's answer."""
    if isinstance(answer, WholeAnswer):
        response = Response(answer.body, status_code=answer.status)
        response.raw_headers.extend(answer.headers)
        return response
    return RelayResponse(answer, watch)
