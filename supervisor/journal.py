"""The supervisor's JSON-lines journal: every event goes to the run dir and to stderr (systemd's journal)."""

from __future__ import annotations

import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import structlog

from supervisor.console import Console
from worker.files import open_append

__all__ = ["Journal", "append_event", "open_journal"]


_JSON = structlog.processors.JSONRenderer(default=str)


class _TeeLogger:
    """A structlog logger that writes each event, whole, as a JSON line to the journal file and to `echo`
    (a stream gets the same JSON line; a Console renders it for people)."""

    def __init__(self, file: IO[str], echo: IO[str] | Console | None) -> None:
        self._file = file
        self._echo = echo
        self._lock = threading.Lock()

    def msg(self, **event_dict: Any) -> None:
        line = _JSON(None, "", dict(event_dict)) + "\n"
        with self._lock:
            streams = [self._file] if not self._echo or isinstance(self._echo, Console) else [self._file, self._echo]
            for stream in streams:
                try:
                    stream.write(line)
                    stream.flush()
                except (OSError, ValueError):  # a closed terminal must not take the supervisor down
                    pass
        if isinstance(self._echo, Console):
            self._echo.event(event_dict)

    info = warning = error = critical = debug = msg


class Journal:
    """Bound structlog logger plus the file it owns."""

    def __init__(self, logger: Any, stream: IO[str]) -> None:
        self.log = logger
        self._stream = stream

    def close(self) -> None:
        self._stream.close()


def open_journal(path: Path, *, root: Path, echo: IO[str] | Console | None = sys.stderr) -> Journal:
    """Open (append) the journal at `path` inside the run dir `root`, following no symlink; `echo` also
    receives every event (a stream as the same JSON line, a Console rendered for people)."""
    stream = os.fdopen(open_append(path, root=root), "a", encoding="utf-8")  # closed by Journal.close
    logger = structlog.wrap_logger(
        _TeeLogger(stream, echo),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            lambda _logger, _name, event_dict: event_dict,  # handed whole to _TeeLogger.msg, which renders
        ],
    )
    return Journal(logger, stream)


def append_event(path: Path, *, root: Path, event: str, level: str = "info", **fields: Any) -> None:
    """One event written to the journal by a process other than the supervisor (a node agent), in the
    supervisor's format: one line in one write, so lines of several writers never interleave (O_APPEND)."""
    time = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    line = _JSON(None, "", {"event": event, **fields, "level": level, "time": time}) + "\n"
    fd = open_append(path, root=root)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
