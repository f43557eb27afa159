"""Structured JSON-lines events of one rank, written through structlog."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import structlog

__all__ = ["open_event_log"]


def open_event_log(path: Path, **context: Any) -> tuple[Any, IO[str]]:
    """A structlog logger appending one JSON object per line to `path`, bound to `context`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - owned by the caller
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
