"""The supervisor <-> node agent stream: one JSON object per line over TCP, both ways.

A line is at most MAX_LINE_BYTES and parsed strictly (worker.files.parse_json); a peer that sends more, or
garbage, is dropped, never trusted. Sends time out (SEND_TIMEOUT_S) so that a peer whose receive buffer is
full (a partitioned node) cannot block the sender's event loop.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from worker.files import parse_json

__all__ = ["MAX_LINE_BYTES", "Peer", "WireError"]

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
        data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        with self._send_lock:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                self.close()
                return False

    def receive(self) -> dict[str, Any] | None:
        """The next message, None at a clean end of stream; WireError for anything else."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise WireError(f"a message longer than {MAX_LINE_BYTES} bytes")
            try:
                chunk = self._sock.recv(_CHUNK)
            except OSError as exc:
                raise WireError(f"connection broken: {exc.strerror or exc}") from None
            if not chunk:
                if self._buffer:
                    raise WireError("connection closed in the middle of a message")
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = parse_json(line)
        except ValueError as exc:
            raise WireError(f"not a message: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise WireError("not a message: no 'type'")
        return message

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


def _address(sock: socket.socket) -> str:
    try:
        return sock.getpeername()[0]
    except OSError:
        return "?"
