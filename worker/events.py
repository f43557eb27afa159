"""Structured JSON-lines events of one rank, written through structlog."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import structlog

from worker.files import open_append

__all__ = ["open_event_log"]


def open_event_log(path: Path, *, root: Path, **context: Any) -> tuple[Any, IO[str]]:
    """A structlog logger appending one JSON object per line to `path` (inside `root`, following no symlink),
    bound to `context`."""
    stream = os.fdopen(open_append(path, root=root), "a", encoding="utf-8")
    logger = structlog.wrap_logger(
        # WriteLogger writes each line with a single write() call, so lines from restarts never interleave.
        structlog.WriteLogger(stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            structlog.processors.JSONRenderer(),
        ],
    )
    return logger.bind(**context), stream
