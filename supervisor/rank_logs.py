"""Reading the newest events of a rank's JSON-lines log from its end (logs grow by a line per step)."""

from __future__ import annotations

import json
from typing import Any

from worker.contract import RunLayout

__all__ = ["last_event", "last_step"]

TAIL_BYTES = 65536


def last_event(layout: RunLayout, rank: int, attempt: int, name: str) -> dict[str, Any] | None:
    """The newest `name` event of `attempt` within the log's last TAIL_BYTES; torn lines are skipped."""
    path = layout.rank_events(rank)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn first or last line
        if isinstance(event, dict) and event.get("event") == name and event.get("attempt") == attempt:
            return event
    return None


def last_step(layout: RunLayout, rank: int, attempt: int) -> int | None:
    """The newest step the rank logged in `attempt` (heartbeats are throttled; the event log is not)."""
    event = last_event(layout, rank, attempt, "step")
    return None if event is None else int(event["step"])
