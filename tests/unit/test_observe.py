"""Observers beside the core, with plain values and a fake clock: progress, and the skip/anomaly/save counts."""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import HeartbeatSeen, Policy, RanksLaunched, SlowSaves, initial_state
from supervisor.observe.progress import Counts, Progress

STATE = initial_state(
    Policy(nproc=2, max_restarts=3, backoff_initial_s=1, backoff_factor=2, backoff_max_s=30, kill_grace_s=5)
)


def beat(rank: int, step: int, *, attempt: int = 0, **fields) -> HeartbeatSeen:
    return HeartbeatSeen(attempt=attempt, rank=rank, seq=step, step=step, phase="train", **fields)


def test_progress_gives_the_newest_step_its_loss_the_rate_and_the_time_to_go():
    progress = Progress()
    for t in range(11):  # 2 steps a second for 10 s
        progress.observe(beat(0, 2 * t, loss=1.0 / (t + 1), total_steps=100), STATE, float(t))
    shown = progress.status()["progress"]
    assert shown == {"step": 20, "total_steps": 100, "loss": 1 / 11, "steps_per_s": 2.0, "eta_s": 40.0, "attempt": 0}


def test_progress_starts_its_rate_afresh_in_a_relaunch_and_ignores_an_old_attempts_beats():
    progress, relaunched = Progress(), replace(STATE, attempt=1)
    for t in range(5):
        progress.observe(beat(0, 10 * t), STATE, float(t))
    progress.observe(beat(0, 30, attempt=1), relaunched, 10.0)
    progress.observe(beat(1, 45, attempt=0), relaunched, 10.5)  # a straggling beat of attempt 0
    shown = progress.status()["progress"]
    assert (shown["step"], shown["steps_per_s"], shown["attempt"]) == (30, None, 1)


def test_counts_take_agreed_skips_once_and_each_ranks_own_anomalies():
    counts, relaunched = Counts(), replace(STATE, attempt=1)
    counts.observe(beat(0, 5, skipped=2, anomalies=(("non_finite", 1), ("global_norm_spike", 1))), STATE, 1.0)
    counts.observe(beat(1, 5, skipped=2, anomalies=(("non_finite", 1),), last_save_s=0.5), STATE, 1.0)
    counts.observe(
        beat(0, 9, attempt=1, skipped=1, anomalies=(("amp_overflow", 1),), last_save_s=0.25), relaunched, 2.0
    )
    assert counts.status() == {
        "skipped_steps": 3,
        "anomalies": {"amp_overflow": 1, "global_norm_spike": 1, "non_finite": 2},
        "last_save_s": 0.25,
        "resume_inexact": [],
        "save_slower_than_interval": None,
    }  # the relaunch's own newest save


def test_counts_without_worker_library_fields_are_zero():
    counts = Counts()
    counts.observe(beat(0, 3), STATE, 1.0)
    assert counts.status() == {
        "skipped_steps": 0,
        "anomalies": {},
        "last_save_s": None,
        "resume_inexact": [],
        "save_slower_than_interval": None,
    }


def test_counts_go_on_from_a_previous_supervisors_totals_and_ignore_a_tampered_file():
    """A restarted supervisor's totals start from the state file's (Prometheus never sees them go back); garbage
    there counts as nothing."""
    counts = Counts({"skipped_steps": 4, "anomalies": {"non_finite": 2, "global_norm_spike": 1}})
    counts.observe(beat(0, 5, skipped=1, anomalies=(("non_finite", 1),)), STATE, 1.0)
    assert counts.status() == {
        "skipped_steps": 5,
        "anomalies": {"global_norm_spike": 1, "non_finite": 3},
        "last_save_s": None,
        "resume_inexact": [],
        "save_slower_than_interval": None,
    }
    for garbage in (
        {"skipped_steps": -1, "anomalies": {"x": "many"}},
        {"skipped_steps": 1e999, "anomalies": []},
        {"skipped_steps": True, "anomalies": {"\x1b[2J": 1}},
    ):
        assert Counts(garbage).status() == {
            "skipped_steps": 0,
            "anomalies": {},
            "last_save_s": None,
            "resume_inexact": [],
            "save_slower_than_interval": None,
        }


def test_start_up_beats_of_a_relaunch_are_not_progress():
    """A relaunched rank beats step 0 in `startup` before it resumes at 275: no 275 steps in a blink."""
    progress, relaunched = Progress(), replace(STATE, attempt=1)
    progress.observe(replace(beat(0, 0, attempt=1), phase="startup"), relaunched, 10.0)
    progress.observe(beat(0, 276, attempt=1), relaunched, 12.0)
    progress.observe(beat(0, 286, attempt=1), relaunched, 13.0)
    assert progress.status()["progress"]["steps_per_s"] == 10.0


def test_a_relaunch_shows_the_step_it_resumes_from():
    progress, relaunched = Progress(), replace(STATE, attempt=1)
    progress.observe(beat(0, 300), STATE, 1.0)
    progress.observe(RanksLaunched(attempt=1, pids=(7, 8), resume_step=275), relaunched, 2.0)
    assert progress.status()["progress"]["step"] == 275
    progress.observe(beat(0, 276, attempt=1), relaunched, 4.0)
    assert progress.status()["progress"]["step"] == 276


def test_ranks_that_say_their_resume_is_not_exact_are_journalled_once_and_shown_by_reason_until_the_next_attempt():
    counts, relaunched = Counts(), replace(STATE, attempt=1)
    said = counts.observe(beat(1, 5, inexact="numpy RNG state not restored"), STATE, 1.0)
    assert said == [("warning", "resume_inexact", {"attempt": 0, "rank": 1, "reason": "numpy RNG state not restored"})]
    assert counts.observe(beat(1, 6, inexact="numpy RNG state not restored"), STATE, 1.5) == []  # said once
    counts.observe(beat(0, 6, inexact="numpy RNG state not restored"), STATE, 1.5)
    counts.observe(beat(0, 7, inexact="the resumed run differs"), STATE, 2.0)
    assert counts.status()["resume_inexact"] == [
        {"reason": "numpy RNG state not restored", "ranks": [0, 1]},
        {"reason": "the resumed run differs", "ranks": [0]},
    ]
    counts.observe(beat(1, 9, attempt=1), relaunched, 2.0)
    assert counts.status()["resume_inexact"] == []


def test_ranks_whose_writes_outlast_their_save_interval_are_journalled_once_and_shown_slowest_first():
    """Each rank's word is journalled the first time it comes; status counts the ranks and names the slowest first,
    until the next attempt."""
    counts, relaunched = Counts(), replace(STATE, attempt=1)
    quick, slow = SlowSaves(1.5, 0.4, "worker.save_checkpoint_steps: 19 or more"), SlowSaves(3.2, 0.4, "x: 40")
    said = counts.observe(beat(1, 10, slow_saves=quick), STATE, 1.0)
    assert said == [
        (
            "warning",
            "save_slower_than_interval",
            {"attempt": 0, "rank": 1, "write_s": 1.5, "interval_s": 0.4, "setting": quick.setting},
        )
    ]
    assert counts.observe(beat(1, 11, slow_saves=quick), STATE, 1.5) == []  # said once
    assert counts.observe(beat(0, 11, slow_saves=slow), STATE, 1.5)[0][2]["rank"] == 0
    assert counts.status()["save_slower_than_interval"] == {
        "ranks": 2,
        "slowest": [
            {"rank": 0, "write_s": 3.2, "interval_s": 0.4, "setting": "x: 40"},
            {"rank": 1, "write_s": 1.5, "interval_s": 0.4, "setting": quick.setting},
        ],
    }
    counts.observe(beat(1, 12, attempt=1), relaunched, 2.0)
    assert counts.status()["save_slower_than_interval"] is None
