"""A worker's own listening socket (gateway.server.listeners), in this process: the
socket the parent bound is found among the descriptors and replaced in place."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from gateway.server import listeners


def inode(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def parents_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_the_inherited_socket_is_replaced_by_one_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inherited = parents_socket()
    port = inherited.getsockname()[1]
    other = socket.create_server(("127.0.0.1", 0))  # a listener: never taken over
    before, other_before = inode(inherited.fileno()), inode(other.fileno())
    monkeypatch.setenv(listeners.PORT_VARIABLE, str(port))
    try:
        assert listeners.take_own_listener()
        assert listeners.PORT_VARIABLE not in os.environ  # nothing this worker starts sees it
        assert inode(inherited.fileno()) != before  # the same descriptor, a new socket
        assert inode(other.fileno()) == other_before
        assert inherited.getsockname() == ("127.0.0.1", port)
        assert inherited.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        inherited.listen()  # what uvicorn does next: the worker's own queue
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = inherited.accept()
            accepted.close()
    finally:
        inherited.close()
        other.close()


def test_nothing_is_taken_without_a_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    inherited = parents_socket()
    before = inode(inherited.fileno())
    try:
        monkeypatch.delenv(listeners.PORT_VARIABLE, raising=False)
        assert not listeners.take_own_listener()  # one process: uvicorn's own socket
        monkeypatch.setenv(listeners.PORT_VARIABLE, str(inherited.getsockname()[1] + 1))
        assert not listeners.take_own_listener()  # no socket bound to that port
        assert inode(inherited.fileno()) == before
    finally:
        inherited.close()


def test_the_parents_socket_holds_the_port_without_listening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(listeners.PORT_VARIABLE, "")  # restored (unset) after the test
    sock = listeners.bind_shared_port("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert os.environ[listeners.PORT_VARIABLE] == str(port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
        assert sock.get_inheritable()
        with pytest.raises(ConnectionRefusedError):  # nothing listens until a worker does
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sock.close()


def test_a_port_something_listens_on_is_refused_not_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listener with SO_REUSEPORT (another gateway's worker) would let a SO_REUSEPORT
    bind join its group: the parent's plain bind first is refused, as uvicorn's is."""
    monkeypatch.setenv(listeners.PORT_VARIABLE, "")
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        with pytest.raises(OSError, match="in use") as refused:
            listeners.bind_shared_port("127.0.0.1", other.getsockname()[1])
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        other.close()


def test_a_port_another_gateway_holds_for_its_workers_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the first gateway's workers listen (its start, or all of them down), only
    its parent's socket holds the port: a second gateway is refused then too."""
    monkeypatch.setenv(listeners.PORT_VARIABLE, "")
    first = listeners.bind_shared_port("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match="in use") as refused:
            listeners.bind_shared_port("127.0.0.1", first.getsockname()[1])
        assert refused.value.errno == errno.EADDRINUSE
        own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # a worker still binds
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        own.bind(first.getsockname())
        own.close()
    finally:
        first.close()
