"""Goodput accounting: the real decision core driven by plain events on a fake clock, split worked out by hand."""

from __future__ import annotations

import math
import random
import signal
import time
from dataclasses import replace
from typing import Any

import pytest

from supervisor.core import (
    ChildExited,
    Event,
    HeartbeatSeen,
    Phase,
    Policy,
    RanksLaunched,
    SignalReceived,
    StacksCollected,
    Started,
    State,
    StopRequested,
    Tick,
    decide,
    initial_state,
)
from supervisor.core.hangs import HangPolicy
from supervisor.core.model import duration
from supervisor.core.stop_requests import StopRequest
from supervisor.observe.goodput import CATEGORIES, KEPT_MAX, KEPT_SAVED, REPORTED, Goodput, describe, ideal_step_time
from supervisor.observe.progress import JournalRecord
from supervisor.observe.status import read_status, render, snapshot, write_status
from worker.contract import RunLayout

POLICY = Policy(
    nproc=2,
    max_restarts=3,
    backoff_initial_s=1.0,
    backoff_factor=2.0,
    backoff_max_s=5.0,
    kill_grace_s=10.0,
    sigkill_wait_s=5.0,
    hang=HangPolicy(phase_timeouts_s={"train": 20.0, "startup": 30.0}, first_heartbeat_s=30.0),
)
T0 = 1000.0  # the supervisor's monotonic clock at Started


class Run:
    """The core's state after each event, shown to a Goodput observer as the runner does; times are offsets."""

    def __init__(self, goodput: Goodput | None = None, policy: Policy = POLICY) -> None:
        self.state: State = initial_state(policy)
        self.goodput = goodput or Goodput()
        self.records: list[JournalRecord] = []
        self._seq: dict[tuple[int, int], int] = {}

    def feed(self, event: Event, at: float) -> None:
        self.state, _ = decide(self.state, event, T0 + at)
        self.records += self.goodput.observe(event, self.state, T0 + at)
        assert_adds_up(self.goodput)

    def start(self, at: float = 0.0, *, resume_step: int | None = None, launched: float = 2.0) -> None:
        self.feed(Started(), at)
        self.launch(launched, resume_step)

    def launch(self, at: float, resume_step: int | None = None) -> None:
        assert self.state.phase is Phase.STARTING, self.state.phase
        self.feed(RanksLaunched(self.state.attempt, (100, 101), resume_step), at)

    def beat(
        self,
        at: float,
        step: int,
        *,
        phase: str = "train",
        save_s: float | None = None,
        ranks: tuple[int, ...] = (0, 1),
        age: float = 0.0,
    ) -> None:
        """Beats written at `at`, read `age` seconds later."""
        for rank in ranks:
            key = (self.state.attempt, rank)
            self._seq[key] = self._seq.get(key, 0) + 1
            beat = HeartbeatSeen(self.state.attempt, rank, self._seq[key], step, phase, save_s=save_s, age_s=age)
            self.feed(beat, at + age)

    def exit(self, at: float, rank: int, code: int, **fields: Any) -> None:
        self.feed(ChildExited(self.state.attempt, rank, code, **fields), at)

    def split(self) -> dict[str, float]:
        return {name: pytest.approx(value, abs=1e-9) for name, value in self.goodput.totals().items()}


def assert_adds_up(goodput: Goodput) -> None:
    totals = goodput.totals()
    assert all(totals[name] >= 0 for name in CATEGORIES), totals
    assert sum(totals[name] for name in CATEGORIES) == pytest.approx(totals["wall_s"], abs=1e-6), totals


def expect(**seconds: float) -> dict[str, Any]:
    """The whole split: the categories named, zero for the others, wall_s their sum."""
    split = {name: seconds.get(name, 0.0) for name in CATEGORIES}
    return {name: pytest.approx(value, abs=1e-9) for name, value in {"wall_s": sum(split.values()), **split}.items()}


def test_clean_run_is_startup_then_productive():
    """Started to the first step is start-up (startup_s: no restart happened); from there to the last rank's clean
    exit is productive."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(55, 50)
    run.beat(105, 100)
    run.exit(106, 0, 0)
    run.exit(106, 1, 0)
    assert run.state.phase is Phase.FINISHED
    assert run.split() == expect(startup_s=5, productive_s=101)
    status = run.goodput.status()["goodput"]
    assert status["ratio"] == round(101 / 106, 4)
    assert run.records == [("info", "goodput", status)]


def test_save_time_comes_out_of_training_as_the_most_any_rank_reports():
    """Cumulative save_s deltas (the highest rank's) move from training to save_s."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(55, 50, phase="save")
    run.beat(58, 50, save_s=2.5, ranks=(1,))
    run.beat(59, 50, save_s=3.0, ranks=(0,))
    run.beat(60, 55, save_s=3.0)
    run.exit(70, 0, 0)
    run.exit(70, 1, 0)
    assert run.split() == expect(startup_s=5, productive_s=62, save_s=3)


def test_crash_loses_the_training_past_the_resume_step():
    """A crash after step 25 resuming from step 15: training from step 15 on (interpolated between the beats at
    steps 10 and 20) and the step in flight are lost; failure to the next first step is restart time."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(15, 10)
    run.beat(25, 20)
    run.beat(30, 25)
    run.exit(32, 1, -signal.SIGKILL)  # the step in flight since t=30: lost at once
    assert run.state.phase is Phase.STOPPING
    assert run.split() == expect(startup_s=5, productive_s=25, lost_s=2)
    run.exit(33, 0, -signal.SIGTERM)
    run.launch(36, resume_step=15)
    assert run.split() == expect(startup_s=5, restart_s=4, productive_s=15, lost_s=2 + 10)
    assert ("info", "work_lost", {"attempt": 1, "resume_step": 15, "last_step": 25, "lost_s": 10.0}) in run.records
    run.beat(40, 16)
    run.beat(90, 65)
    run.exit(91, 0, 0)
    run.exit(91, 1, 0)
    assert run.state.phase is Phase.FINISHED
    assert run.split() == expect(startup_s=5, restart_s=8, productive_s=15 + 51, lost_s=12)


def test_a_resume_past_the_last_step_heard_keeps_the_training_up_to_it():
    """Steps every second, the last beat at step 21 (t=25), the crash at t=29: the 4 s since are lost at once; the
    relaunch resumes from a snapshot of step 23, taken after that beat: 2 steps at the ideal 1 s each go back from
    lost to productive, and no work_lost is said."""
    run = Run()
    run.start()
    for step in range(1, 22):
        run.beat(4 + step, step)
    run.exit(29, 1, -signal.SIGKILL)
    run.exit(30, 0, -signal.SIGTERM)
    assert run.split() == expect(startup_s=5, productive_s=20, lost_s=4, restart_s=1)
    run.launch(31, resume_step=23)
    assert run.split() == expect(startup_s=5, productive_s=22, lost_s=2, restart_s=2)
    assert not [record for record in run.records if record[1] == "work_lost"]


def test_relaunch_from_scratch_loses_every_step():
    """No checkpoint (resume_step None) after a crash: all training of the failed attempt is lost."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(25, 21)
    run.exit(25, 1, 1)
    run.exit(26, 0, -signal.SIGTERM)
    run.launch(27)
    assert run.split() == expect(startup_s=5, restart_s=2, lost_s=20)


def test_hang_counts_from_the_last_progress_to_the_declaration():
    """Silent from step 21 at t=25 until the hang is declared at t=46: hang_s 21; stopping and relaunching until
    the next first step is restart time; step 21 itself, past checkpoint 20, is lost."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(25, 21)
    run.feed(Tick(), 44)
    assert run.state.phase is Phase.RUNNING
    run.feed(Tick(), 46)
    assert run.state.hang is not None and run.state.phase is Phase.STOPPING
    assert run.split() == expect(startup_s=5, productive_s=20, hang_s=21)
    run.feed(StacksCollected(0, ()), 48)
    run.exit(49, 0, -signal.SIGKILL)
    run.exit(50, 1, -signal.SIGKILL)
    run.launch(52, resume_step=20)
    run.beat(55, 21)
    run.beat(59, 25)
    run.exit(60, 0, 0)
    run.exit(60, 1, 0)
    assert run.split() == expect(startup_s=5, restart_s=9, productive_s=19 + 5, hang_s=21, lost_s=1)


def test_hang_before_the_first_step_counts_from_the_launch():
    """Ranks that never show a step until the first-heartbeat timeout: the attempt's start-up was hang waiting."""
    run = Run(policy=replace(POLICY, hang=replace(POLICY.hang, heartbeat="required")))
    run.start()
    run.feed(Tick(), 33)
    assert run.state.hang is not None
    assert run.split() == expect(startup_s=2, hang_s=31)


def test_graceful_stop_keeps_every_step():
    """SIGTERM: ranks save at the agreed step and exit 0: the training up to the exit is kept, nothing stopped."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(20, 16)
    run.feed(SignalReceived(signal.SIGTERM), 21)
    step = run.state.stop_order.step
    run.beat(24, step)
    run.exit(26, 0, 0, stopped_at=step)
    run.exit(26, 1, 0, stopped_at=step)
    assert run.state.phase is Phase.STOPPED
    assert run.split() == expect(startup_s=5, productive_s=21)


def test_forced_stop_is_stopped_time_and_loses_the_step_in_flight():
    """A second Ctrl-C kills the ranks: the step in flight is lost, waiting for them to go down is stopped time."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(20, 16)
    run.feed(SignalReceived(signal.SIGINT), 21)
    run.feed(SignalReceived(signal.SIGINT), 22)
    assert run.state.phase is Phase.STOPPING
    run.exit(23, 0, -signal.SIGKILL)
    run.exit(24, 1, -signal.SIGKILL)
    assert run.state.phase is Phase.STOPPED
    assert run.split() == expect(startup_s=5, productive_s=15, lost_s=2, stopped_s=2)


def forced_stop_status() -> dict[str, Any]:
    """The state file a supervisor left after `test_forced_stop_is_stopped_time_and_loses_the_step_in_flight`."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(20, 16)
    run.feed(SignalReceived(signal.SIGINT), 21)
    run.feed(SignalReceived(signal.SIGINT), 22)
    run.exit(23, 0, -signal.SIGKILL)
    run.exit(24, 1, -signal.SIGKILL)
    return {"state": "stopped", "updated_at": 5000.0, **run.goodput.status()}


def test_supervisor_restart_carries_totals_and_counts_the_gap_as_stopped():
    """A new supervisor 100 s after a stopped one: its totals carry over, the gap is stopped time, and resuming from
    checkpoint 10 loses the steps 10-16 the old one trained (from the kept timeline it left)."""
    run = Run(Goodput(forced_stop_status(), wall_now=5100.0))
    assert run.split() == expect(startup_s=5, productive_s=15, lost_s=2, stopped_s=2 + 100)
    run.start(500, resume_step=10, launched=502)
    assert run.split() == expect(startup_s=5 + 2, productive_s=9, lost_s=2 + 6, stopped_s=102)  # started anew
    run.beat(505, 11)
    run.beat(514, 20)
    run.exit(515, 0, 0)
    run.exit(515, 1, 0)
    assert run.split() == expect(startup_s=10, productive_s=9 + 10, lost_s=8, stopped_s=102)


def test_gap_after_a_supervisor_that_died_mid_run_is_restart_time():
    """A state file left 'running' means the supervisor died: the time until the next one counts as restart."""
    previous = {**forced_stop_status(), "state": "running"}
    totals = Goodput(previous, wall_now=5030.0).totals()
    assert (totals["startup_s"], totals["restart_s"]) == (pytest.approx(5), pytest.approx(30))


@pytest.mark.parametrize("state", ["stopped", "failed"])
def test_gap_after_a_run_that_asked_to_be_requeued_is_restart_time(state: str):
    """Exit 75 (time limit, too few healthy nodes): the wait in Slurm's queue is an outage of the run, not a stop."""
    previous = {**forced_stop_status(), "state": state, "exit_code": 75}
    totals = Goodput(previous, wall_now=5030.0).totals()
    assert (totals["restart_s"], totals["stopped_s"]) == (pytest.approx(30), pytest.approx(2))


@pytest.mark.parametrize("state", [["running"], {"running": 1}, None, 7])
def test_gap_after_a_state_that_is_no_state_is_not_counted(state: Any):
    """A tampered state (even unhashable JSON) names no way the previous supervisor ended: totals carry, no gap."""
    previous = {**forced_stop_status(), "state": state}
    assert Goodput(previous, wall_now=9000.0).totals()["wall_s"] == pytest.approx(24)


def test_gap_after_a_finished_run_is_not_counted():
    """A finished run started again: the time it lay finished was nobody's."""
    previous = {**forced_stop_status(), "state": "finished"}
    assert Goodput(previous, wall_now=9000.0).totals()["wall_s"] == pytest.approx(24)


@pytest.mark.parametrize(
    "goodput",
    [
        None,
        "x",
        [],
        {"productive_s": 5.0},
        {name: 1.0 for name in CATEGORIES} | {"lost_s": -1.0},
        {name: 1.0 for name in CATEGORIES} | {"hang_s": math.nan},
        {name: 1.0 for name in CATEGORIES} | {"save_s": True},
        {name: 1.0 for name in CATEGORIES} | {"restart_s": "3"},
        {name: 1.0 for name in CATEGORIES} | {"stopped_s": 1e400},
        {name: 1.0 for name in CATEGORIES} | {"stopped_s": 10**400},
    ],
)
def test_malformed_previous_totals_are_dropped_with_the_gap(goodput: Any):
    """Totals with any missing, negative, non-finite or non-number category start afresh (and no gap is counted)."""
    fresh = Goodput({"state": "stopped", "updated_at": 1.0, "goodput": goodput}, wall_now=100.0)
    assert fresh.totals() == {"wall_s": 0.0, **dict.fromkeys(CATEGORIES, 0.0)}


@pytest.mark.parametrize(
    "kept",
    [
        None,
        "x",
        [[0, 0.0], [5, 1.0], [3, 2.0]],
        [[0, 0.0], [5, 1.0], [5, 2.0]],
        [[1, 0.0], [5, 1.0]],
        [[0, 0.0], [5, -1.0]],
        [[0, 0.0], [5, True]],
        [[0, 0.0], [5.0, 1.0]],
        [[0, 0.0, 1]],
        [[0, 0.0]] * (KEPT_SAVED + 1),
    ],
)
def test_malformed_kept_timeline_keeps_the_carried_productive_time(kept: Any):
    """Without a usable kept timeline, the carried productive time cannot be placed on steps: none of it is lost."""
    previous = {"state": "stopped", "updated_at": 1.0, "goodput": dict.fromkeys(CATEGORIES, 10.0), "goodput_kept": kept}
    run = Run(Goodput(previous, wall_now=1.0))
    run.start(resume_step=0)
    assert run.goodput.totals()["lost_s"] == pytest.approx(10)
    assert run.goodput.totals()["productive_s"] == pytest.approx(10)


def test_carried_points_above_the_total_or_a_later_point_are_lowered_not_dropped():
    """Save time heard of after a point came out of the training before it: such points are lowered, and a resume
    from step 0 still loses all the carried productive time."""
    previous = {
        "state": "stopped",
        "updated_at": 1.0,
        "goodput": dict.fromkeys(CATEGORIES, 10.0),
        "goodput_kept": [[0, 0.0], [5, 2.0], [6, 1.0], [8, 99.0]],
    }
    run = Run(Goodput(previous, wall_now=1.0))
    assert run.goodput.status()["goodput_kept"] == [[0, 0.0], [5, 1.0], [6, 1.0], [8, 10.0]]
    run.start(resume_step=0)
    assert run.goodput.totals()["lost_s"] == pytest.approx(10 + 10)
    assert run.goodput.totals()["productive_s"] == pytest.approx(0)


def checkpointed_run(*, saves: bool) -> Run:
    """Two ranks train to step 20 and save a checkpoint there (rank 0 in 3 s, rank 1 in 5 s: rank 0 waits for it in
    step 21, whose beat is heard before rank 1's save report); `saves` False: no rank reports save_s."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(15, 10)
    run.beat(25, 20, phase="save")
    run.beat(28, 20, save_s=3.0 if saves else None, ranks=(0,))
    run.beat(30, 21, save_s=3.0 if saves else None, ranks=(0,))
    run.beat(30, 20, save_s=5.0 if saves else None, ranks=(1,))
    return run


def died_at(run: Run, at: float) -> dict[str, Any]:
    """The state file a supervisor last wrote (at a tick, wall clock 5000) before its node crashed mid-run."""
    run.feed(Tick(), at)
    assert run.state.phase is Phase.RUNNING
    return {"state": "running", "updated_at": 5000.0, **run.goodput.status()}


def test_successor_of_a_supervisor_that_died_mid_run_loses_the_training_past_the_checkpoint():
    """Requeued 60 s after a supervisor died at t=42, step 40, resuming from checkpoint 20: the 12 s trained past it
    (t=25-42 less the 5 s save) are lost, the outage is restart time, and the kept timeline written was consistent."""
    run = checkpointed_run(saves=True)
    run.beat(31, 22)
    run.beat(41, 40)
    previous = died_at(run, 42)
    assert previous["goodput_kept"][-4:] == [[20, 20.0], [21, 20.0], [22, 21.0], [40, 31.0]]
    successor = Run(Goodput(previous, wall_now=5060.0))
    successor.start(500, resume_step=20, launched=502)
    assert successor.split() == expect(
        startup_s=5, restart_s=60 + 2, productive_s=20, lost_s=12, save_s=5
    )  # wall_s 104
    assert ("info", "work_lost", {"attempt": 0, "resume_step": 20, "last_step": 40, "lost_s": 12.0}) in (
        successor.records
    )


def test_successor_of_a_supervisor_that_died_just_after_a_late_save_report_loses_the_training_past_it():
    """Died 0.5 s after rank 1's save report took its surplus out of the training already kept: that 0.5 s of
    training past checkpoint 20 is lost, the outage is restart time."""
    previous = died_at(checkpointed_run(saves=True), 30.5)
    successor = Run(Goodput(previous, wall_now=5060.0))
    successor.start(500, resume_step=20, launched=502)
    assert successor.split() == expect(startup_s=5, restart_s=60 + 2, productive_s=20, lost_s=0.5, save_s=5)


def test_successor_of_a_supervisor_that_died_mid_run_without_save_reports_loses_the_training_past_the_checkpoint():
    """The same death with no save_s in the heartbeats: all 17 s trained past checkpoint 20 (t=25-42) are lost."""
    run = checkpointed_run(saves=False)
    run.beat(31, 22)
    run.beat(41, 40)
    successor = Run(Goodput(died_at(run, 42), wall_now=5060.0))
    successor.start(500, resume_step=20, launched=502)
    assert successor.split() == expect(startup_s=5, restart_s=60 + 2, productive_s=20, lost_s=17)


def test_ranks_without_steps_are_start_up_until_a_clean_end_makes_them_productive():
    """A script that reports no steps (no worker library): its attempt counts once it ends, by how it ended."""
    run = Run()
    run.start()
    run.feed(Tick(), 50)
    assert run.split() == expect(startup_s=50)
    run.exit(60, 0, 0)
    run.exit(60, 1, 0)
    assert run.split() == expect(startup_s=2, productive_s=58)


def test_long_run_thins_old_points_yet_rolls_back_exactly_near_the_end():
    """Many more steps than points kept: a rollback to a recent checkpoint still moves exactly the time past it."""
    run = Run()
    run.start()
    for step in range(1, 3 * KEPT_MAX):
        run.goodput.observe(HeartbeatSeen(0, 0, step, step, "train"), run.state, T0 + 2 + step)
    assert len(run.goodput._kept) <= KEPT_MAX
    run.exit(3 * KEPT_MAX + 2, 1, -signal.SIGKILL)
    run.exit(3 * KEPT_MAX + 2, 0, -signal.SIGKILL)
    run.launch(3 * KEPT_MAX + 3, resume_step=3 * KEPT_MAX - 101)
    assert run.goodput.totals()["lost_s"] == pytest.approx(100 + 1)  # steps past the resume step, the one in flight
    assert len(run.goodput.status()["goodput_kept"]) <= KEPT_SAVED


def test_categories_add_up_to_wall_time_whatever_happens():
    """Random launches, beats (with saves), exits, signals and ticks through the real core: the categories never go
    negative and always add up to wall_s (checked after every event by `Run.feed`)."""
    for seed in range(40):
        rng = random.Random(seed)
        run, at = Run(), 0.0
        run.start()
        for _ in range(300):
            if run.state.phase.terminal:
                break
            at += rng.choice([0.0, 0.1, 1.0, 7.0, 30.0])
            if run.state.phase is Phase.STARTING:
                run.launch(at, rng.choice([None, 0, 5, 20, 40]))
                continue
            roll = rng.random()
            if roll < 0.6:
                top = max((r.step or 0) for r in run.state.ranks)
                run.beat(
                    at,
                    top + rng.choice([0, 1, 3]),
                    phase=rng.choice(["train", "train", "save"]),
                    save_s=rng.choice([None, at / 10]),
                    ranks=(rng.randrange(2),),
                )
            elif roll < 0.7:
                run.exit(at, rng.randrange(2), rng.choice([0, 1, -9, -15]))
            elif roll < 0.73:
                run.feed(SignalReceived(rng.choice([signal.SIGINT, signal.SIGTERM])), at)
            else:
                run.feed(Tick(), at)


def test_describe_renders_one_line_and_refuses_malformed_blocks():
    """The human line for status and the final message; anything malformed is no line at all."""
    block = {
        "wall_s": 900.0,
        "productive_s": 724.0,
        "lost_s": 41.0,
        "restart_s": 62.0,
        "save_s": 20.0,
        "hang_s": 0.0,
        "stopped_s": 53.0,
        "ratio": 0.8044,
    }
    assert describe(block) == (
        "goodput 80.4 % (productive 12m04s, lost 41s, start-up 0s, restarts 1m02s, saves 20s, hangs 0s, stopped 53s)"
    )
    assert describe({**block, "ratio": None}).startswith("goodput n/a (")
    for bad in (
        None,
        [],
        {**block, "lost_s": -1},
        {**block, "hang_s": "0"},
        {**block, "wall_s": math.inf},
        {**block, "save_s": 10**400},
    ):
        assert describe(bad) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.4, "0s"),
        (59.4, "59s"),
        (60, "1m00s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (86399, "23h59m"),
        (2 * 86400 + 5 * 3600, "2d05h"),
    ],
)
def test_duration_is_as_precise_as_a_glance_needs(seconds: float, text: str):
    """Seconds, then minutes and seconds, hours and minutes, days and hours."""
    assert duration(seconds) == text


def test_status_render_shows_the_goodput_line_and_skips_a_tampered_one():
    """`trainwarden status` shows the goodput line of the state file; a malformed block is left out, not fatal."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.exit(7, 0, 0)
    run.exit(7, 1, 0)
    status = {"state": "finished", "attempt": 0, "restarts": 0, "ranks": [], **run.goodput.status()}
    line = (
        "goodput 28.6 % (productive 2s, slow steps 0s, lost 0s, start-up 5s, restarts 0s, saves 0s, hangs 0s, "
        "stopped 0s)"
    )
    assert f"\n  {line}\n" in render(status) + "\n"
    for bad in ({"wall_s": "lots"}, [], None, {**status["goodput"], "ratio": math.nan}):
        text = render({**status, "goodput": bad})
        assert ("goodput n/a" in text) if isinstance(bad, dict) and "ratio" in bad else ("goodput" not in text)


def test_no_time_yet_is_no_line():
    """A supervisor that never started the run (its stop file was present) has nothing to say about goodput."""
    assert describe(Goodput().status()["goodput"]) is None


def test_attempt_resuming_at_the_last_step_trains_nothing():
    """Ranks that beat but never pass their resume step (a finished run started again) add only start-up time."""
    run = Run()
    run.start(resume_step=40)
    run.beat(5, 40, phase="startup")
    run.exit(6, 0, 0)
    run.exit(6, 1, 0)
    assert run.state.phase is Phase.FINISHED
    assert run.split() == expect(startup_s=6)


def test_totals_carry_over_through_the_state_file(tmp_path):
    """What one supervisor writes into state.json, the next one's Goodput reads back (as the runner passes it)."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(20, 16)
    run.feed(SignalReceived(signal.SIGINT), 21)
    run.feed(SignalReceived(signal.SIGINT), 22)
    run.exit(23, 0, -signal.SIGKILL)
    run.exit(24, 1, -signal.SIGKILL)
    layout = RunLayout(tmp_path / "run")
    layout.state_file.parent.mkdir(parents=True)
    write_status(layout, snapshot(run.state, now=T0 + 24, extra=run.goodput.status()), durable=False)
    carried = Goodput(read_status(layout), wall_now=time.time())
    assert carried.totals()["stopped_s"] == pytest.approx(2, abs=1)  # the gap: the moments since it was written
    assert carried.status()["goodput_kept"] == run.goodput.status()["goodput_kept"]
    assert {k: v for k, v in carried.totals().items() if k not in ("stopped_s", "wall_s")} == {
        k: pytest.approx(v) for k, v in run.goodput.totals().items() if k not in ("stopped_s", "wall_s")
    }


def test_time_on_fewer_ranks_than_configured_is_counted_apart_and_carried_over():
    """An attempt launched with fewer ranks than the policy's (a Slurm run gone on shrunk) trains productively, and
    its time is also counted as shrunk_s; the summary says so, and a successor keeps the figure."""
    run = Run()
    run.feed(Started(), 0)
    run.feed(RanksLaunched(0, (100,), None), 2)  # one rank of two
    run.beat(5, 1, ranks=(0,))
    run.beat(25, 20, ranks=(0,))
    run.exit(26, 0, 0)
    status = run.goodput.status()["goodput"]
    assert run.split() == expect(startup_s=5, productive_s=21)
    assert status["shrunk_s"] == pytest.approx(24.0)  # from the launch: the whole attempt ran shrunk
    assert describe(status).endswith("; 24s of it on fewer ranks")
    assert Goodput({"goodput": status, "state": "finished"}).status()["goodput"]["shrunk_s"] == pytest.approx(24.0)
    assert "shrunk_s" not in Goodput().status()["goodput"]


# ---- productive time at the ideal step rate ----


def steady_then_slow(run: Run, *, start_step: int = 0) -> None:
    """From step start_step+1 at 5 s: 20 s at 0.1 s a step (10 steps a beat), then 5 s at 0.2 s a step, done at 30 s."""
    run.beat(5, start_step + 1)
    for k in range(1, 21):
        run.beat(5 + k, start_step + 1 + 10 * k)
    for k in range(1, 6):
        run.beat(25 + k, start_step + 201 + 5 * k)
    run.exit(30, 0, 0)
    run.exit(30, 1, 0)


def test_steps_slower_than_the_steady_state_are_slow_time_not_productive():
    """The ideal step time is the steady state (0.1 s); the kept steps at that rate are productive, the rest of their
    training is `slow_s`, and the parts still add up to the wall time."""
    run = Run()
    run.start()
    steady_then_slow(run)
    status = run.goodput.status()["goodput"]
    assert status["ideal_step_s"] == pytest.approx(0.1)
    assert status["productive_s"] == pytest.approx(226 * 0.1)
    assert status["slow_s"] == pytest.approx(25 - 22.6)
    assert status["ratio"] == round(22.6 / 30, 4)
    assert sum(status[name] for name in REPORTED) == pytest.approx(status["wall_s"])
    assert "productive 23s, slow steps 2s" in describe(status)


def test_beats_read_late_are_dated_when_they_were_written():
    """Steady 0.1 s steps, a beat every 10 steps, each read 0 to 0.4 s after its writing (a reader that batches, a
    node agent's message): the samples are the rank's, so the ideal step time is exactly 0.1 s, and start-up ends
    when the first step's beat was written."""
    run = Run()
    run.start()
    for k in range(21):
        run.beat(5 + k, 1 + 10 * k, age=random.Random(k).uniform(0, 0.4))
    assert run.goodput.ideal_step_s() == pytest.approx(0.1)
    assert run.goodput.totals()["startup_s"] == pytest.approx(5)


def test_steps_count_from_where_the_run_started():
    """A run whose first attempt resumes from step 1000 (a checkpoint it was given) trained only the steps after it."""
    run = Run()
    run.start(resume_step=1000)
    steady_then_slow(run, start_step=1000)
    assert run.goodput.status()["goodput"]["productive_s"] == pytest.approx(226 * 0.1)


def test_without_a_steady_state_the_kept_training_is_productive_whole():
    """Fewer than 8 step-time samples: no ideal step time, no slow time."""
    run = Run()
    run.start()
    run.beat(5, 1)
    run.beat(55, 50)
    run.exit(56, 0, 0)
    run.exit(56, 1, 0)
    status = run.goodput.status()["goodput"]
    assert "ideal_step_s" not in status
    assert (status["productive_s"], status["slow_s"]) == (51.0, 0.0)


def test_a_successor_carries_the_kept_training_whole_and_the_ideal_step_time():
    """The next supervisor of the run dir adds productive and slow back together, and reports with the previous
    ideal step time until it has samples of its own."""
    run = Run()
    run.start()
    steady_then_slow(run)
    previous = {"state": "finished", "updated_at": 100.0, **run.goodput.status()}
    successor = Goodput(previous, wall_now=100.0)
    assert successor.totals()["productive_s"] == pytest.approx(25)
    assert successor.ideal_step_s() == pytest.approx(0.1)
    assert successor.status()["goodput"]["productive_s"] == pytest.approx(22.6)


@pytest.mark.parametrize(
    ("samples", "ideal"),
    [
        ([(0.1, 10)] * 7, None),  # too few
        ([(0.1, 10)] * 20 + [(0.5, 5)] * 3, 0.1),  # slow outliers out
        ([(0.1, 10)] * 10 + [(0.12, 10)] * 10 + [(0.0001, 1)], 0.11),  # a fast outlier out too
        ([(0.10, 10), (0.11, 10), (0.12, 10), (0.13, 10)] * 2, 0.115),  # no outlier: all of them
        ([(0.05, 10)] * 10 + [(0.08, 6)] * 12, 0.05),  # more samples slow, more steps fast: the steps decide
    ],
)
def test_ideal_step_time_is_the_step_weighted_mean_within_three_mads_of_the_median(samples, ideal):
    assert ideal_step_time(samples) == (None if ideal is None else pytest.approx(ideal))


def test_a_first_attempt_that_fails_before_any_step_is_start_up_then_restart():
    """The first attempt dies before its first step: start-up up to its failure; the relaunch is restart time."""
    run = Run()
    run.start()
    run.exit(4, 0, -signal.SIGKILL)
    run.exit(4, 1, -signal.SIGKILL)
    run.feed(Tick(), 5)
    run.launch(6)
    run.beat(8, 1)
    run.beat(18, 11)
    assert run.split() == expect(startup_s=4, restart_s=4, productive_s=10)


def test_a_stop_while_no_rank_runs_loses_the_training_past_the_newest_complete_state():
    """A successor (the supervisor died at t=42, step 40) stopped before it launched, by a stop request or by the
    stop file present at its start: the run ends at checkpoint 20, and the 12 s trained past it are lost, as they
    would be had it resumed from there (not `lost 0s`)."""
    run = checkpointed_run(saves=True)
    run.beat(31, 22)
    run.beat(41, 40)
    previous = died_at(run, 42)
    successor = Run(Goodput(previous, wall_now=5060.0))
    successor.feed(Started(), 500)
    successor.feed(StopRequested(StopRequest(None, True, "stop file x"), newest_step=20), 501)
    assert (successor.state.phase, successor.state.stopped_at) == (Phase.STOPPED, 20)
    assert successor.split() == expect(startup_s=5, restart_s=60 + 1, productive_s=20, lost_s=12, save_s=5)
    assert ("info", "work_lost", {"attempt": 0, "stopped_at": 20, "last_step": 40, "lost_s": 12.0}) in (
        successor.records
    )
    at_start = Run(Goodput(previous, wall_now=5060.0))  # the runner's stop_file_present: the state set, then a Tick
    at_start.state = replace(at_start.state, phase=Phase.STOPPED, stopped_at=20)
    at_start.feed(Tick(), 500)
    assert at_start.split() == expect(startup_s=5, restart_s=60, productive_s=20, lost_s=12, save_s=5)


def test_gap_after_slurm_requeued_the_job_is_restart_time():
    """`scontrol requeue` SIGTERMs the job (the run ends stopped, exit 0) and runs it again under the same id: the
    wait in between is an outage of the run, not a stop; another job after a stop is still a stop."""
    previous = {**forced_stop_status(), "state": "stopped", "exit_code": 0, "slurm_job": "42"}
    totals = Goodput(previous, wall_now=5030.0, job="42").totals()
    assert (totals["restart_s"], totals["stopped_s"]) == (pytest.approx(30), pytest.approx(2))
    totals = Goodput(previous, wall_now=5030.0, job="43").totals()
    assert (totals["restart_s"], totals["stopped_s"]) == (pytest.approx(0), pytest.approx(32))


def test_work_lost_at_a_crash_counts_from_the_last_step_heard_not_the_last_state_written():
    """The supervisor's host crashed 5 s after it last wrote its state (t=42, step 40); its ranks beat up to step 50
    meanwhile. Those 5 s were training, not the outage: resuming from checkpoint 20 loses 12 + 5 s, and a resume
    from a checkpoint newer than the state file (45) still loses the training past it (not `lost 0s`)."""
    run = checkpointed_run(saves=True)
    run.beat(31, 22)
    run.beat(41, 40)
    previous = died_at(run, 42)
    successor = Run(Goodput(previous, wall_now=5060.0, last_beat=(50, 5005.0)))
    successor.start(500, resume_step=20, launched=502)
    assert successor.split() == expect(startup_s=5, restart_s=55 + 2, productive_s=20, lost_s=12 + 5, save_s=5)
    newer = Run(Goodput(previous, wall_now=5060.0, last_beat=(50, 5005.0)))
    newer.start(500, resume_step=45, launched=502)
    assert newer.split()["lost_s"] == pytest.approx(3)  # half of the 6 s from step 40's point (31 s) to 50's (37 s)
    stale = Run(Goodput(previous, wall_now=5060.0, last_beat=(40, 5005.0)))  # no step past the state file's
    assert stale.split() == Run(Goodput(previous, wall_now=5060.0)).split()
    # A beat written before the state file but not heard by then (agents batch beats): no time moves, but its step
    # does: the training the state file holds past step 40 (its tail, t=41-42) belonged to steps 40-50.
    unheard = Run(Goodput(previous, wall_now=5060.0, last_beat=(50, 4999.0)))
    unheard.start(500, resume_step=45, launched=502)
    assert unheard.split()["lost_s"] == pytest.approx(0.5) and unheard.split()["restart_s"] == pytest.approx(62)
