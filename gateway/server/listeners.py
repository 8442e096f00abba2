"""One listening socket per worker (``server.reuse_port``), so that the kernel spreads
new connections evenly over the workers.

With ``server.workers`` > 1, uvicorn binds one socket in its parent process and every
worker listens on that same socket. libuv (uvloop) accepts until the queue is empty, so
the worker that wakes first for a burst of new connections takes most of them, and a
keep-alive client (a load balancer's pool, vLLM's ``bench serve``) keeps them there:
two workers took 58 and 6, 60 and 4, 64 and 0 of 64 connections opened at once
(BENCHMARKS.md, "The relay at GPU speed: vLLM rows on the H200, and a listener per
worker").

With ``reuse_port``, the parent binds the port with ``SO_REUSEPORT`` and never listens
on it (it only holds the port, so a worker that restarts can bind it again). Each
worker, when it loads the app (before uvicorn listens on the inherited socket), binds a
socket of its own to the same address with ``SO_REUSEPORT`` and puts it in the
inherited socket's place (``dup2`` onto its descriptor): uvicorn listens on the
worker's own socket, and the kernel hashes every new connection to one of them.

What it costs, and why it is not the default: a connection is queued for one worker
from the moment it arrives. A worker whose event loop stalls keeps receiving its share
(with the shared socket the others take them), and a worker that exits (a crash, a
SIGHUP restart) resets the connections still in its queue unless the kernel moves them
to a sibling (``net.ipv4.tcp_migrate_req = 1``, Linux 5.14; warned about at start).
Another process can join the port's group only under the same user ID; a second
gateway started on a port another gateway holds is refused (also before the first
one's workers listen), as uvicorn's own bind would refuse it. Linux only; elsewhere
uvicorn's shared socket stays.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

log = logging.getLogger(__name__)

#: The port the parent bound for its workers (set by the parent, read by each worker).
PORT_VARIABLE = "VLLM_GUARD_WORKER_PORT"


def supported() -> bool:
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def bind_shared_port(host: str, port: int) -> socket.socket:
    """The parent's socket: bound with ``SO_REUSEPORT``, not listening, inheritable; as
    uvicorn's ``Config.bind_socket`` binds it otherwise (IPv6 where the host has a colon).
    Tells the workers which port to take over (``PORT_VARIABLE``). Raises OSError
    (EADDRINUSE) where something already listens on the port or another gateway holds
    it for its workers: SO_REUSEPORT alone would let this one join their group."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))  # without SO_REUSEPORT: refused where anything listens
        port = probe.getsockname()[1]  # port 0: the one chosen, held until bound below
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    # Bound, SO_REUSEADDR off: a second gateway's probe is refused now, before any
    # worker listens too (the workers' own sockets still join through SO_REUSEPORT).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    os.environ[PORT_VARIABLE] = str(bound)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, bound
    )
    if migrating_requests() is False:
        log.warning(
            "server.reuse_port: net.ipv4.tcp_migrate_req is 0, so a worker that exits "
            "(a crash, a restart) resets the connections still queued for it; set it to "
            "1 where the platform allows (docs/deployment.md)"
        )
    return sock


def migrating_requests() -> bool | None:
    """Whether the kernel moves a closed listener's queued connections to a sibling of
    its reuseport group (None: not known, a kernel without the switch)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text().strip() != "0"
    except OSError:
        return None


def take_own_listener() -> bool:
    """In a worker: replace the socket inherited from the parent (bound to
    ``PORT_VARIABLE``'s port, ``SO_REUSEPORT``, not listening) with one of this
    worker's own, bound to the same address. False where there is nothing to take over
    (one process, or ``reuse_port`` off: uvicorn's own shared socket)."""
    port = os.environ.pop(PORT_VARIABLE, None)  # not for anything this worker starts
    if not port or not supported():
        return False
    for fd in inherited_socket_fds():
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            if not is_parents_socket(probe, int(port)):
                continue
            own = socket.socket(probe.family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            with own:
                own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                own.bind(probe.getsockname())
                os.dup2(own.fileno(), fd)
        return True
    log.warning("no socket inherited for port %s: this worker listens on the shared socket", port)
    return False


def inherited_socket_fds() -> list[int]:
    fds = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry).startswith("socket:"):
                fds.append(int(entry.name))
        except (OSError, ValueError):
            continue  # the listing's own descriptor, closed by now
    return fds


def is_parents_socket(sock: socket.socket, port: int) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        shared = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        bound_port = sock.getsockname()[1]
    except OSError:
        return False
    return not listening and bool(shared) and bound_port == port
