"""Slow ranks (stragglers): a rank whose compute per step stays above its peers' median by a margin is flagged.

Each rank's heartbeat carries `compute_s`, its smoothed time per step up to the step guard's all-reduce: a rank
that waits there for a slower peer does not count the wait, so the slow rank alone shows a larger figure. A rank
is flagged once it has been more than `margin` above the median of the other ranks' figures at every beat for
`sustain_s` (one slow step, a rank 0 eval, does not last that long), and cleared once it has been back within the
margin as long. Only the current attempt's ranks count; a relaunch starts afresh. Pure bookkeeping: no I/O, and
each beat costs O(ranks) at most (a sorted list kept up to date with bisect).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from supervisor.config import StragglersConfig
from supervisor.core import Event, HeartbeatSeen, State
from supervisor.observe.progress import JournalRecord

__all__ = ["Stragglers"]

MAX_SLOWER_BY = 2.0**53  # a crafted heartbeat's 1e-300 s must not make the ratio infinite (JSON has no inf)


class Stragglers:
    """Flags and clears slow ranks from their heartbeats; `status()` lists the flagged ones and every rank's figure."""

    def __init__(self, config: StragglersConfig) -> None:
        self._config = config
        self._start(attempt=0)

    def _start(self, *, attempt: int) -> None:
        self._attempt = attempt
        self._compute: dict[int, float] = {}  # rank -> its newest compute_s, this attempt
        self._sorted: list[float] = []  # the same figures, in order: a peers' median without sorting each time
        self._since: dict[int, float] = {}  # rank -> since when it has been on the other side of its flag
        self._flagged: dict[int, dict[str, Any]] = {}  # rank -> its figures, brought up to date at each beat
        self._flagged_at: dict[int, float] = {}  # rank -> when it was flagged

    def observe(self, event: Event, state: State, now: float) -> list[JournalRecord]:
        records = self._relaunched(state.attempt) if state.attempt != self._attempt else []
        if not isinstance(event, HeartbeatSeen) or event.attempt != self._attempt or event.compute_s is None:
            return records
        self._record(event.rank, event.compute_s)
        if self._config.enabled:
            records += self._judge(event.rank, now)
        return records

    def status(self) -> dict[str, Any]:
        return {
            "stragglers": [self._flagged[rank] for rank in sorted(self._flagged)],
            "rank_compute_s": {str(rank): round(value, 6) for rank, value in sorted(self._compute.items())},
        }

    def _relaunched(self, attempt: int) -> list[JournalRecord]:
        """A new attempt: its ranks are new processes (maybe on other nodes); the old flags no longer hold."""
        records: list[JournalRecord] = [
            ("info", "straggler_cleared", {"rank": rank, "attempt": self._attempt, "reason": "relaunched"})
            for rank in sorted(self._flagged)
        ]
        self._start(attempt=attempt)
        return records

    def _record(self, rank: int, compute_s: float) -> None:
        old = self._compute.get(rank)
        if old is not None:
            del self._sorted[bisect_left(self._sorted, old)]
        insort(self._sorted, compute_s)
        self._compute[rank] = compute_s

    def _peers_median(self, compute_s: float) -> float | None:
        """The median of every other rank's figure: `self._sorted` less one entry equal to this rank's own."""
        others = len(self._sorted) - 1
        if others < 1:
            return None
        own = bisect_left(self._sorted, compute_s)

        def nth(k: int) -> float:
            return self._sorted[k if k < own else k + 1]

        middle = others // 2
        return nth(middle) if others % 2 else (nth(middle - 1) + nth(middle)) / 2

    def _judge(self, rank: int, now: float) -> list[JournalRecord]:
        """Flag or clear `rank` once it has been on the other side of the margin, at every beat, for sustain_s."""
        compute_s = self._compute[rank]
        median_s = self._peers_median(compute_s)
        if median_s is None:
            return []
        slow = compute_s > median_s * (1 + self._config.margin)
        figures = {
            "rank": rank,
            "compute_s": round(compute_s, 6),
            "median_s": round(median_s, 6),
            "slower_by": round(min(compute_s / median_s - 1, MAX_SLOWER_BY), 3),
        }
        if rank in self._flagged:
            self._flagged[rank] = figures
        if slow == (rank in self._flagged):  # as flagged (or not): nothing pending
            self._since.pop(rank, None)
            return []
        since = self._since.setdefault(rank, now)
        if now - since < self._config.sustain_s:
            return []
        del self._since[rank]
        if slow:
            self._flagged[rank], self._flagged_at[rank] = figures, now
            return [("warning", "straggler_flagged", {**figures, "sustained_s": round(now - since, 3)})]
        del self._flagged[rank]
        flagged_s = now - self._flagged_at.pop(rank)
        return [("info", "straggler_cleared", {**figures, "flagged_s": round(flagged_s, 3)})]
