"""The decision core on a refused checkpoint: never resume from it again, relaunch like a crash, or give up."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    CheckpointRefusal,
    ChildExited,
    KillLeftovers,
    LaunchRanks,
    Phase,
    RanksLaunched,
    SignalRanks,
    State,
    StopStage,
    Then,
    Tick,
    decide,
    initial_state,
)
from tests.unit.test_core import NOW, PIDS, POLICY, record, running, shape, stopping_for_crash
from worker.contract import EXIT_CHECKPOINT_REFUSED, EXIT_CONFIG

PATH = "/runs/r/checkpoint/rank_1/demo_rank_1-30.ckpt"
ERROR = "not tensors and plain data only (weights_only load): Trying to load unsupported GLOBAL posix.system"
REFUSAL = CheckpointRefusal(step=30, path=PATH, error=ERROR)
REASON = f"refused by rank 1: {ERROR}"


def refused_exit(
    state: State, refusal: CheckpointRefusal | None = REFUSAL, returncode: int = EXIT_CHECKPOINT_REFUSED
) -> ChildExited:
    """Rank 1 of the current attempt exiting (EXIT_CHECKPOINT_REFUSED) with `refusal` read from its log."""
    return ChildExited(state.attempt, 1, returncode, refused=refusal)


def named_launch() -> State:
    """RUNNING attempt 0, resumed from step 30 because `worker.resume_training` named it."""
    state, _ = decide(initial_state(POLICY), RanksLaunched(0, PIDS, 30, resume_named=True), NOW)
    assert (state.phase, state.resume_named) == (Phase.RUNNING, True)
    return state


def test_checkpoint_refused_begins_stop_and_remembers_the_step():
    """A refused-checkpoint exit journals `checkpoint_refused`, remembers the step and SIGTERMs the attempt."""
    state = running(resume_step=30)
    state, actions = decide(state, refused_exit(state), NOW)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.TERM, Then.RELAUNCH)
    assert state.refused_steps == ((30, REASON),)
    assert state.last_failure == f"rank 1 refused checkpoint 30 in attempt 0: {ERROR}"
    assert (state.give_up, state.failure_code) == (None, 1)
    assert shape(actions) == ["checkpoint_refused", SignalRanks(0, signal.SIGTERM)]
    refused = record(actions, "checkpoint_refused")
    assert refused.level == "error"
    assert dict(refused.fields) == {"rank": 1, "attempt": 0, "step": 30, "path": PATH, "error": ERROR}


def test_refused_checkpoint_relaunch_passes_the_step_over():
    """Once every rank is down, the relaunch counts as a restart and carries the refused step to pass over."""
    state = running(resume_step=30)
    state, _ = decide(state, refused_exit(state), NOW)
    state, actions = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.attempt, state.restarts) == (Phase.STARTING, 1, 1)
    assert shape(actions) == [
        "rank_stopped",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, refused=((30, REASON),)),
    ]


def test_refused_steps_outlive_later_crashes():
    """A later crash relaunches still passing over every step refused before."""
    state = running(resume_step=30)
    state, _ = decide(state, refused_exit(state), NOW)
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 1)
    state, _ = decide(state, RanksLaunched(1, PIDS, 20), NOW + 2)
    state, _ = decide(state, ChildExited(1, 0, 3), NOW + 3)
    state, _ = decide(state, ChildExited(1, 1, -signal.SIGTERM), NOW + 4)
    assert state.phase is Phase.BACKOFF
    state, actions = decide(state, Tick(), state.deadline)
    assert actions == [LaunchRanks(2, refused=((30, REASON),))]


def test_a_step_refused_again_is_remembered_once():
    """The same step refused in two attempts is one entry; another step adds a second."""
    state = replace(running(restarts=1, resume_step=30), refused_steps=((30, REASON),))
    state, _ = decide(state, refused_exit(state), NOW)
    assert state.refused_steps == ((30, REASON),)
    other = replace(running(restarts=1, resume_step=20), refused_steps=((30, REASON),))
    other, _ = decide(other, refused_exit(other, replace(REFUSAL, step=20)), NOW)
    assert other.refused_steps == ((30, REASON), (20, REASON))


def test_checkpoint_refused_with_restarts_exhausted_fails():
    """Without restarts left, a refused checkpoint fails the run once every rank is down, like a crash."""
    state = running(replace(POLICY, max_restarts=0), resume_step=30)
    state, actions = decide(state, refused_exit(state), NOW)
    assert state.then is Then.FAIL
    assert shape(actions) == ["checkpoint_refused", "restarts_exhausted", SignalRanks(0, signal.SIGTERM)]
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.exit_code) == (Phase.FAILED, 1)
    assert state.reason == f"rank 1 refused checkpoint 30 in attempt 0: {ERROR}; restarts exhausted (0/0)"


def test_refused_checkpoint_named_by_resume_training_fails_with_exit_config():
    """The checkpoint `worker.resume_training` named is not swapped for an older one: the run fails with 78."""
    state = named_launch()
    state, actions = decide(state, refused_exit(state), NOW)
    assert state.then is Then.FAIL
    assert shape(actions) == ["checkpoint_refused", SignalRanks(0, signal.SIGTERM)]
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.exit_code) == (Phase.FAILED, EXIT_CONFIG)
    assert state.reason == f"the checkpoint named by worker.resume_training (step 30) was {REASON}"


def test_rank_killed_on_its_way_out_after_a_refusal_counts_as_a_refusal():
    """A rank that logged its refusal but died of a signal before exiting 66 is still a refusal, not a crash."""
    state = running(resume_step=30)
    state, actions = decide(state, refused_exit(state, returncode=-signal.SIGTERM), NOW)
    assert (state.then, state.refused_steps) == (Then.RELAUNCH, ((30, REASON),))
    assert shape(actions) == ["checkpoint_refused", SignalRanks(0, signal.SIGTERM)]


def test_checkpoint_refused_while_stopping_is_remembered():
    """A refusal that arrives after a peer's crash began the stop (the peer's gloo connection to the refusing rank
    closed, and the stop's SIGTERM caught it on its way out) still keeps the step out of the relaunch."""
    state = replace(stopping_for_crash(), resume_step=30)
    state, actions = decide(state, refused_exit(state, returncode=-signal.SIGTERM), NOW + 1)
    assert state.refused_steps == ((30, REASON),)
    assert shape(actions) == [
        "checkpoint_refused",
        "rank_stopped",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1, refused=((30, REASON),)),
    ]


def test_checkpoint_refused_while_stopping_a_named_resume_fails_with_exit_config():
    """A refusal of the named checkpoint after a peer's crash began the stop turns the relaunch into a failure."""
    state = named_launch()
    state, _ = decide(state, ChildExited(0, 0, 3), NOW)
    state, _ = decide(state, refused_exit(state), NOW + 1)
    assert (state.phase, state.exit_code) == (Phase.FAILED, EXIT_CONFIG)
    assert state.reason == f"the checkpoint named by worker.resume_training (step 30) was {REASON}"


def test_refused_exit_without_what_the_rank_logged_is_a_crash():
    """Exit code 66 without a readable `checkpoint_refused` event is handled as a crash and remembers no step."""
    state = running(resume_step=30)
    state, actions = decide(state, refused_exit(state, None), NOW)
    assert state.refused_steps == ()
    assert shape(actions) == ["rank_crashed", SignalRanks(0, signal.SIGTERM)]
