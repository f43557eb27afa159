"""Goodput (effective training time ratio): where the run's wall time went, kept across supervisor restarts.

Pure bookkeeping on the supervisor's monotonic clock, from the events the runner shows observers. The time between
two events goes to exactly one category (the one the state after the first of them says), and later facts only move
time between categories, so the categories always add up to `wall_s`:

- `wall_s`: the time supervisors of this run dir have supervised it (from `Started` to the end, all lifetimes
  together), plus the gaps between lifetimes counted below (stopped, or a supervisor's death).
- `productive_s`: the steps kept at the ideal step time: (the newest step kept - the step the run started from) x
  `ideal_step_s`. Every other second is badput, in one of the categories below.
- `slow_s`: training of kept steps beyond the ideal step time: steps slowed after a relaunch (standbys refilling,
  cold caches, rebuilt buckets), by other work on the machine, or by a slow rank.
- `ideal_step_s`: the run's own steady-state step time: the step-weighted mean of its recent step-time samples
  (training time between the writing of two heartbeats that showed progress, over the steps between them, saves
  taken out; a beat read late is dated by its age, so the supervisor's reading rhythm adds no jitter) that lie
  within median + 3 x MAD of them. Until RATE_SAMPLES_MIN samples exist (and no earlier supervisor left one), there
  is none, and training of kept steps counts as productive whole.
- `lost_s`: training that was thrown away. When an attempt resumes from step R, the time earlier attempts trained
  past step R (up to their last progress) moves from productive to lost; the time from an attempt's last progress to
  its failure or forced stop (the step in flight) is lost at once, and given back to training when the next attempt
  resumes from a step past the last one heard (a snapshot taken after the last beat: at the ideal step time per step
  up to it, at most all of it). An anomaly rollback (resuming further back) and a
  supervisor that died mid-run (its successor resumes from the newest checkpoint) lose work the same way, and so
  does a run that ends stopped at step S (`stopped_at`: a stop while no rank ran ends at the newest complete state).
- `startup_s`: the run's start-up, unproductive as in ByteRobust's accounting, but no failure's: from the
  supervisor's process start (Python, imports, the config) through the first launch to its first step progress, or
  to the end of that first attempt if it never got there. A supervisor that takes over after one died mid-run or
  asked to be requeued is restarting the run, not starting it: its start-up is `restart_s`.
- `restart_s`: downtime from a failure to the next attempt's first step progress: stopping the failed attempt,
  backoff, process start, checkpoint load, up to the first step; also the gap while no supervisor ran after one
  died mid-run (the state file was left in a non-final state) or ended asking to be requeued (exit 75: a job's
  time limit, too few healthy nodes) or was stopped by Slurm requeueing its job (`scontrol requeue`: the next
  supervisor runs in the same job), and the successor's own start-up. 0 in a run without a restart.
- `save_s`: time spent saving checkpoints, from the heartbeats' cumulative `save_s` (the most any rank of the attempt
  reports), taken out of training time (kept or not); saves of checkpoints never used count here too.
- `hang_s`: from the last progress of an attempt to the moment a hang is declared (from the launch, for a hang
  before the first step); stopping the hung attempt afterwards is restart time.
- `stopped_s`: time stopping on request (the core STOPPING to stop, not to relaunch), and the wall-clock gap
  (time.time()) between a supervisor that ended stopped or failed and the next one of this run dir.
- `ratio`: productive_s / wall_s: the share of the wall time the kept steps would take at the ideal rate.
- `shrunk_s` (beside the categories, part of them): time attempts ran with fewer ranks than configured (a Slurm run
  gone on with fewer nodes, `slurm.min_nodes`): productive, but at a fraction of the configured capacity.

A run whose ranks send no heartbeats (no worker library) shows only start-up while running; an attempt of it that
ends cleanly counts as productive. An attempt that beats but never gets past its resume step trained nothing.
Training of kept steps is tracked first as a whole (the kept timeline below), and split into productive and slow when
reported; a successor supervisor carries the whole (productive_s + slow_s) and `ideal_step_s` on.
Steps are tracked as a kept timeline, (step, productive seconds when it was first seen) points, thinned in the past;
rolling back to step R interpolates between the points around R. Save time reported after a point was recorded (a
slower rank's save, a heartbeat seen late) can leave less productive time than the point holds: it came out of the
training before the point, so points above the productive total (or above a later point) are lowered to it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from supervisor.core import Event, HeartbeatSeen, Phase, RanksLaunched, State, Then
from supervisor.core.model import duration
from supervisor.observe.progress import JournalRecord
from worker.contract import EXIT_REQUEUE

__all__ = ["CATEGORIES", "REPORTED", "Goodput", "describe", "ideal_step_time"]

CATEGORIES = ("productive_s", "lost_s", "startup_s", "restart_s", "save_s", "hang_s", "stopped_s")  # slow_s is split
OPTIONAL = ("startup_s",)  # categories a state file of an older version lacks: 0 there
REPORTED = ("productive_s", "slow_s", *CATEGORIES[1:])  # the status's, adding up to wall_s
KEPT_MAX = 4096  # kept-timeline points in memory: the recent ones at full resolution, older ones thinned
KEPT_SAVED = 32  # of them, in the state file for the next supervisor (a rollback after its death)
KEPT_RECENT = 16  # of those, the newest: a resume goes back to a recent checkpoint
RATE_SAMPLES = 2048  # step-time samples kept (the newest): at a heartbeat every 0.5 s, the last 17 minutes
RATE_SAMPLES_MIN = 8  # fewer: no steady state to speak of yet
_TAIL = "tail"  # training since the attempt's last progress: kept if the attempt ends well, else lost or a hang


class Goodput:
    """Splits wall time into productive, lost, start-up, restart, save, hang and stopped time; see the module
    docstring."""

    def __init__(
        self,
        previous: Mapping[str, Any] | None = None,
        *,
        wall_now: float = math.nan,
        process_started: float | None = None,
        job: str | None = None,
        last_beat: tuple[int, float] | None = None,
    ) -> None:
        """`previous`: the state file an earlier supervisor of this run dir left (its totals carry over);
        `wall_now`: time.time() now, for the gap since it was written; `process_started`: when this supervisor's
        process started, on the monotonic clock (its own start-up, before the first event, is start-up time too);
        `job`: the Slurm job this supervisor runs in (an earlier one of the same job was ended by a requeue);
        `last_beat`: (step, wall time) of the newest heartbeat of the attempt an earlier supervisor that died mid-run
        was running (its host crashed): it trained up to there after it last wrote its state."""
        carried, self._kept = _carried(previous or {})  # kept: (step, productive_s when first seen), from step 0
        self._ideal_carried = _carried_ideal(previous or {}) if carried else None
        self._origin = _carried_origin(previous or {}) if carried else None  # None: the first launch's resume step
        self._rates: deque[tuple[float, int]] = deque(maxlen=RATE_SAMPLES)  # (seconds per step, steps)
        self._totals = {name: carried.get(name, 0.0) for name in CATEGORIES}
        gap, category = _gap(previous or {}, wall_now, job) if carried else (0.0, None)  # no totals: nothing known
        if category is not None:
            self._totals[category] += gap
        if category == "restart_s" and last_beat is not None:
            self._heard_after(last_beat, previous or {}, gap)
        self._process_started = process_started if category is None else None  # else the gap holds it
        self._starting = category != "restart_s"  # downtime is start-up until the first attempt trains or ends
        self._wall = sum(self._totals.values())
        self._tail = 0.0
        self._failed_tail = 0.0  # training since the last progress that a failure lost, until the relaunch's resume
        self._last: float | None = None  # monotonic time of the last event seen
        self._category: str | None = None  # where the time from `_last` on goes
        self._attempt: int | None = None  # the attempt whose progress is tracked
        self._running = False  # it was RUNNING after the last event
        self._launched_at = 0.0
        self._top = 0  # the highest step it showed (progress is a step above it)
        self._progressed = False
        self._heard = False  # it sent a heartbeat: it reports its steps (the worker library)
        self._trained = 0.0  # productive time of this attempt, for save time to come out of
        self._saves: dict[int, float] = {}  # rank -> cumulative save_s its process reported
        self._ended = False
        self._shrunk = float(carried.get("shrunk_s", 0.0))

    def observe(self, event: Event, state: State, now: float) -> list[JournalRecord]:
        if self._last is None and self._process_started is not None and now > self._process_started:
            self._add(self._down, now - self._process_started)  # Python, imports, the config: a stopwatch's start
            self._wall += now - self._process_started
        if self._last is not None and self._category is not None and now > self._last:
            self._add(self._category, now - self._last)
            self._wall += now - self._last
            if self._running and len(state.ranks) < state.policy.nproc:
                self._shrunk += now - self._last
        self._last = now if self._last is None else max(self._last, now)
        records: list[JournalRecord] = []
        if isinstance(event, RanksLaunched) and event.attempt == state.attempt and state.phase is Phase.RUNNING:
            records += self._launched(event, now)
        elif isinstance(event, HeartbeatSeen) and event.attempt == self._attempt and self._running:
            self._beat(event)
        if self._running and (state.phase is not Phase.RUNNING or state.attempt != self._attempt):
            self._attempt_ended(state, now)
        self._running = state.phase is Phase.RUNNING and state.attempt == self._attempt
        self._category = _category(state, self._progressed)
        if self._category == "restart_s":
            self._category = self._down
        if state.phase.terminal and not self._ended:
            self._ended = True
            if state.phase is Phase.STOPPED and state.stopped_at is not None:
                records += self._stopped_at(state, state.stopped_at)
            records.append(("info", "goodput", self.status()["goodput"]))
        return records

    def totals(self) -> dict[str, float]:
        """Seconds per category (unrounded; training since the last progress counts as productive) and wall_s."""
        totals = dict(self._totals)
        totals["productive_s"] += self._tail
        return {"wall_s": self._wall, **totals}

    def ideal_step_s(self) -> float | None:
        """The run's steady-state step time (see the module docstring); None while unknown."""
        return ideal_step_time(self._rates) or self._ideal_carried

    def status(self) -> dict[str, Any]:
        totals = self.totals()
        ideal = self.ideal_step_s()
        kept_s = totals["productive_s"]
        if ideal is not None:  # kept steps at the ideal rate; the rest of their training was slow
            steps = max(0, self._kept[-1][0] - (self._origin or 0))
            totals["productive_s"] = min(kept_s, steps * ideal)
        totals["slow_s"] = kept_s - totals["productive_s"]
        ratio = totals["productive_s"] / totals["wall_s"] if totals["wall_s"] > 0 else None
        goodput = {name: round(value, 3) for name, value in totals.items()}
        shrunk = {"shrunk_s": round(self._shrunk, 3)} if self._shrunk else {}
        ideal_block = {} if ideal is None else {"ideal_step_s": round(ideal, 6)}
        return {
            "goodput": {**goodput, "ratio": None if ratio is None else round(ratio, 4), **ideal_block, **shrunk},
            "goodput_kept": [[step, round(kept, 3)] for step, kept in _saved_points(self._kept)],
            "goodput_origin_step": self._origin or 0,
        }

    # ---- events ----

    def _launched(self, event: RanksLaunched, now: float) -> list[JournalRecord]:
        self._attempt, self._launched_at = event.attempt, now
        if self._origin is None:  # the run's first launch: its steps count from here
            self._origin = max(0, event.resume_step or 0)
        self._top = max(0, event.resume_step or 0)
        self._progressed, self._heard, self._trained, self._saves = False, False, 0.0, {}
        self._add("productive_s", self._take(_TAIL, self._tail))  # nothing pending normally: a failure resolved it
        before = self._kept[-1][0]
        self._keep_tail_up_to(self._top)
        lost = self._roll_back(self._top)
        if lost <= 0:
            return []
        return [
            (
                "info",
                "work_lost",
                {
                    "attempt": event.attempt,
                    "resume_step": event.resume_step,
                    "last_step": before,
                    "lost_s": round(lost, 3),
                },
            )
        ]

    def _beat(self, event: HeartbeatSeen) -> None:
        self._heard = True
        if event.save_s is not None and math.isfinite(event.save_s) and event.save_s >= 0:
            before = max(self._saves.values(), default=0.0)
            self._saves[event.rank] = event.save_s
            saved = max(self._saves.values()) - before
            if saved > 0:  # out of the training since the last progress first, then of this attempt's kept time
                moved = self._take(_TAIL, saved)
                taken = self._take("productive_s", min(saved - moved, self._trained))
                if taken > 0:
                    self._kept = _lowered(self._kept, self._totals["productive_s"])
                self._add("save_s", moved + taken)
        if event.step > self._top:
            if self._progressed:  # up to when the beat was written: what came after is the next sample's
                trained = self._take(_TAIL, self._tail - event.age_s)
                self._add("productive_s", trained)
                if trained > 0:  # a step-time sample: training since the last progress, saves taken out
                    self._rates.append((trained / (event.step - self._top), event.step - self._top))
            else:  # the first progress: since it was written the rank trained, it was not starting up
                self._add(_TAIL, self._take(self._down, event.age_s))
                self._starting = False
            self._progressed, self._top = True, event.step
            self._kept.append((event.step, self._totals["productive_s"]))
            if len(self._kept) > KEPT_MAX:
                self._kept = _thinned(self._kept)

    def _heard_after(self, last_beat: tuple[int, float], previous: Mapping[str, Any], gap: float) -> None:
        """A supervisor that died mid-run trained up to `last_beat` after it last wrote its state: that time of the
        gap was training (a resume from an older step loses it), not the outage; the work lost at a crash counts from
        the last step heard, not from the last state written."""
        step, at = last_beat
        if step <= self._kept[-1][0]:
            return
        # Beats reach the supervisor a second or so after the ranks write them (an agent batches them): a beat written
        # before the state file may be newer than anything in it. The training up to the state file is its tail.
        since = at - previous["updated_at"]  # _gap checked updated_at
        moved = max(0.0, min(since, gap, self._totals["restart_s"])) if math.isfinite(since) else 0.0
        self._totals["restart_s"] -= moved
        self._totals["productive_s"] += moved
        self._kept.append((step, self._totals["productive_s"]))

    def _stopped_at(self, state: State, step: int) -> list[JournalRecord]:
        """The run ended stopped at `step`: what was trained past it is lost. Ranks saving at an agreed step trained
        nothing past it; a stop while no rank ran (a backoff, a takeover) ends at the newest complete state, and the
        steps trained since it are done again when the run is resumed."""
        before = self._kept[-1][0]
        lost = self._roll_back(step)
        if lost <= 0:
            return []
        fields = {"attempt": state.attempt, "stopped_at": step, "last_step": before, "lost_s": round(lost, 3)}
        return [("info", "work_lost", fields)]

    def _attempt_ended(self, state: State, now: float) -> None:
        """The tracked attempt left RUNNING: its training since the last progress is kept, lost or a hang."""
        hang = state.hang is not None and state.hang.attempt == self._attempt
        clean = state.phase in (Phase.FINISHED, Phase.STOPPED) and all(r.returncode == 0 for r in state.ranks)
        if hang and not self._progressed:  # hung before its first step: its whole start-up was waiting for it
            self._add("hang_s", self._take(self._down, now - self._launched_at))
        elif clean and not self._heard:  # no heartbeat (no worker library), yet it did its work
            self._add("productive_s", self._take(self._down, now - self._launched_at))
        category = "hang_s" if hang else "productive_s" if clean else "lost_s"
        tail = self._take(_TAIL, self._tail)
        self._add(category, tail)
        self._failed_tail = tail if category == "lost_s" else 0.0
        self._starting = False  # whatever comes next follows a failure or a stop

    def _keep_tail_up_to(self, step: int) -> None:
        """A resume from `step`, past the last step heard (a snapshot the failed attempt took after its last beat):
        the training up to it, lost at the failure, was kept after all, at the ideal step time per step (all of it
        while that is unknown)."""
        tail, self._failed_tail = self._failed_tail, 0.0
        heard = self._kept[-1][0]
        if tail <= 0 or step <= heard:
            return
        ideal = self.ideal_step_s()
        kept = tail if ideal is None else min(tail, (step - heard) * ideal)
        self._totals["lost_s"] -= kept
        self._totals["productive_s"] += kept
        self._kept.append((step, self._totals["productive_s"]))

    # ---- the kept timeline ----

    def _roll_back(self, step: int) -> float:
        """Training past `step` will be done again: it moves from productive to lost; the seconds moved."""
        kept = self._kept
        if kept[-1][0] <= step:
            return 0.0
        i = bisect.bisect_right(kept, (step, math.inf)) - 1  # kept[0] is step 0: i >= 0 for any step >= 0
        (s0, c0), (s1, c1) = kept[i], kept[i + 1]
        at = min(c0 + (c1 - c0) * (step - s0) / (s1 - s0), self._totals["productive_s"])
        del kept[i + 1 :]
        if step > s0:
            kept.append((step, at))
        lost = self._take("productive_s", self._totals["productive_s"] - at)
        self._add("lost_s", lost)
        return lost

    # ---- moving seconds ----

    @property
    def _down(self) -> str:
        """Where time waiting for a step goes: start-up before the run's first attempt trained, else restart."""
        return "startup_s" if self._starting else "restart_s"

    def _add(self, category: str, seconds: float) -> None:
        if category == _TAIL:
            self._tail += seconds
            return
        self._totals[category] += seconds
        if category == "productive_s":
            self._trained += seconds

    def _take(self, category: str, seconds: float) -> float:
        """Take up to `seconds` out of `category` (never below zero); what was taken."""
        if category == _TAIL:
            taken = max(0.0, min(seconds, self._tail))
            self._tail -= taken
            return taken
        taken = max(0.0, min(seconds, self._totals[category]))
        self._totals[category] -= taken
        if category == "productive_s":
            self._trained = max(0.0, self._trained - taken)
        return taken


def ideal_step_time(samples: Iterable[tuple[float, int]]) -> float | None:
    """The step-weighted mean of the (seconds per step, steps) samples whose seconds per step lie within median +- 3
    MAD of them all (both weighted by steps): the steady state, without the slow steps after a relaunch or a stall;
    None for too few."""
    samples = list(samples)
    if len(samples) < RATE_SAMPLES_MIN:
        return None
    median = _weighted_median(samples)
    mad = _weighted_median([(abs(rate - median), steps) for rate, steps in samples])
    steady = [(rate, steps) for rate, steps in samples if abs(rate - median) <= 3 * mad]
    return sum(rate * steps for rate, steps in steady) / sum(steps for _, steps in steady)


def _weighted_median(samples: Iterable[tuple[float, int]]) -> float:
    """The value below which half the steps lie: slow stretches get fewer steps per second of samples, so the steps,
    not the samples, say which rate is the usual one."""
    ordered = sorted(samples)
    half, seen = sum(steps for _, steps in ordered) / 2, 0
    for value, steps in ordered:
        seen += steps
        if seen >= half:
            return value
    return ordered[-1][0]


def _category(state: State, progressed: bool) -> str | None:
    """Where the time after an event goes, by the state it left."""
    if state.phase is Phase.RUNNING:
        return _TAIL if progressed else "restart_s"
    if state.phase is Phase.STOPPING:
        return "stopped_s" if state.then is Then.STOP else "restart_s"
    if state.phase.terminal:
        return None
    return "restart_s"  # STARTING, BACKOFF


def _thinned(kept: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Every other point of the older half dropped (the first, step 0, stays): recent steps keep full resolution."""
    half = len(kept) // 2
    return [kept[0], *kept[2:half:2], *kept[half:]]


def _lowered(kept: list[tuple[int, float]], productive: float) -> list[tuple[int, float]]:
    """No point above the productive total or a later point: save time reported after it came out of the training
    before it."""
    lowered: list[tuple[int, float]] = []
    for step, seconds in reversed(kept):
        productive = min(productive, seconds)
        lowered.append((step, productive))
    return lowered[::-1]


def _saved_points(kept: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most KEPT_SAVED points: the first, some spread over the past, and the newest KEPT_RECENT."""
    if len(kept) <= KEPT_SAVED:
        return kept
    past = kept[1:-KEPT_RECENT]
    stride = -(-len(past) // (KEPT_SAVED - KEPT_RECENT - 1))
    return [kept[0], *past[::stride], *kept[-KEPT_RECENT:]]


# ---- what an earlier supervisor left (the run dir is untrusted: anything invalid is dropped) ----


def _seconds(value: Any) -> TypeGuard[int | float]:
    """A finite, non-negative number (JSON's ints may be too large for a float)."""
    try:
        return type(value) in (int, float) and math.isfinite(value) and value >= 0
    except OverflowError:
        return False


def _carried(previous: Mapping[str, Any]) -> tuple[dict[str, float], list[tuple[int, float]]]:
    """The previous totals (all valid, or none) and its kept timeline (or one point holding all its productive
    time: without steps, none of it can be rolled back)."""
    goodput = previous.get("goodput")
    if not isinstance(goodput, Mapping):
        return {}, [(0, 0.0)]
    goodput = {**dict.fromkeys(OPTIONAL, 0.0), **goodput}
    if not all(_seconds(goodput.get(name)) for name in CATEGORIES):
        return {}, [(0, 0.0)]
    totals = {name: float(goodput[name]) for name in CATEGORIES}
    if _seconds(goodput.get("slow_s")):  # reported apart; tracked as training of kept steps
        totals["productive_s"] += float(goodput["slow_s"])
    if _seconds(goodput.get("shrunk_s")):
        totals["shrunk_s"] = float(goodput["shrunk_s"])
    kept = _carried_points(previous.get("goodput_kept"), totals["productive_s"])
    return totals, kept or [(0, totals["productive_s"])]


def _carried_ideal(previous: Mapping[str, Any]) -> float | None:
    """The previous supervisor's ideal step time, while this one has too few samples of its own."""
    ideal = _mapping(previous.get("goodput")).get("ideal_step_s")
    return float(ideal) if _seconds(ideal) and ideal > 0 else None


def _carried_origin(previous: Mapping[str, Any]) -> int:
    """The step the run started from (0 where an older version or a damaged file does not say)."""
    origin = previous.get("goodput_origin_step")
    return origin if type(origin) is int and 0 <= origin < 2**63 else 0


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _carried_points(points: Any, productive: float) -> list[tuple[int, float]] | None:
    """The saved points: from step 0, in rising steps, lowered as `_lowered` does (a file may hold them unlowered:
    an older version wrote it, or a person edited it); None for anything malformed."""
    if not isinstance(points, list) or not 0 < len(points) <= KEPT_SAVED:
        return None
    kept: list[tuple[int, float]] = []
    for point in points:
        if not isinstance(point, list) or len(point) != 2:
            return None
        step, seconds = point
        if type(step) is not int or not _seconds(seconds) or (kept and step <= kept[-1][0]):
            return None
        kept.append((step, float(seconds)))
    return _lowered(kept, productive) if kept[0][0] == 0 else None


def _gap(previous: Mapping[str, Any], wall_now: float, job: str | None = None) -> tuple[float, str | None]:
    """The wall-clock time since the previous supervisor last wrote its state, and where it goes: stopped after a
    stop or a failure, restart after a supervisor that died mid-run or asked to be requeued (exit 75: the time
    limit, too few healthy nodes; the queue wait is an outage of the run) or whose job Slurm requeued (`scontrol
    requeue`: its SIGTERM stopped the run, and the same job, `job`, runs again); nowhere after a finished run."""
    updated_at = previous.get("updated_at")
    if not _seconds(updated_at) or not math.isfinite(wall_now):
        return 0.0, None
    died = ("starting", "running", "stopping", "backoff")  # its successor restarts the run
    state = previous.get("state")  # a string, unless the file was damaged: then it is no state we know
    categories = {"stopped": "stopped_s", "failed": "stopped_s", **dict.fromkeys(died, "restart_s")}
    category = categories.get(state) if isinstance(state, str) else None
    requeued = job is not None and previous.get("slurm_job") == job  # the same job again: Slurm requeued it
    if category == "stopped_s" and (previous.get("exit_code") == EXIT_REQUEUE or requeued):
        category = "restart_s"
    return max(0.0, wall_now - updated_at), category


# ---- for people ----


def describe(goodput: Any) -> str | None:
    """'goodput 87.3 % (productive 12m04s, lost 41s, ...)'; None for a missing or malformed block, or no time yet."""
    if not isinstance(goodput, Mapping):
        return None
    goodput = {**dict.fromkeys(OPTIONAL, 0.0), **goodput}
    if not all(_seconds(goodput.get(n)) for n in ("wall_s", *CATEGORIES)):
        return None
    if goodput["wall_s"] == 0:
        return None
    ratio = goodput.get("ratio")
    share = f"{100 * ratio:.1f} %" if _seconds(ratio) else "n/a"
    parts = [
        ("productive", "productive_s"),
        *([("slow steps", "slow_s")] if _seconds(goodput.get("slow_s")) else []),
        ("lost", "lost_s"),
        ("start-up", "startup_s"),
        ("restarts", "restart_s"),
        ("saves", "save_s"),
        ("hangs", "hang_s"),
        ("stopped", "stopped_s"),
    ]
    shrunk = f"; {duration(goodput['shrunk_s'])} of it on fewer ranks" if _seconds(goodput.get("shrunk_s")) else ""
    return f"goodput {share} (" + ", ".join(f"{word} {duration(goodput[key])}" for word, key in parts) + f"){shrunk}"
