"""The decision core on why attempts fail: the failure history, the crash-loop breaker, not-retryable causes."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    FAILURES_KEPT,
    ChildExited,
    DumpStacks,
    Failure,
    Hang,
    KillLeftovers,
    Phase,
    RanksLaunched,
    SignalRanks,
    StacksCollected,
    State,
    Then,
    Tick,
    crash_loop,
    decide,
)
from supervisor.core.blame import Verdict
from supervisor.core.causes import Cause, CauseKind, explain, explain_exit
from supervisor.core.rollback import AbortInfo
from tests.unit.test_core import HUNG_AT, NOW, PIDS, POLICY, STACKS, beat, record, running, shape, with_hang
from worker.contract import EXIT_ANOMALY, EXIT_CONFIG, EXIT_CRASH_LOOP

BOOM = Cause(CauseKind.EXCEPTION, "ValueError: boom (train.py:12 in step)", "ValueError (train.py:12 in step)")
MISMATCH = Cause(
    CauseKind.CHECKPOINT_INCOMPATIBLE,
    "checkpoint incompatible with the model: RuntimeError: Error(s) "
    "in loading state_dict for Net: size mismatch for fc.weight",
)
KILLED = Cause(CauseKind.SIGNAL, "killed by SIGKILL")
LOOSE = replace(POLICY, max_restarts=10, backoff_initial_s=0.0)  # restarts to spare; relaunches at once
LOOP = "crash loop: 3 attempts in a row failed the same way at step 40: ValueError: boom (train.py:12 in step)"


def fail(state: State, cause: Cause = BOOM, step: int | None = 40, returncode: int = 1) -> tuple[State, list]:
    """Rank 0 of the current attempt fails with `cause` after logging `step`."""
    return decide(state, ChildExited(state.attempt, 0, returncode, cause=cause, step=step), NOW)


def fail_and_relaunch(state: State, cause: Cause = BOOM, step: int | None = 40, resume_step: int | None = 20) -> State:
    """`state` after a failure of rank 0, rank 1 dying of the stop, and the next attempt launched from `resume_step`."""
    state, _ = fail(state, cause, step)
    state, _ = decide(state, ChildExited(state.attempt, 1, -signal.SIGTERM), NOW)
    assert state.phase is Phase.STARTING, state.reason
    state, _ = decide(state, RanksLaunched(state.attempt, PIDS, resume_step), NOW)
    return state


def after_failures(causes_steps: list[tuple[Cause, int | None]], policy=LOOSE, resume_step: int | None = 20) -> State:
    """RUNNING after one relaunched failed attempt per (cause, step), every attempt resumed from `resume_step`."""
    state = running(policy, resume_step=resume_step)
    for cause, step in causes_steps:
        state = fail_and_relaunch(state, cause, step, resume_step)
    return state


def test_crash_records_the_failure_with_cause_step_and_progress():
    """An attempt's first failure enters the history: rank, step reached, resume step, cause, progress made."""
    state, actions = fail(running(LOOSE, resume_step=20))
    assert state.failures == (Failure(attempt=0, rank=0, step=40, resume_step=20, cause=BOOM, progressed=True),)
    assert state.cause == BOOM.text
    assert dict(record(actions, "rank_crashed").fields) == {
        "rank": 0,
        "attempt": 0,
        "returncode": 1,
        "description": "exited with code 1",
        "step": 40,
        "cause": BOOM.text,
    }


def test_crash_without_a_cause_is_explained_by_its_exit_status():
    """A ChildExited the runner could not explain gets the exit code or signal as its cause."""
    state, _ = decide(running(), ChildExited(0, 1, -signal.SIGSEGV), NOW)
    assert state.failures[-1].cause == explain_exit(-signal.SIGSEGV) == Cause(CauseKind.SIGNAL, "killed by SIGSEGV")


def test_crash_step_falls_back_to_the_heartbeat_step():
    """Without a logged step, the failure's step is the rank's newest heartbeat step."""
    state = beat(running(LOOSE), 0, 1, NOW, step=17)
    state, _ = fail(state, step=None)
    assert (state.failures[-1].step, state.failures[-1].progressed) == (17, True)


def test_later_exits_of_a_stopping_attempt_add_no_failure():
    """Peers dying of the stop after the first failure are consequences: the history keeps the first rank only."""
    state, _ = fail(running())
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGABRT, cause=KILLED), NOW + 1)
    assert [(f.attempt, f.rank) for f in state.failures] == [(0, 0)]


def test_same_cause_at_same_step_for_n_attempts_fails_as_crash_loop():
    """The third attempt failing with the same cause at the same step ends the run with EXIT_CRASH_LOOP."""
    state = after_failures([(BOOM, 40), (BOOM, 40)])
    state, actions = fail(state)
    assert (state.phase, state.then, state.give_up) == (Phase.STOPPING, Then.FAIL, LOOP)
    assert shape(actions) == ["rank_crashed", "crash_loop", SignalRanks(2, signal.SIGTERM)]
    assert dict(record(actions, "crash_loop").fields) == {"attempts": [0, 1, 2], "reason": LOOP}
    state, actions = decide(state, ChildExited(2, 1, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.exit_code, state.reason, state.restarts) == (Phase.FAILED, EXIT_CRASH_LOOP, LOOP, 2)
    assert shape(actions) == ["rank_stopped", KillLeftovers(2)]


def test_crash_loop_wins_over_exhausted_restarts():
    """When the last restart and the crash loop coincide, the crash loop is the reason (and no restarts_exhausted)."""
    state = after_failures([(BOOM, 40), (BOOM, 40)], policy=replace(LOOSE, max_restarts=2))
    state, actions = fail(state)
    assert shape(actions) == ["rank_crashed", "crash_loop", SignalRanks(2, signal.SIGTERM)]
    assert (state.give_up, state.failure_code) == (LOOP, EXIT_CRASH_LOOP)


def test_same_cause_at_different_steps_keeps_relaunching():
    """The same exception at different steps (with progress) is not a crash loop: relaunch."""
    state = after_failures([(BOOM, 40), (BOOM, 45)])
    state, actions = fail(state, step=50)
    assert (state.then, crash_loop(state)) == (Then.RELAUNCH, None)
    assert "crash_loop" not in shape(actions)


def test_different_causes_at_the_same_step_keep_relaunching():
    """Different causes at one step are not 'the same way': relaunch."""
    other = Cause(CauseKind.EXCEPTION, "KeyError: 'x' (train.py:30 in load)", "KeyError (train.py:30 in load)")
    state = after_failures([(BOOM, 40), (other, 40)])
    state, _ = fail(state)
    assert state.then is Then.RELAUNCH


def test_kills_with_progress_keep_relaunching():
    """Bare SIGKILLs (an operator's kill -9) at the same step never make a crash loop while attempts progress."""
    state = after_failures([(KILLED, 30), (KILLED, 30)])
    state, _ = fail(state, KILLED, 30, returncode=-signal.SIGKILL)
    assert state.then is Then.RELAUNCH


def test_no_progress_past_the_resume_step_for_n_attempts_fails():
    """Three attempts killed before getting past the step they resumed from end the run: no progress."""
    state = after_failures([(KILLED, 20), (KILLED, 0)])
    state, actions = fail(state, KILLED, None, returncode=-signal.SIGKILL)
    reason = "no progress: 3 attempts in a row failed before getting past step 20: killed by SIGKILL"
    assert (state.then, state.give_up, state.failure_code) == (Then.FAIL, reason, EXIT_CRASH_LOOP)
    assert [f.progressed for f in state.failures] == [False, False, False]


def test_no_progress_from_a_fresh_start_says_no_step_completed():
    """Attempts starting from scratch that never complete a step are reported as such."""
    policy = with_hang(LOOSE, heartbeat="required")
    state = after_failures([(BOOM, 0), (BOOM, 0)], policy=policy, resume_step=None)
    state, _ = fail(state, KILLED, None, returncode=-signal.SIGKILL)
    assert state.give_up == "no progress: 3 attempts in a row failed before completing a step: killed by SIGKILL"


def test_progress_unknown_without_steps_never_counts_as_no_progress():
    """A script that reports no steps (no worker library) is never judged to make no progress."""
    state = after_failures([(KILLED, None), (KILLED, None)], resume_step=None)
    state, _ = fail(state, KILLED, None, returncode=-signal.SIGKILL)
    assert [f.progressed for f in state.failures] == [None, None, None]
    assert state.then is Then.RELAUNCH


def test_plain_script_failing_the_same_way_without_steps_is_a_crash_loop():
    """Without steps, the same cause three times is still the script failing the same way."""
    same = Cause(CauseKind.EXIT, "exited with code 7")
    state = after_failures([(same, None), (same, None)], resume_step=None)
    state, _ = fail(state, same, None, returncode=7)
    assert state.give_up == "crash loop: 3 attempts in a row failed the same way: exited with code 7"


def test_hangs_without_progress_count_toward_no_progress():
    """Three attempts hung before their first heartbeat (heartbeats required) end the run: no progress."""
    state = running(with_hang(LOOSE, heartbeat="required"), resume_step=20)
    for attempt in range(3):
        launched_at = state.launched_at
        state, actions = decide(state, Tick(), launched_at + 900)
        assert (state.failures[-1].attempt, state.failures[-1].progressed) == (attempt, False)
        if attempt < 2:
            state, _ = decide(state, StacksCollected(attempt, ()), launched_at + 900.5)
            for rank in (0, 1):
                state, _ = decide(state, ChildExited(attempt, rank, -signal.SIGTERM), launched_at + 901)
            state, _ = decide(state, RanksLaunched(attempt + 1, PIDS, 20), launched_at + 902)
    assert state.give_up.startswith("no progress: 3 attempts in a row failed before getting past step 20: hang: ")
    assert shape(actions)[:2] == ["hang_suspected", "crash_loop"]


def test_anomaly_abort_between_failures_breaks_the_streak():
    """An anomaly abort has its own bound (rollbacks): it interrupts a run of identical crashes."""
    state = after_failures([(BOOM, 40)])
    abort = AbortInfo(first_step=30, abort_step=39, first_batch=30, abort_batch=39)
    state, _ = decide(state, ChildExited(state.attempt, 0, EXIT_ANOMALY, abort=abort), NOW)
    assert state.failures[-1].cause.kind is CauseKind.ANOMALY
    state, _ = decide(state, ChildExited(state.attempt, 1, -signal.SIGTERM), NOW)
    state, _ = decide(state, RanksLaunched(state.attempt, PIDS, 20), NOW)
    state, _ = fail(state)
    assert state.then is Then.RELAUNCH


def test_crash_loop_breaker_off_at_zero():
    """`crash_loop_attempts: 0` turns the breaker off: only max_restarts ends a crash loop."""
    state = after_failures([(BOOM, 40)] * 4, policy=replace(LOOSE, crash_loop_attempts=0))
    state, _ = fail(state)
    assert (state.then, len(state.failures)) == (Then.RELAUNCH, 5)


def test_failure_history_keeps_the_newest():
    """The history is bounded: only the newest FAILURES_KEPT failures are kept."""
    state = after_failures(
        [(BOOM, step) for step in range(40, 40 + FAILURES_KEPT + 2)], policy=replace(LOOSE, max_restarts=100)
    )
    assert len(state.failures) == FAILURES_KEPT and state.failures[-1].step == 40 + FAILURES_KEPT + 1


def test_not_retryable_cause_fails_at_once_with_exit_78():
    """A checkpoint the model cannot load fails the first attempt with EXIT_CONFIG, without a relaunch."""
    state, actions = fail(running(LOOSE, resume_step=20), MISMATCH, 20)
    reason = f"not retryable: rank 0 failed in attempt 0: {MISMATCH.text}"
    assert (state.then, state.give_up, state.failure_code) == (Then.FAIL, reason, EXIT_CONFIG)
    assert shape(actions) == ["rank_crashed", "not_retryable", SignalRanks(0, signal.SIGTERM)]
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.exit_code, state.reason, state.restarts) == (Phase.FAILED, 78, reason, 0)


def test_rank_config_error_records_its_message_as_the_cause():
    """A rank's exit 78 carries the worker's one-line error into the history and the journal."""
    cause = Cause(CauseKind.CONFIG, "exited with code 78: trainwarden: worker config error: bad prefix")
    state, actions = decide(running(), ChildExited(0, 1, EXIT_CONFIG, cause=cause), NOW)
    assert state.cause == cause.text
    assert dict(record(actions, "rank_config_error").fields)["cause"] == cause.text


def test_stacks_naming_the_culprit_make_last_failure_hang_and_history_agree():
    """When the stacks name another rank than the heartbeats did, last_failure and the history follow the hang."""
    state = beat(beat(running(), 0, 1, NOW + 5, step=30), 1, 1, NOW + 10, step=30)
    state, _ = decide(state, Tick(), HUNG_AT)
    assert (state.hang.rank, state.failures[-1].rank) == (0, 0)
    verdict = Verdict(1, "host-side", "stacks", "the only rank outside every collective")
    state, _ = decide(
        state,
        StacksCollected(0, STACKS, culprit=1, last_steps=((0, 31), (1, 31)), verdict=verdict, node="n2"),
        HUNG_AT + 1,
    )
    assert state.hang == Hang(
        attempt=0,
        rank=1,
        phase="train",
        step=31,
        silent_s=305.0,
        timeout_s=300.0,
        stacks=STACKS,
        named_by="stacks",
        cls="host-side",
        node="n2",
        evidence="the only rank outside every collective",
    )
    assert state.last_failure.startswith("rank 1 hung in phase train (last heartbeat at step 31): ")
    assert (state.failures[-1].rank, state.failures[-1].step) == (1, 31)
    assert state.cause == (
        "hang: rank 1 on n2 (host-side: the only rank outside every collective) silent in phase "
        "train after step 31 for 305.0 s (timeout 300 s)"
    )


def test_a_save_hang_named_by_the_checkpoint_writers_group_is_in_phase_save_with_its_timeout():
    """The culprit's heartbeat said train; the evidence (its background writer stuck) says save: the hang is in the
    save phase, with the save timeout."""
    state = beat(beat(running(), 0, 1, NOW + 5, step=30), 1, 1, NOW + 10, step=30)
    state, _ = decide(state, Tick(), HUNG_AT)
    verdict = Verdict(1, "host-side", "flight_recorder", "the checkpoint writer's process group 1: rank 1 ...", "save")
    state, _ = decide(state, StacksCollected(0, STACKS, culprit=1, verdict=verdict), HUNG_AT + 1)
    save_timeout_s = POLICY.hang.phase_timeouts_s["save"]
    assert (state.hang.rank, state.hang.phase, state.hang.timeout_s) == (1, "save", save_timeout_s)
    assert "silent in phase save after step 30" in state.cause


def test_hang_tie_names_the_rank_behind():
    """Ranks whose last beats were seen at the same instant: the one at the lower step is named hung."""
    state = beat(beat(running(), 0, 1, NOW + 10, step=31), 1, 1, NOW + 10, step=30)
    state, _ = decide(state, Tick(), HUNG_AT)
    assert (state.hang.rank, state.failures[-1].rank) == (1, 1)


def test_relaunch_keeps_the_failure_history():
    """A relaunch keeps the history (the breaker looks across attempts) while the new attempt's ranks start clean."""
    state = after_failures([(BOOM, 40)])
    assert (state.phase, state.attempt, state.failures[0].attempt) == (Phase.RUNNING, 1, 0)
    assert all(r.step is None and r.returncode is None for r in state.ranks)


def test_a_failed_collective_seeks_its_culprit_before_the_kill_and_charges_the_failure_to_it():
    """Rank 0 aborted on a size mismatch (gloo): its peers' evidence is taken first, even once all are down, and
    the flight recorders name rank 2 (of 3): the failure history and the journal say rank 2, and who went first."""
    state = running(replace(POLICY, nproc=3))
    desync = Cause(CauseKind.COLLECTIVE, "desync: Received data size doesn't match expected size (killed by SIGABRT)")
    state, actions = decide(state, ChildExited(0, 0, -signal.SIGABRT, cause=desync, step=14), NOW)
    assert shape(actions)[-1] == DumpStacks(0, ranks=(1, 2), faulthandler_ranks=(), collective_failed=True)
    for rank in (1, 2):  # they die of the closed connection meanwhile: the evidence still comes first
        state, _ = decide(state, ChildExited(0, rank, 1), NOW + 1)
    assert state.phase is Phase.STOPPING
    verdict = Verdict(2, "desync", "flight_recorder", "process group 0 collective #9: rank 2 issued all_reduce [[8]]")
    state, actions = decide(state, StacksCollected(0, STACKS, culprit=2, verdict=verdict, node="n2"), NOW + 2)
    named = dict(record(actions, "culprit_named").fields)
    assert (named["rank"], named["node"], named["class"], named["first_failed"]) == (2, "n2", "desync", 0)
    assert (state.failures[-1].rank, state.failures[-1].node, state.failures[-1].cause.kind) == (
        2,
        "n2",
        CauseKind.COLLECTIVE,
    )
    assert state.cause.startswith("desync: rank 2 on n2: process group 0 collective #9: ")
    assert state.cause.endswith(
        "(first seen as rank 0: desync: Received data size doesn't match expected size (killed by SIGABRT))"
    )
    assert (state.phase, state.attempt) == (Phase.STARTING, 1)


def test_nccl_invalid_usage_fails_the_first_attempt_with_exit_78_and_its_cause():
    """Two ranks on one GPU (NCCL's duplicate-GPU error, read from the rank's stderr) ends the run at the first
    attempt with EXIT_CONFIG, restarts to spare, the NCCL line in the reason and the cause."""
    stderr = (
        b"torch.distributed.DistBackendError: NCCL error in: NCCLUtils.hpp:275, invalid usage "
        b"(run with NCCL_DEBUG=WARN for details), NCCL version 2.20.5\n"
        b"ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        b"Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 0\n"
    )
    cause = explain(stderr, 1)
    state, actions = fail(running(LOOSE), cause)
    assert shape(actions) == ["rank_crashed", "not_retryable", SignalRanks(0, signal.SIGTERM)]
    state, _ = decide(state, ChildExited(0, 1, 1), NOW + 1)  # the other rank, of the same error or the stop
    assert (state.phase, state.exit_code, state.restarts, state.cause) == (Phase.FAILED, EXIT_CONFIG, 0, cause.text)
    assert state.reason == (
        "not retryable: rank 0 failed in attempt 0: NCCL invalid usage: Duplicate GPU detected : rank 1 and rank 0 "
        "both on CUDA device 0 (exited with code 1)"
    )
