"""The supervisor's JSON-lines journal: every event goes to the run dir and to stderr (systemd's journal)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

import structlog

from worker.files import open_append

__all__ = ["Journal", "open_journal"]


class _TeeLogger:
    """A structlog logger that writes each rendered line, whole, to several streams."""

    def __init__(self, streams: list[IO[str]]) -> None:
        self._streams = streams
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        line = message + "\n"
        with self._lock:
            for stream in self._streams:
                try:
                    stream.write(line)
                    stream.flush()
                except (OSError, ValueError):  # a closed terminal must not take the supervisor down
                    pass

    info = warning = error = critical = debug = msg


class Journal:
    """Bound structlog logger plus the file it owns."""

    def __init__(self, logger: Any, stream: IO[str]) -> None:
        self.log = logger
        self._stream = stream

    def close(self) -> None:
        self._stream.close()


def open_journal(path: Path, *, root: Path, echo: IO[str] | None = sys.stderr) -> Journal:
    """Open (append) the journal at `path` inside the run dir `root`, following no symlink; `echo` also
    receives every line."""
    stream = os.fdopen(open_append(path, root=root), "a", encoding="utf-8")  # closed by Journal.close
    streams = [stream] + ([echo] if echo is not None else [])
    logger = structlog.wrap_logger(
        _TeeLogger(streams),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            structlog.processors.JSONRenderer(default=str),
        ],
    )
    return Journal(logger, stream)
