"""Observers: bookkeeping beside the decision core (progress, goodput, stragglers) that never changes a decision.

The runner shows every core event, once decided, to each observer with the state after it and the monotonic time;
an observer answers with journal records to write, and lends its `status()` to the state file. Observers are pure
(no I/O, no clock of their own), so they are tested with plain values and a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Protocol

from supervisor.core import Event, HeartbeatSeen, RanksLaunched, SlowSaves, State
from supervisor.rundir.watch import progress_fields

__all__ = ["Counts", "JournalRecord", "Observer", "Progress"]

JournalRecord = tuple[str, str, dict[str, Any]]  # (level, event name, fields)
MAX_REASONS = 8  # distinct reasons for an inexact resume kept per attempt, slow-saving ranks shown (all journalled)
RATE_WINDOW_S = 30.0  # steps per second over about this long: smooth, yet quick to follow a slowdown


class Observer(Protocol):
    def observe(self, event: Event, state: State, now: float) -> list[JournalRecord]:
        """Take in one decided event; journal records to write (usually none)."""

    def status(self) -> dict[str, Any]:
        """Top-level keys for the state file."""


class Progress:
    """Where training stands: the newest step any rank reached, its loss, steps per second and time to go."""

    def __init__(self) -> None:
        self._attempt = 0
        self._step: int | None = None
        self._total: int | None = None
        self._loss: float | None = None
        self._samples: list[tuple[float, int]] = []  # (time, step) of this attempt, oldest first, ~RATE_WINDOW_S

    def observe(self, event: Event, state: State, now: float) -> list[JournalRecord]:
        if isinstance(event, RanksLaunched):  # a relaunch starts from its checkpoint, not where the last one died
            self._attempt, self._samples, self._step = event.attempt, [], event.resume_step
            return []
        # A rank's start-up beats say step 0 until it has resumed: they are not progress.
        if not isinstance(event, HeartbeatSeen) or event.attempt != state.attempt or event.phase == "startup":
            return []
        if event.attempt != self._attempt:  # a relaunch: its steps per second start afresh
            self._attempt, self._samples = event.attempt, []
        if event.total_steps is not None:
            self._total = event.total_steps
        if self._step is None or event.step >= self._step or not self._samples:
            self._step = event.step
            if event.loss is not None:
                self._loss = event.loss
            self._samples.append((now, event.step))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.pop(0)
        return []

    @property
    def steps_per_s(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def status(self) -> dict[str, Any]:
        rate = self.steps_per_s
        left = None if self._total is None or self._step is None else max(0, self._total - self._step)
        eta = None if left is None or not rate else left / rate
        return {
            "progress": {
                "step": self._step,
                "total_steps": self._total,
                "loss": self._loss,
                "steps_per_s": None if rate is None else round(rate, 3),
                "eta_s": None if eta is None or not math.isfinite(eta) else round(eta, 1),
                "attempt": self._attempt,
            }
        }


class Counts:
    """Skipped batches and anomalies by kind over every attempt this supervisor ran, the newest save's duration, the
    ranks of this attempt that said their resume is not exact (journalled once per rank and reason), and those whose
    background checkpoint writes outlast their save interval (journalled once per rank).

    A rank process counts from zero, so each attempt is kept apart: skips are agreed, the same on every rank (the
    attempt's largest count is taken); anomalies are each rank's own sightings (summed over ranks).
    """

    def __init__(self, previous: dict[str, Any] | None = None) -> None:
        # What the supervisors of this run dir before this one counted (their state file): totals never go back.
        self._carried_skipped, self._carried_anomalies = _carried_counts(previous or {})
        self._skipped: dict[int, int] = {}  # attempt -> batches skipped
        self._anomalies: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}  # (attempt, rank) -> counts
        self._last_save: dict[int, float] = {}  # rank -> its newest save's duration, this attempt
        self._inexact: dict[str, list[int]] = {}  # why a resume is not exact -> the ranks that said so, this attempt
        self._said: dict[int, str] = {}  # rank -> the newest reason it gave
        self._slow_saves: dict[int, SlowSaves] = {}  # rank -> its word that saves wait for the previous one
        self._attempt = 0

    def observe(self, event: Event, state: State, now: float) -> list[JournalRecord]:
        if not isinstance(event, HeartbeatSeen) or event.attempt != state.attempt:
            return []
        if event.attempt != self._attempt:
            self._attempt, self._last_save, self._inexact, self._said = event.attempt, {}, {}, {}
            self._slow_saves = {}
        if event.skipped is not None:
            self._skipped[event.attempt] = max(self._skipped.get(event.attempt, 0), event.skipped)
        if event.anomalies is not None:
            self._anomalies[event.attempt, event.rank] = event.anomalies
        if event.last_save_s is not None:
            self._last_save[event.rank] = event.last_save_s
        records = self._slow_saves_said(event)
        if event.inexact is not None and self._said.get(event.rank) != event.inexact:
            self._said[event.rank] = event.inexact
            ranks = self._inexact.get(event.inexact)
            if ranks is None and len(self._inexact) < MAX_REASONS:
                ranks = self._inexact[event.inexact] = []
            if ranks is not None and event.rank not in ranks:
                ranks.append(event.rank)
            fields = {"attempt": event.attempt, "rank": event.rank, "reason": event.inexact}
            records.append(("warning", "resume_inexact", fields))
        return records

    def _slow_saves_said(self, event: HeartbeatSeen) -> list[JournalRecord]:
        """The journal's `save_slower_than_interval`, the first time a rank of this attempt says so."""
        if event.slow_saves is None or event.rank in self._slow_saves:
            return []
        self._slow_saves[event.rank] = said = event.slow_saves
        fields = {"attempt": event.attempt, "rank": event.rank, **asdict(said)}
        return [("warning", "save_slower_than_interval", fields)]

    def status(self) -> dict[str, Any]:
        kinds: dict[str, int] = dict(self._carried_anomalies)
        for counts in self._anomalies.values():
            for kind, count in counts:
                kinds[kind] = kinds.get(kind, 0) + count
        return {
            "skipped_steps": self._carried_skipped + sum(self._skipped.values()),
            "anomalies": dict(sorted(kinds.items())),
            "last_save_s": max(self._last_save.values(), default=None),
            "resume_inexact": [{"reason": why, "ranks": sorted(ranks)} for why, ranks in self._inexact.items()],
            "save_slower_than_interval": self._slow_saves_status(),
        }

    def _slow_saves_status(self) -> dict[str, Any] | None:
        """How many ranks of this attempt said their writes outlast their save interval, and the slowest few."""
        if not self._slow_saves:
            return None
        slowest = sorted(self._slow_saves.items(), key=lambda said: (-said[1].write_s, said[0]))[:MAX_REASONS]
        return {"ranks": len(self._slow_saves), "slowest": [{"rank": rank, **asdict(said)} for rank, said in slowest]}


def _carried_counts(previous: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """(skipped batches, anomalies by kind) from a previous state file, checked as a heartbeat's are (the file is
    untrusted); zero and none for anything not sane."""
    fields = progress_fields({"skipped": previous.get("skipped_steps"), "anomalies": previous.get("anomalies")})
    return fields["skipped"] or 0, dict(fields["anomalies"] or ())
