"""The decision core on anomaly aborts: roll back past the bad data, fall back to a crash, or give up."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    ChildExited,
    KillLeftovers,
    LaunchRanks,
    Phase,
    RanksLaunched,
    SignalRanks,
    SignalReceived,
    State,
    StopStage,
    Then,
    Tick,
    decide,
)
from supervisor.core.rollback import AbortInfo, AnomalyPolicy, Rollback
from tests.unit.test_core import NOW, POLICY, record, running, shape
from worker.contract import EXIT_ANOMALY

ABORT = AbortInfo(first_step=500, abort_step=509, first_batch=520, abort_batch=529)
PLAN = Rollback(abort=ABORT, tries=1, resume_at_most=400, skip_to_batch=730, skip_after=200)
# The streak after a rollback, in the same region: it starts before batch 730 + 200.
AGAIN = AbortInfo(first_step=450, abort_step=459, first_batch=780, abort_batch=789)
THIRD = AbortInfo(first_step=1000, abort_step=1004, first_batch=1500, abort_batch=1504)  # before 1190 + 400
ROOMY = replace(POLICY, max_restarts=10)  # restarts never run out first


def aborted(state: State, abort: AbortInfo = ABORT, rank: int = 0) -> State:
    """`state` after rank `rank` of the current attempt exited with EXIT_ANOMALY and `abort`."""
    state, _ = decide(state, ChildExited(state.attempt, rank, EXIT_ANOMALY, abort), NOW)
    assert state.phase is Phase.STOPPING
    return state


def relaunched(state: State, abort: AbortInfo) -> State:
    """RUNNING in the next attempt after rank 0 aborted on `abort`, rank 1 went down, and the rollback launched."""
    state = aborted(state, abort)
    state, actions = decide(state, ChildExited(state.attempt, 1, -signal.SIGTERM), NOW + 1)
    if state.phase is Phase.BACKOFF:
        state, actions = decide(state, Tick(), state.deadline)
    assert state.phase is Phase.STARTING
    assert isinstance(actions[-1], LaunchRanks)
    state, _ = decide(state, RanksLaunched(state.attempt, (200, 201), actions[-1].resume_at_most), NOW + 2)
    assert state.phase is Phase.RUNNING
    return state


def test_anomaly_abort_begins_stop_and_schedules_rollback():
    """An EXIT_ANOMALY exit with abort info records the streak and the rollback, and SIGTERMs the attempt."""
    state, actions = decide(running(), ChildExited(0, 0, EXIT_ANOMALY, ABORT), NOW)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.TERM, Then.RELAUNCH)
    assert state.deadline == NOW + 10.0
    assert state.ranks[0].returncode == EXIT_ANOMALY
    assert state.rollback == PLAN
    assert state.rollback_pending is True
    assert state.give_up is None
    assert state.last_failure == "rank 0 aborted on anomalies in steps 500-509 (batches 520-529) in attempt 0"
    assert shape(actions) == ["anomaly_abort", "rollback_scheduled", SignalRanks(0, signal.SIGTERM)]
    abort = record(actions, "anomaly_abort")
    assert abort.level == "error"
    assert dict(abort.fields) == {
        "rank": 0,
        "attempt": 0,
        "first_step": 500,
        "abort_step": 509,
        "first_batch": 520,
        "abort_batch": 529,
        "suspect_ranks": [],
    }
    scheduled = record(actions, "rollback_scheduled")
    assert scheduled.level == "info"
    assert dict(scheduled.fields) == {"resume_at_most": 400, "skip_to_batch": 730, "tries": 1, "skip_after": 200}


def test_rollback_relaunch_resumes_at_most_and_skips_data():
    """Once every rank is down, the next attempt launches at most from the rollback step, skipping the bad data."""
    state, actions = decide(aborted(running()), ChildExited(0, 1, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.attempt, state.restarts) == (Phase.STARTING, 1, 1)
    assert state.rollback == PLAN
    assert state.rollback_pending is False
    assert shape(actions) == [
        "rank_stopped",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, resume_at_most=400, skip_to_batch=730),
    ]


def test_anomaly_abort_of_last_running_rank_relaunches_rollback_at_once():
    """An anomaly abort of the only rank still running relaunches the rollback without a stop."""
    state, _ = decide(running(), ChildExited(0, 1, 0), NOW)
    state, actions = decide(state, ChildExited(0, 0, EXIT_ANOMALY, ABORT), NOW)
    assert (state.phase, state.attempt, state.stop_stage) == (Phase.STARTING, 1, None)
    assert shape(actions) == [
        "anomaly_abort",
        "rollback_scheduled",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, resume_at_most=400, skip_to_batch=730),
    ]


def test_rollback_after_backoff_keeps_resume_at_most():
    """A rollback that waits out a backoff still launches with its resume limit and skip target."""
    state, actions = decide(aborted(running(restarts=1)), ChildExited(1, 1, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.deadline) == (Phase.BACKOFF, NOW + 1 + 1.0)
    assert state.rollback_pending is True
    assert shape(actions) == ["rank_stopped", KillLeftovers(1), "relaunch_scheduled"]
    state, actions = decide(state, Tick(), NOW + 2)
    assert (state.phase, state.attempt, state.rollback_pending) == (Phase.STARTING, 2, False)
    assert actions == [LaunchRanks(2, resume_at_most=400, skip_to_batch=730)]


def test_crash_after_rollback_keeps_skip_but_not_resume_limit():
    """A plain crash after a rollback relaunches from the newest checkpoint, still skipping the bad data."""
    state = relaunched(running(), ABORT)
    state, _ = decide(state, ChildExited(1, 0, 3), NOW + 3)
    assert state.rollback_pending is False
    state, _ = decide(state, ChildExited(1, 1, -signal.SIGTERM), NOW + 4)
    assert state.phase is Phase.BACKOFF
    state, actions = decide(state, Tick(), state.deadline)
    assert actions == [LaunchRanks(2, resume_at_most=None, skip_to_batch=730)]
    assert state.rollback == PLAN


def test_exit_anomaly_without_abort_info_is_a_crash():
    """An EXIT_ANOMALY exit whose abort event could not be read is handled as an ordinary crash."""
    state, actions = decide(running(), ChildExited(0, 0, EXIT_ANOMALY), NOW)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.RELAUNCH)
    assert (state.rollback, state.rollback_pending) == (None, False)
    assert state.last_failure == "rank 0 exited with code 65 in attempt 0"
    assert shape(actions) == ["rank_crashed", SignalRanks(0, signal.SIGTERM)]
    assert dict(record(actions, "rank_crashed").fields) == {
        "rank": 0,
        "attempt": 0,
        "returncode": 65,
        "description": "exited with code 65",
        "step": None,
        "cause": "exited with code 65",
    }
    state, actions = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 1)
    assert actions[-1] == LaunchRanks(1)


def test_second_abort_in_same_region_widens_the_rollback():
    """A second streak in the same region is rolled back again with doubled distances."""
    state = relaunched(running(), ABORT)
    state, actions = decide(state, ChildExited(1, 0, EXIT_ANOMALY, AGAIN), NOW + 3)
    assert state.rollback == Rollback(abort=AGAIN, tries=2, resume_at_most=250, skip_to_batch=1190, skip_after=400)
    assert dict(record(actions, "rollback_scheduled").fields) == {
        "resume_at_most": 250,
        "skip_to_batch": 1190,
        "tries": 2,
        "skip_after": 400,
    }


def test_abort_after_a_peer_died_of_it_turns_the_pending_relaunch_into_the_rollback():
    """Rank 1 dies by SIGABRT (taken for a crash), then rank 0 exits 65: the relaunch rolls back past the data."""
    state, _ = decide(running(), ChildExited(0, 1, -signal.SIGABRT), NOW)
    assert (state.then, state.rollback_pending) == (Then.RELAUNCH, False)
    state, actions = decide(state, ChildExited(0, 0, EXIT_ANOMALY, ABORT), NOW + 1)
    assert (state.rollback, state.attempt, state.restarts) == (PLAN, 1, 1)
    assert shape(actions) == [
        "anomaly_abort",
        "rollback_scheduled",
        "rank_stopped",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, resume_at_most=400, skip_to_batch=730),
    ]
    assert state.last_failure == "rank 0 aborted on anomalies in steps 500-509 (batches 520-529) in attempt 0"
    (failure,) = state.failures
    assert (failure.rank, failure.step, failure.cause.kind.value) == (0, 509, "anomaly")


def test_a_peer_dying_of_the_abort_first_carries_it_and_rolls_back_once():
    """Rank 1's SIGABRT exit carries the abort a peer logged: rollback at once; rank 0's exit 65 plans no second."""
    state, actions = decide(running(), ChildExited(0, 1, -signal.SIGABRT, ABORT), NOW)
    assert (state.phase, state.then, state.rollback, state.rollback_pending) == (
        Phase.STOPPING,
        Then.RELAUNCH,
        PLAN,
        True,
    )
    assert shape(actions) == ["anomaly_abort", "rollback_scheduled", SignalRanks(0, signal.SIGTERM)]
    assert state.last_failure == (
        "rank 1 killed by SIGABRT after an abort on anomalies in steps 500-509 (batches 520-529) in attempt 0"
    )
    state, actions = decide(state, ChildExited(0, 0, EXIT_ANOMALY, ABORT), NOW + 1)
    assert state.rollback == PLAN  # tries still 1
    assert shape(actions) == [
        "rank_stopped",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, resume_at_most=400, skip_to_batch=730),
    ]


def test_abort_after_a_peers_crash_in_a_region_rolled_back_too_often_fails_with_65():
    """The late abort still counts: a region past `max_tries` rollbacks fails the run with EXIT_ANOMALY."""
    state = relaunched(relaunched(relaunched(running(ROOMY), ABORT), AGAIN), THIRD)
    fourth = AbortInfo(first_step=1500, abort_step=1509, first_batch=2400, abort_batch=2409)
    state, _ = decide(state, ChildExited(3, 1, -signal.SIGABRT), NOW + 3)
    state, actions = decide(state, ChildExited(3, 0, EXIT_ANOMALY, fourth), NOW + 4)
    assert (state.phase, state.exit_code) == (Phase.FAILED, EXIT_ANOMALY)
    assert shape(actions) == ["anomaly_abort", "rollbacks_exhausted", "rank_stopped", KillLeftovers(3)]


def test_abort_seen_while_stopping_on_request_changes_nothing():
    """A late abort while the run stops on request plans no rollback: nothing is relaunched anyway."""
    state, _ = decide(running(), SignalReceived(signal.SIGTERM), NOW)
    assert state.phase is Phase.STOPPING  # no rank reports steps: SIGTERM at once
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 1)
    state, actions = decide(state, ChildExited(0, 0, EXIT_ANOMALY, ABORT), NOW + 1)
    assert (state.phase, state.exit_code, state.rollback) == (Phase.STOPPED, 0, None)
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "run_stopped"]


def test_rollbacks_exhausted_for_region_fails():
    """A streak in a region rolled back `max_tries` times already stops the attempt and FAILs, giving up."""
    state = relaunched(relaunched(relaunched(running(ROOMY), ABORT), AGAIN), THIRD)
    assert (state.attempt, state.restarts, state.rollback.tries) == (3, 3, 3)
    third = state.rollback
    fourth = AbortInfo(first_step=1500, abort_step=1509, first_batch=2400, abort_batch=2409)
    state, actions = decide(state, ChildExited(3, 0, EXIT_ANOMALY, fourth), NOW + 3)
    assert (state.phase, state.then, state.stop_stage) == (Phase.STOPPING, Then.FAIL, StopStage.TERM)
    assert state.rollback == third
    assert state.rollback_pending is False
    assert shape(actions) == ["anomaly_abort", "rollbacks_exhausted", SignalRanks(3, signal.SIGTERM)]
    exhausted = record(actions, "rollbacks_exhausted")
    assert (exhausted.level, dict(exhausted.fields)) == ("error", {"tries": 3})
    state, actions = decide(state, ChildExited(3, 1, -signal.SIGTERM), NOW + 4)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 65  # retrying the same data cannot help: not a retryable failure
    assert state.reason == (
        "rank 0 aborted on anomalies in steps 1500-1509 (batches 2400-2409) in attempt 3; "
        "this region was already rolled back 3 times"
    )
    assert shape(actions) == ["rank_stopped", KillLeftovers(3)]


def test_rollbacks_exhausted_still_fails_after_stop_request():
    """A stop request while a given-up run is stopping does not turn the failure into a clean stop."""
    policy = replace(ROOMY, anomaly=AnomalyPolicy(max_tries=2))
    state = relaunched(relaunched(running(policy), ABORT), AGAIN)
    state, _ = decide(state, ChildExited(2, 0, EXIT_ANOMALY, THIRD), NOW + 3)
    state, actions = decide(state, SignalReceived(signal.SIGTERM), NOW + 4)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.FAIL)
    assert shape(actions) == ["signal_received"]
    state, _ = decide(state, ChildExited(2, 1, -signal.SIGTERM), NOW + 5)
    assert state.phase is Phase.FAILED
    assert state.reason == (
        "rank 0 aborted on anomalies in steps 1000-1004 (batches 1500-1504) in attempt 2; "
        "this region was already rolled back 2 times"
    )


def test_restarts_exhausted_on_anomaly_abort_fails_with_restarts_reason():
    """An anomaly abort with no restarts left stops the attempt and FAILs with the restarts-exhausted reason."""
    state, actions = decide(running(restarts=3), ChildExited(3, 0, EXIT_ANOMALY, ABORT), NOW)
    assert (state.phase, state.then, state.stop_stage) == (Phase.STOPPING, Then.FAIL, StopStage.TERM)
    assert state.rollback_pending is False
    assert state.give_up is None
    assert shape(actions)[0] == "anomaly_abort"
    assert shape(actions)[-2:] == ["restarts_exhausted", SignalRanks(3, signal.SIGTERM)]
    assert dict(record(actions, "restarts_exhausted").fields) == {"restarts": 3, "max_restarts": 3}
    state, actions = decide(state, ChildExited(3, 1, -signal.SIGTERM), NOW + 1)
    assert state.phase is Phase.FAILED
    assert state.reason == (
        "rank 0 aborted on anomalies in steps 500-509 (batches 520-529) in attempt 3; restarts exhausted (3/3)"
    )
    assert shape(actions) == ["rank_stopped", KillLeftovers(3)]


def test_restarts_exhausted_on_anomaly_abort_schedules_no_rollback():
    """With no restarts left, an anomaly abort journals no `rollback_scheduled`, as a crash journals no relaunch."""
    state, actions = decide(running(restarts=3), ChildExited(3, 0, EXIT_ANOMALY, ABORT), NOW)
    assert shape(actions) == ["anomaly_abort", "restarts_exhausted", SignalRanks(3, signal.SIGTERM)]
    assert state.rollback is None
