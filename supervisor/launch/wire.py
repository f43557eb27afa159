"""The supervisor <-> node agent stream: one JSON object per line over TCP, both ways.

A line is at most MAX_LINE_BYTES and parsed strictly (worker.files.parse_json); a peer that sends more, or
garbage, is dropped, never trusted. Sends time out (SEND_TIMEOUT_S) so that a peer whose receive buffer is
full (a partitioned node) cannot block the sender's event loop. An agent reads its one stream in a thread
(`Peer.serve`); the supervisor reads every agent's stream in one thread (`Hub`), as a thousand threads would
cost more in switching than in reading.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from worker.files import parse_json

__all__ = ["MAX_LINE_BYTES", "Hub", "Peer", "WireError", "encode"]

MAX_LINE_BYTES = 1 << 20  # the largest message is a stack dump, capped well below this by its sender
SEND_TIMEOUT_S = 2.0
_CHUNK = 65536


class WireError(Exception):
    """The peer sent something that is not a message of ours, or the connection broke."""


class Peer:
    """One end of a connection: `send` from any thread, `receive` from one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)  # blocking: the reader waits in recv as long as it takes
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The kernel's own send timeout bounds sendall without touching recv (settimeout would apply to both).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        self._sock = sock
        self._send_lock = threading.Lock()
        self._buffer = b""
        self.address = _address(sock)

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is broken (the caller learns of it from `receive`)."""
        data = encode(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                self.close()
                return False

    def receive(self) -> dict[str, Any] | None:
        """The next message, None at a clean end of stream; WireError for anything else."""
        while (message := self.next_message()) is None:
            if not self.fill():
                return None
        return message

    def fill(self) -> bool:
        """One recv into the buffer (once `select` says the socket is readable, it does not block); False at a
        clean end of stream; WireError when the stream broke or ended inside a message."""
        if len(self._buffer) > MAX_LINE_BYTES:
            raise WireError(f"a message longer than {MAX_LINE_BYTES} bytes")
        try:
            chunk = self._sock.recv(_CHUNK)
        except OSError as exc:
            raise WireError(f"connection broken: {exc.strerror or exc}") from None
        if not chunk:
            if self._buffer:
                raise WireError("connection closed in the middle of a message")
            return False
        self._buffer += chunk
        return True

    def next_message(self) -> dict[str, Any] | None:
        """The next whole message in the buffer, None when there is none yet; WireError for garbage."""
        if b"\n" not in self._buffer:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = parse_json(line)
        except ValueError as exc:
            raise WireError(f"not a message: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise WireError("not a message: no 'type'")
        return message

    def fileno(self) -> int:
        return self._sock.fileno()

    def serve(self, on_message: Callable[[dict[str, Any]], None], on_end: Callable[[str | None], None]) -> None:
        """Read messages until the stream ends (`on_end(None)`) or breaks (`on_end(why)`), in a daemon thread."""

        def loop() -> None:
            try:
                while (message := self.receive()) is not None:
                    on_message(message)
            except WireError as exc:
                on_end(str(exc))
                return
            on_end(None)

        threading.Thread(target=loop, daemon=True, name=f"wire-{self.address}").start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread blocked in recv
        self._sock.close()


class Hub:
    """Reads many peers' streams in one thread: each message goes to its peer's `on_message`, the end of a stream
    (`None`) or its breaking (why) to `on_end`, both called in the hub's thread."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_write.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._joining: list[tuple[Peer, Callable[[dict[str, Any]], None], Callable[[str | None], None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="wire-hub")
        self._thread.start()

    def add(
        self, peer: Peer, on_message: Callable[[dict[str, Any]], None], on_end: Callable[[str | None], None]
    ) -> None:
        with self._lock:
            self._joining.append((peer, on_message, on_end))
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_write.send(b"x")

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_read:
                    self._join()
                else:
                    self._read(key)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
        self._wake_read.close()
        self._wake_write.close()

    def _join(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_read.recv(4096)
        with self._lock:
            joining, self._joining = self._joining, []
        for peer, on_message, on_end in joining:
            stale = self._selector.get_map().get(peer.fileno())
            if stale is not None:  # a peer closed elsewhere, its descriptor number now reused
                self._selector.unregister(stale.fileobj)
                stale.data[1]("connection closed")
            try:
                self._selector.register(peer, selectors.EVENT_READ, (on_message, on_end))
            except (ValueError, OSError) as exc:  # closed before it joined
                on_end(f"connection broken: {exc}")

    def _read(self, key: selectors.SelectorKey) -> None:
        peer, (on_message, on_end) = key.fileobj, key.data
        assert isinstance(peer, Peer)
        try:
            alive = peer.fill()
            while (message := peer.next_message()) is not None:  # what came before garbage counts
                on_message(message)
        except WireError as exc:
            self._drop(peer, on_end, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one peer's bad message must not stop the hub for every peer
            self._drop(peer, on_end, f"a message it could not take: {exc!r}"[:300])
            return
        if not alive:
            self._drop(peer, on_end, None)

    def _drop(self, peer: Peer, on_end: Callable[[str | None], None], why: str | None) -> None:
        self._selector.unregister(peer)
        peer.close()
        on_end(why)


def encode(message: dict[str, Any]) -> bytes:
    """One message as its line on the wire."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _address(sock: socket.socket) -> str:
    try:
        return sock.getpeername()[0]
    except OSError:
        return "?"
