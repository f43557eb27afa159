"""The core's answer to a launch that failed: retryable, a failed attempt like any other (restarts, backoff, the
crash-loop breaker); not retryable, the run ends (issue #39: a step Slurm could not create yet ended a run)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import LaunchFailed, LaunchRanks, Phase, Policy, Record, Started, Tick, decide, initial_state
from supervisor.core.causes import CauseKind

NOW = 1000.0
POLICY = Policy(
    nproc=2,
    max_restarts=3,
    backoff_initial_s=1.0,
    backoff_factor=2.0,
    backoff_max_s=5.0,
    kill_grace_s=10.0,
    sigkill_wait_s=5.0,
)
STEP_BUSY = "srun: error: Unable to create step for job 7: Memory required by task is not available"


def events(actions: list[object]) -> list[str]:
    return [a.event for a in actions if isinstance(a, Record)]


def starting(restarts: int = 0):
    state, actions = decide(initial_state(POLICY), Started(), NOW)
    assert actions == [LaunchRanks(0)]
    return replace(state, attempt=restarts, restarts=restarts)


def test_retryable_launch_failure_is_relaunched_after_the_backoff():
    state, actions = decide(starting(restarts=1), LaunchFailed(1, STEP_BUSY), NOW)

    assert state.phase is Phase.BACKOFF
    assert state.deadline == NOW + POLICY.backoff_s(1)
    assert events(actions) == ["launch_failed", "relaunch_scheduled"]
    (failure,) = state.failures
    assert (failure.attempt, failure.cause.kind) == (1, CauseKind.LAUNCH)
    assert failure.cause.text == f"could not launch ranks: {STEP_BUSY}"

    state, actions = decide(state, Tick(), NOW + POLICY.backoff_s(1))
    assert (state.phase, state.attempt, state.restarts) == (Phase.STARTING, 2, 2)
    assert LaunchRanks(2) in actions


def test_first_launch_failure_relaunches_at_once_when_the_backoff_is_zero():
    state, actions = decide(starting(), LaunchFailed(0, STEP_BUSY), NOW)

    assert (state.phase, state.attempt, state.restarts) == (Phase.STARTING, 1, 1)
    assert LaunchRanks(1) in actions


def test_retryable_launch_failure_with_no_restart_left_fails():
    state, actions = decide(starting(restarts=3), LaunchFailed(3, STEP_BUSY), NOW)

    assert state.phase is Phase.FAILED
    assert state.exit_code == 1
    assert state.reason == f"could not launch ranks: {STEP_BUSY}; restarts exhausted (3/3)"
    assert events(actions) == ["launch_failed", "restarts_exhausted"]


def test_launch_failures_in_a_row_without_progress_trip_the_crash_loop_breaker():
    state = replace(starting(), heartbeats_seen=True, resume_step=40)
    for attempt in range(3):
        state, _ = decide(state, LaunchFailed(attempt, STEP_BUSY), NOW + attempt * 10)
        if state.phase is Phase.BACKOFF:
            state, _ = decide(state, Tick(), state.deadline or NOW)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 70
    assert state.reason is not None and state.reason.startswith("no progress: 3 attempts in a row")


def test_late_launch_failure_of_an_older_attempt_changes_nothing_but_the_journal():
    state = starting(restarts=2)
    after, actions = decide(state, LaunchFailed(1, STEP_BUSY), NOW)

    assert after == state
    assert events(actions) == ["launch_failed"]


def test_permanent_launch_failures_end_the_run():
    config, _ = decide(starting(), LaunchFailed(0, "written by 4 ranks", retryable=False), NOW)
    missing, _ = decide(starting(), LaunchFailed(0, "No such file: x", retryable=False, exit_code=1), NOW)
    requeue, _ = decide(starting(), LaunchFailed(0, "too few nodes", exit_code=75), NOW)

    assert (config.phase, config.exit_code, config.reason) == (Phase.FAILED, 78, "not launched: written by 4 ranks")
    assert (missing.phase, missing.exit_code, missing.reason) == (
        Phase.FAILED,
        1,
        "could not launch ranks: No such file: x",
    )
    assert (requeue.phase, requeue.exit_code) == (Phase.FAILED, 75)
