"""`snapshot_steps: auto` (worker.cadence): the interval from measured costs and failures, with plain values."""

from __future__ import annotations

import math

import pytest

from supervisor.config import JobConfig
from supervisor.launch.ranks import Attempt, rank_envs
from supervisor.launch.standby import PER_ATTEMPT
from worker.cadence import (
    CONFIRM,
    MEASURED_FIRST,
    PRIOR_MTBF_S,
    Inputs,
    SnapshotCadence,
    SnapshotSchedule,
    choose_interval,
    mtbf_estimate,
    young_daly_s,
)
from worker.contract import ENV_FAILURES, RunLayout, failures_env, parse_failures

HOUR = 3600.0


def cadence_after(stall_s: float, step_s: float) -> SnapshotCadence:
    """A cadence that saw a few steps of `step_s` and its first snapshots, each stalling `stall_s`."""
    cadence = SnapshotCadence()
    for _ in range(4):
        cadence.step_measured(step_s)
    for _ in range(MEASURED_FIRST):
        cadence.snapshot_measured(stall_s)
    return cadence


@pytest.mark.parametrize("stall_s", [0.0005, 0.001])
def test_a_copy_into_memory_with_the_demos_steps_snapshots_every_step_or_two(stall_s):
    """The demo's ~40 ms steps and a ~1 ms copy into /dev/shm: the overhead budget sets 1-2 steps."""
    choice = choose_interval(Inputs(stall_s=stall_s, step_s=0.040))
    assert choice.rule == "overhead_budget"
    assert choice.interval_steps in (1, 2)
    assert choice.young_daly_steps > 40  # Young/Daly alone, with the prior, would wait far longer


def test_the_demo_case_gives_exactly_two_steps_for_a_millisecond():
    """1 ms of a 40 ms step is 2.5 %: every second step keeps the overhead within 2 %."""
    assert choose_interval(Inputs(stall_s=0.001, step_s=0.040)).interval_steps == 2


def test_torch_save_of_the_demo_on_a_loaded_cpu_is_still_cheap():
    """6 ms of a 40 ms step (15 %, torch.save of the demo's state on a busy CPU) is cheap: every 8 steps keeps the
    overhead within 2 %, where Young/Daly with the prior would snapshot only every ~160 steps."""
    choice = choose_interval(Inputs(stall_s=0.006, step_s=0.040))
    assert (choice.rule, choice.interval_steps) == ("overhead_budget", 8) and choice.young_daly_steps > 150


def test_an_expensive_snapshot_gets_young_dalys_interval():
    """A 0.5 s stall on 1 s steps with failures every hour: √(2 × 0.5 × 3600) = 60 s, 60 steps."""
    choice = choose_interval(Inputs(stall_s=0.5, step_s=1.0, prior_mtbf_s=HOUR))
    assert choice.rule == "young_daly"
    assert choice.interval_steps == round(math.sqrt(2 * 0.5 * HOUR) / 1.0) == 60
    assert choice.mtbf_s == HOUR
    assert "Young/Daly" in choice.reason


def test_dalys_higher_order_matches_his_published_cases():
    """Daly (2006): δ = 5 min gives 117 min at M = 24 h and 57 min at 6 h; δ ≥ 2M gives M."""
    assert young_daly_s(300, 24 * HOUR) / 60 == pytest.approx(117, abs=0.5)
    assert young_daly_s(300, 6 * HOUR) / 60 == pytest.approx(57, abs=0.5)
    assert young_daly_s(100, 40) == 40
    assert young_daly_s(0, HOUR) == 0


def test_the_interval_is_never_below_one_step():
    """A free snapshot (or steps much longer than Young/Daly's interval) still waits one step."""
    assert choose_interval(Inputs(stall_s=0.0, step_s=0.04)).interval_steps == 1
    assert choose_interval(Inputs(stall_s=0.5, step_s=600.0)).interval_steps == 1


def test_the_interval_is_clamped_to_the_disk_interval_in_steps():
    """Young/Daly's 60 steps, with disk saves every 25 steps: 25 (rarer snapshots would add nothing)."""
    choice = choose_interval(Inputs(stall_s=0.5, step_s=1.0, disk_every_steps=25))
    assert (choice.interval_steps, choice.rule) == (25, "disk_interval")
    assert "clamped to the disk interval, 25 steps" in choice.reason


def test_a_disk_interval_by_time_is_counted_in_steps_at_the_measured_pace():
    """Disk saves every 30 s at 1 s steps: at most 30 steps between snapshots."""
    assert choose_interval(Inputs(stall_s=0.5, step_s=1.0, disk_every_s=30.0)).interval_steps == 30


def test_before_any_failure_the_prior_sets_the_mean_time_between_failures():
    """No failure seen, no wall time yet: M is the prior (one hour), named as such in the reason."""
    assert mtbf_estimate(0, 0.0) == PRIOR_MTBF_S == HOUR
    choice = choose_interval(Inputs(stall_s=0.5, step_s=1.0))
    assert choice.mtbf_s == HOUR
    assert "prior, none seen" in choice.reason


def test_observed_failures_shorten_the_interval():
    """Seven failures in an hour: M = (1 h + 1 h) / 8 = 15 min, and Young/Daly's interval halves."""
    before = choose_interval(Inputs(stall_s=0.5, step_s=1.0))
    after = choose_interval(Inputs(stall_s=0.5, step_s=1.0, failures=7, wall_s=HOUR))
    assert after.mtbf_s == 900.0
    assert after.interval_steps == round(young_daly_s(0.5, 900.0)) == 30 < before.interval_steps == 60
    assert "7 in 3600 s" in after.reason


def test_a_run_without_failures_lengthens_its_mean_time_between_failures():
    """Hours without a failure count as evidence: M grows past the prior."""
    assert mtbf_estimate(0, 3 * HOUR) == 4 * HOUR


def test_the_first_choice_waits_for_a_few_snapshots_then_is_taken_at_once():
    """No interval (0) before MEASURED_FIRST snapshots were measured; then the first choice needs no confirmation,
    and the cold first snapshot does not weigh on it (the median)."""
    cadence = SnapshotCadence()
    cadence.step_measured(1.0)
    stalls = [3.0] + [0.5] * (MEASURED_FIRST - 1)
    answers = [cadence.snapshot_measured(stall_s) for stall_s in stalls]
    assert answers[:-1] == [None] * (MEASURED_FIRST - 1)
    assert answers[-1] is not None and answers[-1].interval_steps == 60 == cadence.interval_steps


def test_a_change_needs_confirming_evaluations_in_a_row():
    """Snapshots that got dearer (3 ms of a 40 ms step): once the median says so (the third), the interval moves
    at the CONFIRMth evaluation asking for 4 steps, and only once."""
    cadence = cadence_after(0.001, 0.040)
    assert cadence.interval_steps == 2
    answers = [cadence.snapshot_measured(0.003) for _ in range(8)]
    changed = [(i, a.interval_steps) for i, a in enumerate(answers) if a is not None]
    assert changed == [(2 + CONFIRM - 1, 4)]
    assert cadence.interval_steps == 4


def test_proposals_alternating_around_the_interval_do_not_flap():
    """Measurements that ask for a shorter, then a longer interval, again and again: the shorter is taken at once
    (it can only lose less work), the longer never gets the confirmations it needs: one change, no flapping."""
    cadence = cadence_after(0.5, 1.0)
    assert cadence.interval_steps == 60
    shorter = choose_interval(Inputs(stall_s=0.2, step_s=1.0)).interval_steps
    proposals = [cadence.consider(choose_interval(Inputs(stall_s=s, step_s=1.0))) for s in [0.2, 1.0] * 5]
    assert [p is not None for p in proposals] == [True] + [False] * 9
    assert cadence.interval_steps == shorter < 60


def test_a_relaunch_starts_from_the_interval_saved_with_its_resume_state():
    """Every rank resumed from the same state, saved under 8 steps: the schedule starts there, no warm-up."""
    schedule = SnapshotSchedule(SnapshotCadence())
    schedule.resumed(8)
    assert (schedule.agreed, schedule.proposed) == (8, 8)
    assert not schedule.due(100)  # the first step after a resume from 99
    assert schedule.due(107)  # 8 steps after it


def test_a_proposal_within_the_dead_band_is_no_change():
    """58 or 64 steps against 60 are the same choice: nothing is pending, nothing changes."""
    cadence = cadence_after(0.5, 1.0)
    for _ in range(2 * CONFIRM):
        assert cadence.snapshot_measured(0.56) is None  # Young/Daly: 63 steps
    assert cadence.interval_steps == 60


def test_a_single_slow_snapshot_moves_nothing():
    """One snapshot that met a pause among fast ones: the median of the stalls ignores it."""
    cadence = cadence_after(0.001, 0.040)
    for stall_s in (0.001, 0.001, 0.200, 0.001, 0.001):
        assert cadence.snapshot_measured(stall_s) is None
    assert cadence.interval_steps == 2


def test_the_schedule_measures_at_every_second_step_until_the_ranks_agree():
    """Resumed at 40: due at 42, 44, ... until an interval is agreed; then that many steps after the last one."""
    schedule = SnapshotSchedule(SnapshotCadence())
    taken = []
    for step in range(41, 56):
        if step == 45:
            schedule.agree(5)
        if schedule.due(step):
            schedule.saved(step)
            taken.append(step)
    assert taken == [42, 44, 49, 54]


def test_the_schedule_counts_from_a_regular_checkpoint_too():
    """A disk save at 10 is as new as a snapshot: the next snapshot comes `agreed` steps after it."""
    schedule = SnapshotSchedule(SnapshotCadence())
    schedule.agree(4)
    assert schedule.due(1) is False
    schedule.saved(10)
    assert [step for step in range(11, 16) if schedule.due(step)] == [14, 15]


def test_the_schedule_proposes_the_cadences_interval():
    """What a rank proposes for the agreement is its cadence's interval; the agreed one is the lowest."""
    schedule = SnapshotSchedule(SnapshotCadence())
    assert schedule.proposed == 0
    for _ in range(3):
        schedule.cadence.step_measured(0.040)
    choices = [schedule.snapshotted(step, 0.001) for step in (2, 4, 6)]
    assert choices[-1] is not None and schedule.proposed == 2 and schedule.last == 6


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0/0.0", (0, 0.0)), ("3/7200.5", (3, 7200.5)), ("", None), ("3", None), ("-1/5", None), ("1/nan", None)],
)
def test_the_failures_variable_reads_count_over_seconds(text, parsed):
    """TRAINWARDEN_FAILURES is `N/SECONDS`; anything else reads as unknown."""
    assert parse_failures(text) == parsed


def test_the_failures_variable_round_trips():
    """What the supervisor writes, the worker reads back."""
    assert parse_failures(failures_env(2, 1234.56)) == (2, 1234.6)


def test_every_rank_is_told_the_runs_failures_at_each_launch(tmp_path):
    """The supervisor hands each attempt's ranks the failures so far and the run's wall time (none: empty), and a
    warm standby waits without them (they are the attempt's)."""
    config = JobConfig(script="train.py", nproc_per_node=2)
    layout = RunLayout(tmp_path)
    told = rank_envs(config, layout, Attempt(3, failures=(2, 95.25)), port=29500)
    assert [env[ENV_FAILURES] for env in told.values()] == ["2/95.2", "2/95.2"]
    assert rank_envs(config, layout, Attempt(0), port=29500)[0][ENV_FAILURES] == ""
    assert ENV_FAILURES in PER_ATTEMPT
