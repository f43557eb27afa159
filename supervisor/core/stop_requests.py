"""Stop requests (seed 004's stop file, or a signal) and the step at which every rank can still agree to act.

Stop file content, after trimming whitespace:
- nothing, or words without digits (a kill switch: `touch stop`, `echo stop > stop`): save at the next
  agreed step and exit;
- `N` > 0: save at step N and exit;  `-N`: save at step N and continue training;
- anything else (digits mixed with other text, `0`, control characters or other binary, more than 4 KiB) is
  refused with a reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["LEAD_S", "MAX_STOP_FILE_BYTES", "StopFileUnparsable", "StopRequest", "agreed_step", "parse_stop_file"]

MAX_STOP_FILE_BYTES = 4096
# How long, beyond what heartbeats show, until every rank has surely read a new order: the supervisor's
# reaction time plus one full step's read at the end of each step (ranks poll once per step).
LEAD_S = 1.0
ASSUMED_STEP_TIME_S = 0.01  # before a rank has reported its step time: assume fast steps, order far enough ahead
_STEP = re.compile(r"-?\d+")


class StopFileUnparsable(ValueError):
    """The stop file's content means nothing we know; the message says what it holds and what is accepted."""


@dataclass(frozen=True)
class StopRequest:
    """Save at `step` (None: the next step every rank can agree on), then exit or go on training."""

    step: int | None
    exit: bool
    source: str  # "stop file PATH", "SIGTERM", ...


def parse_stop_file(data: bytes, source: str) -> StopRequest:
    """What a stop file asks; raises StopFileUnparsable."""
    if len(data) > MAX_STOP_FILE_BYTES:
        raise StopFileUnparsable(f"{len(data)} bytes; a stop file holds at most a step number")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise StopFileUnparsable("not text (not UTF-8)") from None
    if any(not (c.isprintable() or c.isspace()) for c in text):
        raise StopFileUnparsable("not text (control characters)")
    if not any(c.isdigit() for c in text):
        return StopRequest(None, True, source)
    if not _STEP.fullmatch(text) or int(text) == 0:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise StopFileUnparsable(
            f"got {shown!r}; expected nothing (save now and exit), a step N (save at N and "
            "exit) or -N (save at N and continue)"
        )
    step = int(text)
    return StopRequest(abs(step), step > 0, source)


class _Rank(Protocol):  # read-only properties: RankState is a frozen dataclass
    @property
    def step(self) -> int | None: ...

    @property
    def step_time_s(self) -> float | None: ...

    @property
    def heartbeat_monotonic(self) -> float | None: ...

    @property
    def running(self) -> bool: ...


def agreed_step(ranks: Iterable[_Rank], now: float) -> int | None:
    """The earliest step no running rank can have passed before it reads an order written now (None: no rank
    reports its steps, so there is nobody to agree with).

    Each rank's step is extrapolated from its newest heartbeat at its own reported step time, then LEAD_S
    more; the order names the step after the furthest of those, plus one (ranks read orders after a step)."""
    furthest = None
    for rank in ranks:
        if not rank.running or rank.step is None or rank.heartbeat_monotonic is None:
            continue
        per_step = max(rank.step_time_s or ASSUMED_STEP_TIME_S, 1e-6)
        reach = rank.step + (now - rank.heartbeat_monotonic + LEAD_S) / per_step
        furthest = reach if furthest is None else max(furthest, reach)
    return None if furthest is None else math.floor(furthest) + 2
