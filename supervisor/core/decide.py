"""The supervisor's pure decision core: `decide(state, event, now) -> (state, actions)`.

It knows no files, processes or clocks: every fact arrives as an event, every effect leaves as an
action, and time is the `now` argument (monotonic seconds). Phases and their transitions:

    STARTING --RanksLaunched--> RUNNING
    RUNNING  --ChildExited(0), last rank--> FINISHED
    RUNNING  --ChildExited(!=0)--> STOPPING (then relaunch, or fail: on a crash loop with EXIT_CRASH_LOOP, when
             restarts are exhausted, at once with EXIT_CONFIG when its cause is not retryable)
    RUNNING  --ChildExited(!=0), every survivor running through worker.run, a relaunch due--> STOPPING in UNWIND
             (recovery in place: the survivors are told, PublishUnwind; none is stopped) --every survivor says
             `recovering` (Heartbeats), or the rest exit--> BACKOFF, the survivors kept into the next attempt
             (LaunchRanks.keep; `recovered_in_place` once launched) | --restart.in_place_timeout_s (Tick; after a node's
             loss LOST_NODE_UNWIND_S)--> TERM, a full relaunch | --a stop--> TERM, then stopped; otherwise (not in
             place: `_in_place_refusal`) the full relaunch below, journalled `relaunched` with the reason; the
             launcher may keep fewer (RanksLaunched.kept: a node excluded since, no spare for a lost one)
    RUNNING  --a rank says `recovering` and no rank exits within RECOVERING_GRACE_S (Tick)--> UNWIND (a collective
             lost with every rank alive: every rank kept, none replaced)
    RUNNING  --ChildExited(EXIT_ANOMALY, or any failure; abort info of some rank)--> STOPPING (then roll back past
             the bad data, or fail); a peer may die of the abort (SIGABRT) before the aborting rank exits
    RUNNING  --ChildExited(EXIT_BAD_DEVICE; a persistent verdict on a device), or DeviceExcluded (its transient
             strikes added up)--> the device charged (ChargeDevice), STOPPING (then relaunch without it where the
             launcher can move, else fail with EXIT_REQUEUE naming it: `cannot_move`); DeviceVerdictSeen (transient)
             --> journalled and charged only
    RUNNING  --ChildExited(EXIT_CONFIG)--> STOPPING (then fail with EXIT_CONFIG: a relaunch cannot help)
    RUNNING  --ChildExited(EXIT_CHECKPOINT_REFUSED, or killed while leaving; refusal)--> STOPPING (then relaunch
             passing over the refused step, or fail when restarts are exhausted; fail with EXIT_CONFIG if
             worker.resume_training named it)
    RUNNING  --a heartbeat deadline passed (Tick)--> STOPPING, stacks stage first (a hang, `hang_suspected`; its
             verdict, `hang_detected`, once the evidence is in; a crash loop fails); the evidence naming the culprit and
             every other rank running through worker.run: the culprit alone SIGKILLed, the others UNWIND
    RUNNING  --ChildExited(a collective failed: desync, peer gone)--> STOPPING, stacks stage first: the evidence of
             the ranks left names the culprit (`culprit_named`), and the failure is charged to it
    RUNNING  --SignalReceived or StopRequested--> RUNNING with a stop order: every rank saves at the agreed
             step, then exits (--all exited 0--> STOPPED) or goes on; no rank reporting steps: STOPPING
    RUNNING  --stop order's timeout (Tick), or a second SIGINT--> STOPPING (then stopped); while a rank is saving,
             the second SIGINT only SIGTERMs (the save finishes first, bounded by its save timeout), a third kills
    STOPPING --last rank exited--> BACKOFF | FAILED | STOPPED (EXIT_SAVE_LOST when a rank went down inside a save)
    STOPPING --ChildExited(refusal)--> STOPPING, the refused step passed over from now on
    STOPPING --ChildExited(abort info), a relaunch pending--> STOPPING, the relaunch now a rollback (or fail)
    STOPPING stages: STACKS --StacksCollected or deadline--> TERM (SIGTERM) --deadline--> KILL (SIGKILL); ranks all
    down in STACKS wait for the evidence (their flight recorders may be all there is);
    TERM lasts the kill grace, or until every save in flight is past its save timeout, whichever is later; ranks
    known blocked in a collective (with a lost node's ranks, or behind the hang's culprit) get SIGKILL at once
    STOPPING --deadline in KILL--> FAILED (a rank survived SIGKILL)
    STOPPING --second SIGINT of the run--> SIGKILL now (a save in flight: at the third); a stop request cancels a
             pending relaunch
    BACKOFF  --deadline--> STARTING (next attempt)
    BACKOFF  --SignalReceived--> STOPPED
    STARTING, BACKOFF --a stop (no rank runs to save)--> STOPPED at the newest complete state the runner names
             (`stopped_at`; the steps trained past it are lost); STOPPING before a relaunch: the same, once all down
    STARTING --LaunchFailed, retryable--> BACKOFF (a failed attempt: restarts, backoff and the crash-loop breaker
             apply) | FAILED once restarts are exhausted
    STARTING --LaunchFailed, not retryable--> FAILED (with EXIT_CONFIG, or the exit code the launcher names)
    any      --the job's time limit less its margin (TimeLimitRead, then Tick)--> as on Slurm's warning (SIGUSR1):
             save at an agreed step, STOPPED with EXIT_REQUEUE (`time_limit_near`); a SIGTERM at the limit, too

Every failed attempt leaves a `Failure` (the rank that failed first, the step it reached, the cause). The crash-loop
breaker ends the run with EXIT_CRASH_LOOP once the last `crash_loop_attempts` attempts failed with the same cause at
the same step, or none of them got past the step it resumed from (see `crash_loop`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from supervisor.core.blame import Verdict
from supervisor.core.causes import MAX_CAUSE_CHARS, Cause, CauseKind, explain_exit, poisons_context
from supervisor.core.devices import PERSISTENT, DeviceVerdict
from supervisor.core.hangs import SAVE_PHASE, TRAIN_PHASE, phase_timeout, with_gaps
from supervisor.core.model import (
    FAILURES_KEPT,
    LOST_NODE_UNWIND_S,
    Action,
    ChargeDevice,
    CheckpointRefusal,
    ChildExited,
    DeviceExcluded,
    DeviceVerdictSeen,
    DumpStacks,
    Event,
    Failure,
    Hang,
    Heartbeats,
    HeartbeatSeen,
    KillLeftovers,
    LaunchFailed,
    LaunchRanks,
    Phase,
    PublishStopOrder,
    PublishUnwind,
    RanksLaunched,
    RankState,
    Record,
    SignalRanks,
    SignalReceived,
    StacksCollected,
    Started,
    State,
    StopRequested,
    StopStage,
    Then,
    Tick,
    TimeLimitRead,
    describe_exit,
    hang_deadline,
    rank_deadline,
    recovering_deadline,
    saving,
    signal_name,
    time_limit_deadline,
)
from supervisor.core.rollback import AbortInfo, plan_rollback
from supervisor.core.stop_requests import StopRequest, agreed_step
from worker.contract import (
    EXIT_ANOMALY,
    EXIT_BAD_DEVICE,
    EXIT_CONFIG,
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_REQUEUE,
    EXIT_SAVE_LOST,
    RECOVERING_PHASE,
    StopOrder,
)

__all__ = [
    "crash_loop",
    "decide",
    "ends_at",
    "saves_end",
    "stopping_on_request",
]

# A SIGTERM this close to the job's end time, or after it, is the scheduler ending the job at its time limit (its
# end time has a one-second resolution, and it enforces the limit on a timer), never a person's stop.
TIME_LIMIT_TERM_SLACK_S = 10.0

# ---- transitions ---------------------------------------------------------------------------


def decide(state: State, event: Event, now: float) -> tuple[State, list[Action]]:
    """The next state and the actions that carry it out."""
    if state.phase.terminal:
        return state, []
    handler = _HANDLERS[type(event)]
    return handler(state, event, now)


def _on_started(state: State, event: Started, now: float) -> tuple[State, list[Action]]:
    return state, [LaunchRanks(state.attempt)]


def _on_launched(state: State, event: RanksLaunched, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or state.phase is not Phase.STARTING:
        return state, []
    ranks = tuple(RankState(rank, pid=pid) for rank, pid in enumerate(event.pids))
    if event.kept is not None and event.kept != state.keep:  # the launcher kept fewer: one died, a node went
        state = replace(state, keep=event.kept, full_relaunch=None if event.kept else event.not_kept)
    path = _recovery_path(state, event)
    state = replace(
        state,
        recovery=_recovery_words(state, len(event.pids)) if path else state.recovery,
        keep=(),
        full_relaunch=None,
        phase=Phase.RUNNING,
        ranks=ranks,
        resume_step=event.resume_step,
        deadline=None,
        launched_at=now,
        resume_passed_over=event.passed_over,
        resume_source=event.resume_source,
        resume_named=event.resume_named,
    )
    record = _record(
        "ranks_launched",
        attempt=event.attempt,
        pids=list(event.pids),
        resume_step=event.resume_step,
        resume_source=event.resume_source,
    )
    return state, [*path, record]


def _recovery_path(state: State, event: RanksLaunched) -> list[Action]:
    """After a failed attempt: whether its survivors went on in place, or every rank was relaunched, and why."""
    if state.keep:
        return [
            _record(
                "recovered_in_place",
                attempt=event.attempt,
                kept=list(state.keep),
                replaced=[r for r in range(len(event.pids)) if r not in state.keep],
                pids=list(event.pids),
                resume_step=event.resume_step,
                after=state.cause,
            )
        ]
    if state.full_relaunch is None:
        return []
    return [_record("relaunched", attempt=event.attempt, reason=state.full_relaunch, after=state.cause)]


def _recovery_words(state: State, nproc: int) -> str:
    """How this attempt followed the failed one, as `status` shows it."""
    if state.keep:
        replaced = [r for r in range(nproc) if r not in state.keep]
        return f"in place: ranks {list(state.keep)[:8]} kept, {replaced[:8]} replaced"
    return f"every rank relaunched: {state.full_relaunch}"


def _on_launch_failed(state: State, event: LaunchFailed, now: float) -> tuple[State, list[Action]]:
    record = _record(
        "launch_failed", level="error", attempt=event.attempt, error=event.error, retryable=event.retryable
    )
    if event.exit_code is not None:
        said = "could not launch ranks" if event.exit_code == EXIT_FAILED else "not launched"  # a permanent failure
        return replace(_fail(state, f"{said}: {event.error}"), failure_code=event.exit_code), [record]
    if not event.retryable:
        return replace(_fail(state, f"not launched: {event.error}"), failure_code=EXIT_CONFIG), [record]
    if state.phase is not Phase.STARTING or event.attempt != state.attempt:
        return state, [record]  # an older attempt's late word: this one is already past it
    return _relaunch_after_launch_failed(state, event, record, now)


def _relaunch_after_launch_failed(
    state: State, event: LaunchFailed, record: Action, now: float
) -> tuple[State, list[Action]]:
    """A launch that may succeed later (Slurm could not create the step yet): a failed attempt like any other,
    relaunched after the backoff while restarts are left, the crash-loop breaker watching."""
    text = f"could not launch ranks: {event.error}"
    state = _note_failure(state, 0, Cause(CauseKind.LAUNCH, text[:MAX_CAUSE_CHARS]))
    state, then, actions = _after_failure(state)
    actions = [record, *actions]
    if then is Then.FAIL:
        exhausted = f"{text}; restarts exhausted ({state.restarts}/{state.policy.max_restarts})"
        return _fail(state, state.give_up or exhausted), actions
    delay = state.policy.backoff_s(state.restarts)
    state = replace(state, phase=Phase.BACKOFF, deadline=now + delay, then=None)
    actions.append(_record("relaunch_scheduled", attempt=state.attempt + 1, backoff_s=delay))
    if delay <= 0:
        state, launch = _relaunch(state)
        actions += launch
    return state, actions


def _on_child_exited(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or not 0 <= event.rank < len(state.ranks):
        return state, []
    if not state.ranks[event.rank].running:
        return state, []
    state = _note_lost_save(state, event)
    state = _update_rank(state, event.rank, returncode=event.returncode)
    if state.phase is Phase.RUNNING:
        if event.returncode == 0:
            return _on_clean_exit(state, event)
        if event.returncode == EXIT_ANOMALY and event.abort is not None:
            return _on_anomaly_abort(state, event, event.abort, now)
        if event.returncode == EXIT_CONFIG:
            return _on_config_error(state, event, now)
        if event.refused is not None:
            return _on_checkpoint_refused(state, event, event.refused, now)
        if event.returncode == EXIT_BAD_DEVICE and event.device is not None:
            return _on_bad_device(state, event.device, now)
        if event.abort is not None:  # a peer's abort killed this rank first (SIGABRT when its connection closed)
            return _on_anomaly_abort(state, event, event.abort, now)
        return _on_crash(state, event, now)
    if state.phase is Phase.STOPPING:
        if event.refused is not None:  # a peer went down first (its gloo connection to this rank closed)
            return _refused_while_stopping(state, event, event.refused, now)
        if event.abort is not None and state.then is Then.RELAUNCH and not state.rollback_pending:
            return _abort_while_stopping(state, event, event.abort, now)
        return _after_rank_down(state, event, now)
    return state, []


def _note_lost_save(state: State, event: ChildExited) -> State:
    """A rank that goes down while its newest heartbeat says it is saving takes that checkpoint with it."""
    rank = state.ranks[event.rank]
    if event.returncode == 0 or rank.heartbeat_phase != SAVE_PHASE:
        return state
    return replace(state, saves_lost=(*state.saves_lost, (rank.rank, rank.step)))


def _on_clean_exit(state: State, event: ChildExited) -> tuple[State, list[Action]]:
    actions: list[Action] = [
        _record("rank_finished", rank=event.rank, attempt=event.attempt, stopped_at=event.stopped_at)
    ]
    if not all(r.returncode == 0 for r in state.ranks):
        return state, actions
    if event.stopped_at is None:
        state = replace(state, phase=Phase.FINISHED, deadline=None, reason=None)
        return state, [*actions, _record("run_finished", attempt=state.attempt, restarts=state.restarts)]
    step = event.stopped_at
    why = "for the job's time limit" if state.stopped_code == EXIT_REQUEUE else "on request"  # exit 75: requeue me
    state = replace(
        state,
        phase=Phase.STOPPED,
        deadline=None,
        stopped_at=step,
        reason=f"stopped {why} ({state.stop_source}) at step {step}, checkpoint {step} saved",
    )
    return state, [*actions, _record("run_stopped", attempt=state.attempt, step=step, source=state.stop_source)]


def _on_crash(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    """The attempt's first failure: relaunch, or give up (a cause no relaunch can fix, a crash loop, no restarts)."""
    failure = f"rank {event.rank} {describe_exit(event.returncode)} in attempt {event.attempt}"
    cause = event.cause or explain_exit(event.returncode)
    state = _note_failure(replace(state, last_failure=failure), event.rank, cause, event.step, node=event.node)
    on = {} if event.node is None else {"node": event.node}
    actions: list[Action] = [
        _record(
            "rank_crashed",
            level="error",
            rank=event.rank,
            attempt=event.attempt,
            returncode=event.returncode,
            description=describe_exit(event.returncode),
            step=state.failures[-1].step,
            cause=cause.text,
            **on,
        ),
    ]
    if not cause.retryable:  # a model that does not fit its checkpoint fails the same way on every relaunch
        state = replace(
            state,
            failure_code=EXIT_CONFIG,
            give_up=f"not retryable: rank {event.rank} failed in attempt {event.attempt}: {cause.text}",
        )
        state, stop = _begin_stop(state, Then.FAIL, now)
        return state, [*actions, _record("not_retryable", level="error", rank=event.rank, cause=cause.text), *stop]
    verdict: list[Action]
    then, verdict = Then.STOP, []  # a stop on request is carried out; the failure changes nothing
    if not stopping_on_request(state):
        state, then, verdict = _after_failure(state)
    if then is Then.RELAUNCH:
        refusal = _in_place_refusal(state, cause)
        if refusal is None:
            state, unwind = _begin_unwind(state, now)
            return state, actions + verdict + unwind
        state = replace(state, full_relaunch=refusal)
    others = [r.rank for r in state.ranks if r.rank not in event.lost_with]  # they wait in a collective for them
    blocked = ("blocked in a collective with a lost node", others) if cause.kind is CauseKind.NODE_LOST else None
    # A failed collective's culprit is rarely the first rank to go: the flight recorders of all name it.
    evidence = cause.kind is CauseKind.COLLECTIVE
    state, stop_actions = _begin_stop(state, then, now, blocked=blocked, stacks_first=evidence)
    return state, actions + verdict + stop_actions


def _in_place_refusal(state: State, cause: Cause) -> str | None:
    """Why the failed rank's survivors cannot recover in place (None: they can)."""
    if not state.policy.in_place:
        return state.policy.in_place_off
    if poisons_context(cause):
        return "a CUDA error: a poisoned context never restarts in place"
    if cause.kind is CauseKind.COLLECTIVE:  # a desync, a collective timeout: the evidence of all ranks is taken
        return "a failed collective: the ranks' flight recorders name its culprit first"
    survivors = [r for r in state.ranks if r.running]
    if not survivors:
        return "no rank survived the failure"
    if not all(r.in_place for r in survivors):
        without = [r.rank for r in survivors if not r.in_place][:8]
        return (
            f"ranks {without} cannot recover in place: the script does not run its training function through worker.run"
        )
    return None


def _begin_unwind(state: State, now: float) -> tuple[State, list[Action]]:
    """Recover in place: the survivors are told to unwind from the failed attempt and say so; none is stopped."""
    survivors = [r.rank for r in state.ranks if r.running]
    timeout, _ = _unwind_timeout(state)
    state = replace(
        state, phase=Phase.STOPPING, then=Then.RELAUNCH, stop_stage=StopStage.UNWIND, deadline=now + timeout
    )
    actions: list[Action] = [
        _record("unwinding", attempt=state.attempt, ranks=survivors, timeout_s=timeout),
        PublishUnwind(state.attempt),
    ]
    state, more = _unwound_yet(state, now)
    return state, actions + more


def _unwound_yet(state: State, now: float) -> tuple[State, list[Action]]:
    """Once every surviving rank waits for the next attempt, it is scheduled; they are kept into it."""
    alive = [r for r in state.ranks if r.running]
    if not alive:
        return _all_down(replace(state, full_relaunch="no rank survived the failure"), now)
    if not all(r.heartbeat_phase == RECOVERING_PHASE for r in alive):
        return state, []
    keep = tuple(r.rank for r in alive)
    state = replace(state, stop_stage=None, keep=keep, saves_lost=())
    return _schedule_relaunch(state, now, [KillLeftovers(state.attempt, keep=keep)])


def _unwind_timeout(state: State) -> tuple[float, str]:
    """How long the survivors have to unwind, and what says so: after a node's loss, a collective with its ranks
    either raises at once or never (LOST_NODE_UNWIND_S)."""
    timeout = state.policy.in_place_timeout_s
    if state.failures and state.failures[-1].cause.kind is CauseKind.NODE_LOST and timeout > LOST_NODE_UNWIND_S:
        return LOST_NODE_UNWIND_S, "the wait for a lost node's peers"
    return timeout, "restart.in_place_timeout_s"


def _unwind_timed_out(state: State, now: float) -> tuple[State, list[Action]]:
    """Survivors that did not unwind in time (a collective that never raises): every rank is relaunched."""
    late = [r.rank for r in state.ranks if r.running and r.heartbeat_phase != RECOVERING_PHASE]
    timeout, within = _unwind_timeout(state)
    reason = f"ranks {late[:8]} did not unwind within {within} ({timeout:g} s)"
    state, term = _terminate(replace(state, full_relaunch=reason), now)
    return state, [_record("unwind_timed_out", level="warning", ranks=late, timeout_s=timeout), *term]


def _on_anomaly_abort(state: State, event: ChildExited, abort: AbortInfo, now: float) -> tuple[State, list[Action]]:
    failure = _abort_failure(event, abort)
    state = _note_failure(
        replace(state, last_failure=failure), event.rank, Cause(CauseKind.ANOMALY, failure), abort.abort_step
    )
    state, then, actions = _rollback_or_fail(state, event, abort, failure)
    state, stop = _begin_stop(state, then, now)
    return state, [*actions, *stop]


def _abort_while_stopping(state: State, event: ChildExited, abort: AbortInfo, now: float) -> tuple[State, list[Action]]:
    """An abort seen only once the stop began (a peer died of it first, taken for a crash): roll back after all."""
    failure = _abort_failure(event, abort)
    state = _revise_failure(
        replace(state, last_failure=failure), event.rank, Cause(CauseKind.ANOMALY, failure), abort.abort_step
    )
    state, then, actions = _rollback_or_fail(state, event, abort, failure)
    state, down = _after_rank_down(replace(state, then=then), event, now)
    return state, [*actions, *down]


def _abort_failure(event: ChildExited, abort: AbortInfo) -> str:
    what = (
        "anomalies"
        if not abort.suspect_ranks
        else (f"a feature-value fault seen by rank {', '.join(map(str, abort.suspect_ranks))} (suspect hardware)")
    )
    how = "aborted" if event.returncode == EXIT_ANOMALY else f"{describe_exit(event.returncode)} after an abort"
    return (
        f"rank {event.rank} {how} on {what} in steps {abort.first_step}-{abort.abort_step} "
        f"(batches {abort.first_batch}-{abort.abort_batch}) in attempt {event.attempt}"
    )


def _rollback_or_fail(
    state: State, event: ChildExited, abort: AbortInfo, failure: str
) -> tuple[State, Then, list[Action]]:
    """Roll back past the abort's data on the next launch; fail if this region was rolled back too often
    (EXIT_ANOMALY) or no relaunch is left."""
    record = _record(
        "anomaly_abort",
        level="error",
        rank=event.rank,
        attempt=event.attempt,
        first_step=abort.first_step,
        abort_step=abort.abort_step,
        first_batch=abort.first_batch,
        abort_batch=abort.abort_batch,
        suspect_ranks=list(abort.suspect_ranks),
    )
    plan = plan_rollback(state.policy.anomaly, state.rollback, abort)
    if plan is None:
        tries = state.policy.anomaly.max_tries
        times = "once" if tries == 1 else f"{tries} times"
        state = replace(
            state, give_up=f"{failure}; this region was already rolled back {times}", failure_code=EXIT_ANOMALY
        )
        return state, Then.FAIL, [record, _record("rollbacks_exhausted", level="error", tries=tries)]
    then = _failure_outcome(state)
    if then is Then.FAIL:  # no relaunch left to roll back with
        return state, then, [record, *_exhausted_records(state, then)]
    state = replace(state, rollback=plan, rollback_pending=True)
    decision = _record(
        "rollback_scheduled",
        resume_at_most=plan.resume_at_most,
        skip_to_batch=plan.skip_to_batch,
        tries=plan.tries,
        skip_after=plan.skip_after,
    )
    return state, then, [record, decision]


def _on_device_verdict(state: State, event: DeviceVerdictSeen, now: float) -> tuple[State, list[Action]]:
    """A transient verdict: journalled and charged (a strike); the step went on with the re-run's result."""
    return state, [_verdict_record(event.verdict), ChargeDevice(event.verdict)]


def _on_device_excluded(state: State, event: DeviceExcluded, now: float) -> tuple[State, list[Action]]:
    """The ledger excludes a device the running attempt uses (its strikes added up): the attempt moves off it."""
    verdict = event.verdict
    if state.phase is not Phase.RUNNING or verdict.attempt != state.attempt:
        return state, []
    return _leave_device(state, verdict, f"{verdict.device} is excluded: {event.why}", now)


def _on_bad_device(state: State, verdict: DeviceVerdict, now: float) -> tuple[State, list[Action]]:
    """A persistent verdict: the attempt's ranks are leaving; the device is charged (excluded at once), and the
    run goes on without it."""
    actions: list[Action] = [_verdict_record(verdict), ChargeDevice(verdict)]
    state, more = _leave_device(state, verdict, verdict.text, now)
    return state, actions + more


def _leave_device(state: State, verdict: DeviceVerdict, failure: str, now: float) -> tuple[State, list[Action]]:
    """End the attempt to relaunch without the device; where the run cannot move (one machine), end it with
    EXIT_REQUEUE, saying what it would have done."""
    failure = f"{failure} (attempt {verdict.attempt})"
    cause = Cause(CauseKind.BAD_DEVICE, failure[:MAX_CAUSE_CHARS], f"bad device {verdict.device}")
    state = _note_failure(replace(state, last_failure=failure), verdict.rank, cause, verdict.step, node=verdict.node)
    if stopping_on_request(state):
        state, stop = _begin_stop(state, Then.STOP, now)
        return state, stop
    if not state.policy.can_move:
        would = f"relaunch without {verdict.device}"
        state = replace(
            state,
            failure_code=EXIT_REQUEUE,
            give_up=f"{failure}; would {would}, but this run cannot move off it (one machine): resubmit it elsewhere",
        )
        state, stop = _begin_stop(state, Then.FAIL, now)
        return state, [_record("cannot_move", level="error", device=verdict.device, would=would), *stop]
    state, then, verdict_actions = _after_failure(state)
    state, stop = _begin_stop(state, then, now)
    return state, [*verdict_actions, *stop]


def _verdict_record(verdict: DeviceVerdict) -> Record:
    return _record(
        "sdc_verdict",
        level="error" if verdict.verdict == PERSISTENT else "warning",
        rank=verdict.rank,
        attempt=verdict.attempt,
        verdict=verdict.verdict,
        node=verdict.node,
        gpu=verdict.gpu,
        step=verdict.step,
        batch=verdict.batch,
        evidence=verdict.evidence,
    )


def _revise_failure(state: State, rank: int, cause: Cause, step: int | None) -> State:
    """This attempt's failure was taken for something else (a peer's crash): the history says what it was."""
    if not state.failures or state.failures[-1].attempt != state.attempt:
        return _note_failure(state, rank, cause, step)
    revised = replace(state.failures[-1], rank=rank, step=step, cause=cause)
    return replace(state, failures=(*state.failures[:-1], revised))


def _on_config_error(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    failure = (
        f"rank {event.rank} exited with code {EXIT_CONFIG} (its configuration is invalid) in attempt {event.attempt}"
    )
    cause = event.cause or explain_exit(EXIT_CONFIG)
    state = replace(
        state, last_failure=failure, give_up=f"{failure}; relaunching cannot help", failure_code=EXIT_CONFIG
    )
    state = _note_failure(state, event.rank, cause, event.step)
    state, stop = _begin_stop(state, Then.FAIL, now)
    return state, [
        _record("rank_config_error", level="error", rank=event.rank, attempt=event.attempt, cause=cause.text),
        *stop,
    ]


def _on_checkpoint_refused(
    state: State, event: ChildExited, refusal: CheckpointRefusal, now: float
) -> tuple[State, list[Action]]:
    """Relaunch like after a crash, but never again from the refused step (an attacker may have crafted it)."""
    failure = f"rank {event.rank} refused checkpoint {refusal.step} in attempt {event.attempt}: {refusal.error}"
    state = _note_failure(state, event.rank, Cause(CauseKind.CHECKPOINT_REFUSED, failure), event.step)
    state, actions = _note_refusal(replace(state, last_failure=failure), event, refusal)
    if state.resume_named:  # the person asked for exactly this checkpoint: an older one is not what they meant
        state, stop = _begin_stop(state, Then.FAIL, now)
        return state, [*actions, *stop]
    then = Then.STOP if stopping_on_request(state) else _failure_outcome(state)
    state, stop = _begin_stop(state, then, now)
    return state, [*actions, *_exhausted_records(state, then), *stop]


def _refused_while_stopping(
    state: State, event: ChildExited, refusal: CheckpointRefusal, now: float
) -> tuple[State, list[Action]]:
    """A refusal seen only once the stop began: the relaunch still passes the step over (or, named, fails)."""
    state, noted = _note_refusal(state, event, refusal)
    if state.resume_named and state.then is Then.RELAUNCH:
        state = replace(state, then=Then.FAIL)
    state, actions = _after_rank_down(state, event, now)
    return state, [*noted, *actions]


def _note_refusal(state: State, event: ChildExited, refusal: CheckpointRefusal) -> tuple[State, list[Action]]:
    """Remember the refused step for every later launch; if worker.resume_training named it, the run is to fail."""
    reason = f"refused by rank {event.rank}: {refusal.error}"
    if all(step != refusal.step for step, _ in state.refused_steps):
        state = replace(state, refused_steps=(*state.refused_steps, (refusal.step, reason)))
    if state.resume_named:
        state = replace(
            state,
            failure_code=EXIT_CONFIG,
            give_up=f"the checkpoint named by worker.resume_training (step {refusal.step}) was {reason}",
        )
    record = _record(
        "checkpoint_refused",
        level="error",
        rank=event.rank,
        attempt=event.attempt,
        step=refusal.step,
        path=refusal.path,
        error=refusal.error,
    )
    return state, [record]


def stopping_on_request(state: State) -> bool:
    """An exit order is being carried out now: graceful (with a timeout), or some rank already obeyed it."""
    order = state.stop_order
    obeyed = any(r.returncode == 0 for r in state.ranks)
    return order is not None and order.exit and (state.deadline is not None or obeyed)


def _on_stop_requested(state: State, event: StopRequested, now: float) -> tuple[State, list[Action]]:
    return _request_stop(state, event.request, now, event.newest_step)


def _request_stop(
    state: State, request: StopRequest, now: float, newest: int | None = None
) -> tuple[State, list[Action]]:
    """Order every rank to save at an agreed step, then exit or go on; without ranks, stop at the newest complete
    state (`newest`, which the runner looks up while no rank runs) or say why not."""
    source = request.source
    if state.phase is Phase.RUNNING:
        earliest = agreed_step(state.ranks, now)
        if earliest is not None:
            return _order_stop(state, request, earliest, now)
        if request.exit:  # no rank reports its steps (no worker library): stop the old way
            state, stop = _begin_stop(state, Then.STOP, now)
            return state, [_record("stop_requested", source=source, how="SIGTERM: no rank reports its steps"), *stop]
    if not request.exit:
        why = "no rank reports its steps" if state.phase is Phase.RUNNING else f"no ranks running ({state.phase.value})"
        return state, [_record("stop_request_dropped", level="warning", source=source, step=request.step, reason=why)]
    if state.phase is Phase.STOPPING:  # cancels a pending relaunch; a run already failing still fails
        state, term = _end_unwinding(_stop_instead(state, source, newest), now)
        return state, [_record("stop_requested", source=source, how="ranks already stopping"), *term]
    leftovers: list[Action] = [KillLeftovers(state.attempt)] if state.phase is Phase.STARTING else []
    return _stopped_without_ranks(state, source, newest, leftovers)


def _end_unwinding(state: State, now: float) -> tuple[State, list[Action]]:
    """Survivors waiting to recover in place are ended (SIGTERM, then SIGKILL) when no relaunch follows."""
    if state.stop_stage is not StopStage.UNWIND or state.then is Then.RELAUNCH:
        return state, []
    return _terminate(state, now)


def _stop_instead(state: State, source: str, newest: int | None) -> State:
    """A stop while the ranks of a failed attempt go down: no relaunch; the run ends at the newest complete state
    (no rank saves for this stop). A run already failing still fails."""
    if state.then is not Then.RELAUNCH:  # already failing, or already stopping: an earlier stop's words stand
        return state
    reason = f"stopped on request ({source}) while a failed attempt's ranks went down: {ends_at(newest)}"
    return replace(state, then=Then.STOP, stopped_at=newest, stop_source=source, reason=reason)


def _stopped_without_ranks(
    state: State, source: str, newest: int | None, actions: list[Action]
) -> tuple[State, list[Action]]:
    """A stop while no rank runs (a backoff, a relaunch being prepared, a takeover): nobody can save at an agreed
    step, so the run ends at its newest complete state; what was trained past it is lost (goodput counts it)."""
    state = replace(
        state,
        phase=Phase.STOPPED,
        deadline=None,
        stopped_at=newest,
        stop_source=source,
        reason=f"stopped on request ({source}) with no rank running: {ends_at(newest)}",
    )
    return state, [*actions, _record("run_stopped", attempt=state.attempt, source=source, step=newest, ranks="none")]


def ends_at(newest: int | None) -> str:
    """Where a run stopped while no rank runs ends, in words."""
    if newest is None:
        return "no checkpoint is complete, so the run starts again from its beginning when resumed"
    return f"the run ends at its newest complete state, step {newest}; steps trained past it are lost"


def _order_stop(state: State, request: StopRequest, earliest: int, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = []
    step = earliest if request.step is None else request.step
    if step < earliest:
        actions.append(
            _record(
                "stop_step_too_early",
                level="warning",
                requested=step,
                step=earliest,
                source=request.source,
                reason="passed, or too close for every rank to act together",
            )
        )
        step = earliest
    order = StopOrder(id=state.orders + 1, step=step, exit=request.exit)
    graceful = request.exit and request.step is None  # "now": bounded by the stop timeout
    state = replace(
        state,
        stop_order=order,
        stop_source=request.source,
        orders=order.id,
        deadline=now + state.policy.stop_timeout_s if graceful else state.deadline,
    )
    actions += [
        _record("stop_ordered", order=order.id, step=step, exit=order.exit, source=request.source),
        PublishStopOrder(order),
    ]
    return state, actions


def _exhausted_records(state: State, then: Then) -> list[Action]:
    if then is not Then.FAIL:
        return []
    return [
        _record("restarts_exhausted", level="error", restarts=state.restarts, max_restarts=state.policy.max_restarts)
    ]


def _failure_outcome(state: State) -> Then:
    return Then.FAIL if state.restarts >= state.policy.max_restarts else Then.RELAUNCH


def _note_failure(state: State, rank: int, cause: Cause, step: int | None = None, node: str | None = None) -> State:
    """Add this attempt's failure to the history: did any rank get past the step the attempt resumed from?"""
    step = state.ranks[rank].step if step is None else step
    reached = max((s for s in (step, *(r.step for r in state.ranks)) if s is not None), default=None)
    reports_steps = (
        state.heartbeats_seen
        or state.policy.hang.heartbeat == "required"
        or any(f.step is not None for f in state.failures)
    )  # the script uses the worker library
    progressed = (
        None if reached is None and not reports_steps else (reached is not None and reached > (state.resume_step or 0))
    )
    failure = Failure(state.attempt, rank, step, state.resume_step, cause, progressed, node)
    full = (
        _FULL_RELAUNCH.get(cause.kind, f"recovery in place does not cover a failure of kind {cause.kind.value}")
        if state.policy.in_place
        else state.policy.in_place_off
    )
    return replace(state, failures=(*state.failures, failure)[-FAILURES_KEPT:], full_relaunch=full)


# Why a relaunch after a failure of this kind ends every rank (a crash may still recover in place: `_on_crash`).
_FULL_RELAUNCH = {
    CauseKind.HANG: "a hang: the ranks blocked behind it go down with it",
    CauseKind.ANOMALY: "an anomaly abort: every rank rolls back past the bad data",
    CauseKind.CHECKPOINT_REFUSED: "a refused checkpoint: every rank resumes from an older one",
    CauseKind.LAUNCH: "the launch failed",
    CauseKind.NODE_LOST: "a node was lost",
    CauseKind.BAD_DEVICE: "a bad device: every rank is relaunched without it",
}


def crash_loop(state: State) -> str | None:
    """Why relaunching is pointless after the newest `crash_loop_attempts` failures, or None.

    Two rules: they all failed with the same cause at the same step (a script that raises at step 40 every
    time), or none got past the step it resumed from (NVRx's "cycles without progress"; hangs and kills
    count here, but only a cause the script itself gives, never a bare signal, can make them "the same").
    """
    n = state.policy.crash_loop_attempts
    recent = state.failures[-n:]
    if n < 2 or len(recent) < n or recent[-1].attempt - recent[0].attempt != n - 1:  # 0: off; attempts in a row
        return None
    if not all(f.cause.breakable for f in recent):  # anomaly rollbacks and refused checkpoints have their own bounds
        return None
    last = recent[-1]
    if all(f.cause.repeatable and (f.cause.same_as, f.step) == (last.cause.same_as, last.step) for f in recent):
        at = "" if last.step is None else f" at step {last.step}"
        return f"crash loop: {n} attempts in a row failed the same way{at}: {last.cause.text}"
    if all(f.progressed is False for f in recent):
        past = "completing a step" if not last.resume_step else f"getting past step {last.resume_step}"
        return f"no progress: {n} attempts in a row failed before {past}: {last.cause.text}"
    return None


def _after_failure(state: State) -> tuple[State, Then, list[Action]]:
    """After an attempt's first failure: fail on a crash loop (EXIT_CRASH_LOOP) or exhausted restarts, or relaunch."""
    loop = crash_loop(state)
    if loop is not None:
        attempts = [f.attempt for f in state.failures[-state.policy.crash_loop_attempts :]]
        state = replace(state, give_up=loop, failure_code=EXIT_CRASH_LOOP)
        return state, Then.FAIL, [_record("crash_loop", level="error", attempts=attempts, reason=loop)]
    then = _failure_outcome(state)
    return state, then, _exhausted_records(state, then)


def _begin_stop(
    state: State,
    then: Then,
    now: float,
    *,
    stacks_first: bool = False,
    blocked: tuple[str, Collection[int]] | None = None,
) -> tuple[State, list[Action]]:
    state = replace(state, phase=Phase.STOPPING, then=then)
    if not any(r.running for r in state.ranks):
        return _all_down(state, now)
    if stacks_first:
        running = tuple(r.rank for r in state.ranks if r.running)
        with_handler = tuple(r.rank for r in state.ranks if r.running and r.heartbeat_seq is not None)
        state = replace(state, stop_stage=StopStage.STACKS, deadline=now + state.policy.hang.stacks_timeout_s)
        return state, [
            DumpStacks(state.attempt, running, with_handler, collective_failed=not _hang_of_this_attempt(state))
        ]
    return _terminate(state, now, blocked)


def _terminate(
    state: State, now: float, blocked: tuple[str, Collection[int]] | None = None
) -> tuple[State, list[Action]]:
    """SIGTERM every rank; SIGKILL follows after the grace, or once a rank's save in flight had its save timeout.

    `blocked` (why, ranks): ranks known to wait inside a collective for a peer that will never come (it was lost,
    or it hangs) cannot run a SIGTERM handler, and have nothing to save: they get SIGKILL at once, not the grace.
    A rank inside a save still gets its save timeout."""
    grace_end = now + state.policy.kill_grace_s
    deadline = max(grace_end, saves_end(state, now))
    state = replace(state, stop_stage=StopStage.TERM, deadline=deadline)
    savers = [r.rank for r in saving(state)]
    held, saves = (set() if blocked is None else set(blocked[1])), set(savers)  # sets: thousands of ranks
    doomed = tuple(r.rank for r in state.ranks if r.running and r.rank in held and r.rank not in saves)
    killed = set(doomed)
    termed = tuple(r.rank for r in state.ranks if r.running and r.rank not in killed)
    actions: list[Action] = []
    if doomed:
        assert blocked is not None
        actions += [
            _record("ranks_killed_at_once", ranks=list(doomed), attempt=state.attempt, why=blocked[0]),
            SignalRanks(state.attempt, signal.SIGKILL, doomed),
        ]
    if termed:
        actions.append(SignalRanks(state.attempt, signal.SIGTERM, termed if doomed else None))
    if deadline > grace_end:
        actions.append(_record("stop_waits_for_save", ranks=savers, wait_s=round(deadline - now, 3)))
    return state, actions


def saves_end(state: State, now: float) -> float:
    """When the saves in flight are past their save timeout (a worker finishes its save before obeying SIGTERM)."""
    timeout = phase_timeout(state.policy.hang, SAVE_PHASE, state.step_gaps)
    started = [r.heartbeat_monotonic for r in saving(state) if r.heartbeat_monotonic is not None]
    return max((t + timeout for t in started), default=now)


def _kill(state: State, now: float) -> tuple[State, list[Action]]:
    state = replace(state, stop_stage=StopStage.KILL, deadline=now + state.policy.sigkill_wait_s)
    return state, [SignalRanks(state.attempt, signal.SIGKILL)]


def _after_rank_down(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = [
        _record("rank_stopped", rank=event.rank, attempt=event.attempt, description=describe_exit(event.returncode))
    ]
    if state.stop_stage is StopStage.UNWIND:  # one fewer survivor: replaced with the rank that failed
        state, more = _unwound_yet(state, now)
        return state, actions + more
    if any(r.running for r in state.ranks) or state.stop_stage is StopStage.STACKS:  # the evidence comes first
        return state, actions
    state, more = _all_down(state, now)
    return state, actions + more


def _all_down(state: State, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = [KillLeftovers(state.attempt)]
    state = replace(state, stop_stage=None)
    if state.then is Then.STOP:
        if state.saves_lost:
            return _stopped_losing_saves(state, actions)
        state = replace(state, phase=Phase.STOPPED, deadline=None, reason=state.reason or "stopped on request")
        return state, actions + [_record("run_stopped", attempt=state.attempt)]
    if state.then is Then.FAIL:
        exhausted = f"{state.last_failure}; restarts exhausted ({state.restarts}/{state.policy.max_restarts})"
        return _fail(state, state.give_up or exhausted), actions
    # A save lost to a crash is the relaunch's to make good (it resumes from an older checkpoint), not a stop's.
    return _schedule_relaunch(replace(state, saves_lost=()), now, actions)


def _schedule_relaunch(state: State, now: float, actions: list[Action]) -> tuple[State, list[Action]]:
    delay = state.policy.backoff_s(state.restarts)
    state = replace(state, phase=Phase.BACKOFF, deadline=now + delay)
    actions.append(_record("relaunch_scheduled", attempt=state.attempt + 1, backoff_s=delay))
    if delay <= 0:
        state, launch = _relaunch(state)
        actions += launch
    return state, actions


def _stopped_losing_saves(state: State, actions: list[Action]) -> tuple[State, list[Action]]:
    """Stopped, but a rank went down inside a save: exit EXIT_SAVE_LOST, never the 0 of a clean stop."""
    lost = ", ".join(f"rank {rank}" + ("" if step is None else f" (step {step})") for rank, step in state.saves_lost)
    reason = (
        f"stopped on request, but the checkpoint save in flight was lost: {lost} went down inside it; "
        "the newest complete checkpoint is older"
    )
    state = replace(state, phase=Phase.STOPPED, deadline=None, reason=reason)
    return state, [
        *actions,
        _record(
            "save_lost",
            level="error",
            attempt=state.attempt,
            ranks=[rank for rank, _ in state.saves_lost],
            steps=[step for _, step in state.saves_lost],
        ),
        _record("run_stopped", attempt=state.attempt, exit_code=EXIT_SAVE_LOST),
    ]


def _relaunch(state: State) -> tuple[State, list[Action]]:
    attempt, was_rollback = state.attempt + 1, state.rollback_pending
    state = replace(
        state,
        phase=Phase.STARTING,
        attempt=attempt,
        restarts=state.restarts + 1,
        ranks=tuple(RankState(r) for r in range(state.policy.nproc)),
        deadline=None,
        then=None,
        launched_at=None,
        rollback_pending=False,
    )
    rollback = state.rollback
    resume_at_most = rollback.resume_at_most if rollback is not None and was_rollback else None
    skip_to = rollback.skip_to_batch if rollback else None
    return state, [LaunchRanks(attempt, resume_at_most, skip_to, state.refused_steps, keep=state.keep)]


def _fail(state: State, reason: str) -> State:
    return replace(state, phase=Phase.FAILED, deadline=None, reason=reason)


def _on_heartbeat(state: State, event: HeartbeatSeen, now: float) -> tuple[State, list[Action]]:
    return _on_heartbeats(state, Heartbeats((event,)), now)


def _on_heartbeats(state: State, event: Heartbeats, now: float) -> tuple[State, list[Action]]:
    ranks, gaps, changed, saving = list(state.ranks), [], False, False
    for beat in event.beats:
        if beat.attempt != state.attempt or not 0 <= beat.rank < len(ranks):
            continue
        before = ranks[beat.rank]
        if before.heartbeat_seq == beat.seq:
            continue
        written = now - beat.age_s
        if before.heartbeat_phase == TRAIN_PHASE == beat.phase and before.heartbeat_monotonic is not None:
            gaps.append(written - before.heartbeat_monotonic)
        ranks[beat.rank] = replace(
            before,
            step=beat.step,
            heartbeat_seq=beat.seq,
            heartbeat_monotonic=written,
            heartbeat_phase=beat.phase,
            step_time_s=beat.step_time_s or before.step_time_s,
            in_place=beat.in_place,
            failed_monotonic=None if beat.failed_s is None else written - beat.failed_s,
        )
        changed, saving = True, saving or beat.phase == SAVE_PHASE
    if not changed:
        return state, []
    window = state.policy.hang.calibration.window
    state = replace(state, ranks=tuple(ranks), step_gaps=with_gaps(state.step_gaps, gaps, window), heartbeats_seen=True)
    if state.stop_stage is StopStage.TERM and saving and state.deadline is not None:
        state = replace(state, deadline=max(state.deadline, saves_end(state, now)))  # a save seen late
    if state.stop_stage is StopStage.UNWIND:
        return _unwound_yet(state, now)
    return _continue_order_done(state)


def _continue_order_done(state: State) -> tuple[State, list[Action]]:
    """A save-and-continue order is done once every running rank is past its step."""
    order = state.stop_order
    if order is None or order.exit or state.phase is not Phase.RUNNING:
        return state, []
    if not all(r.step is not None and r.step > order.step for r in state.ranks if r.running):
        return state, []
    state = replace(state, stop_order=None)
    return state, [
        _record("stop_order_done", order=order.id, step=order.step, source=state.stop_source),
        PublishStopOrder(None),
    ]


def _on_stacks_collected(state: State, event: StacksCollected, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or state.stop_stage is not StopStage.STACKS:
        return state, []
    records = [
        _record(
            "stacks_collected",
            attempt=event.attempt,
            paths=list(event.paths),
            culprit=event.culprit,
            last_steps=dict(event.last_steps),
        )
    ]
    if _hang_of_this_attempt(state):
        assert state.hang is not None
        hang = _refine_hang(state, state.hang, event)
        state = _revise_hang_failure(replace(state, hang=hang, last_failure=_hang_failure(hang)), hang)
        records.append(_hang_record(hang))
        if _culprit_alone(state, hang):  # recovery in place: the culprit is killed, its peers unwind
            state, unwind = _begin_unwind(state, now)
            kill = SignalRanks(state.attempt, signal.SIGKILL, (hang.rank,))
            return state, [
                *records,
                _record("hang_culprit_killed", rank=hang.rank, attempt=state.attempt),
                kill,
                *unwind,
            ]
    elif event.verdict is not None and event.verdict.rank is not None:  # a collective failed: its culprit
        state, named = _blame_crash(state, event.verdict, event.node)
        records.append(named)
    blocked = (f"blocked in a collective waiting for rank {event.culprit}", event.blocked) if event.blocked else None
    state, actions = _terminate(state, now, blocked) if any(r.running for r in state.ranks) else _all_down(state, now)
    return state, [*records, *actions]


def _culprit_alone(state: State, hang: Hang) -> bool:
    """A hang whose culprit the evidence named, every other rank able to recover in place: only the culprit goes."""
    others = [r for r in state.ranks if r.running and r.rank != hang.rank]
    return (
        state.then is Then.RELAUNCH
        and state.policy.in_place
        and hang.named_by != "heartbeat"
        and state.ranks[hang.rank].running
        and bool(others)
        and all(r.in_place for r in others)
    )


def _hang_of_this_attempt(state: State) -> bool:
    return state.hang is not None and state.hang.attempt == state.attempt


def _refine_hang(state: State, hang: Hang, event: StacksCollected) -> Hang:
    """What the evidence knows better than heartbeats: who is stuck, why, where, and at which step."""
    steps = dict(event.last_steps)
    verdict = event.verdict
    if verdict is not None:  # the class may be known without a rank (two ranks, each in its own version)
        hang = replace(hang, cls=verdict.cls, evidence=verdict.evidence, named_by=verdict.named_by)
    if event.culprit is None:
        return replace(hang, stacks=event.paths, step=steps.get(hang.rank, hang.step))
    culprit = state.ranks[event.culprit]
    phase = (verdict.phase if verdict is not None else None) or culprit.heartbeat_phase or "launch"
    timeout = (
        state.policy.hang.first_heartbeat_s
        if phase == "launch"
        else phase_timeout(state.policy.hang, phase, state.step_gaps)
    )
    return replace(
        hang,
        stacks=event.paths,
        rank=culprit.rank,
        phase=phase,
        timeout_s=timeout,
        node=event.node,
        step=steps.get(culprit.rank, culprit.step),
        named_by=hang.named_by if verdict else "stacks",
    )


def _hang_record(hang: Hang) -> Record:
    """The hang's final verdict, for the journal: once the evidence is in, or its time ran out."""
    return _record(
        "hang_detected",
        level="error",
        rank=hang.rank,
        node=hang.node,
        attempt=hang.attempt,
        phase=hang.phase,
        step=hang.step,
        silent_s=round(hang.silent_s, 3),
        timeout_s=hang.timeout_s,
        named_by=hang.named_by,
        evidence=hang.evidence,
        cause=_hang_cause(hang).text,
        **{"class": hang.cls},
    )


def _blame_crash(state: State, verdict: Verdict, node: str | None) -> tuple[State, Record]:
    """A collective failed: the failure is the culprit's, as its flight recorder names it, not the first to exit."""
    first = state.failures[-1]
    rank = verdict.rank
    assert rank is not None  # the caller's check: the verdict names a rank
    where = "" if node is None else f" on {node}"
    cause = Cause(
        CauseKind.COLLECTIVE,
        f"{verdict.cls}: rank {verdict.rank}{where}: {verdict.evidence} "
        f"(first seen as rank {first.rank}: {first.cause.text})"[:MAX_CAUSE_CHARS],
        first.cause.same_as,
    )
    state = replace(
        state,
        failures=(*state.failures[:-1], replace(first, rank=rank, cause=cause, node=node)),
        last_failure=f"rank {verdict.rank}{where} ({verdict.cls}) failed a collective in attempt "
        f"{first.attempt}: {verdict.evidence}",
    )
    return state, _record(
        "culprit_named",
        level="error",
        rank=verdict.rank,
        node=node,
        attempt=first.attempt,
        named_by=verdict.named_by,
        evidence=verdict.evidence,
        first_failed=first.rank,
        cause=cause.text,
        **{"class": verdict.cls},
    )


def _on_signal(state: State, event: SignalReceived, now: float) -> tuple[State, list[Action]]:
    interrupts = state.interrupts + (event.signum == signal.SIGINT)
    state = replace(state, interrupts=interrupts)
    if event.signum == signal.SIGUSR1:  # Slurm's warning before the time limit: save, stop, be requeued
        state = replace(state, stopped_code=EXIT_REQUEUE)
    actions: list[Action] = [_record("signal_received", signal=signal_name(event.signum), phase=state.phase.value)]
    limit = state.time_limit
    at_limit = limit is not None and limit.at is not None and now >= limit.at - TIME_LIMIT_TERM_SLACK_S
    if event.signum == signal.SIGTERM and limit is not None and at_limit:
        state = replace(state, stopped_code=EXIT_REQUEUE)  # the job's time limit, not a person: be requeued
        actions.append(_record("time_limit_reached", level="warning", end_time=limit.end_time))
    if state.phase is Phase.RUNNING:
        if interrupts >= 2:  # a second Ctrl-C means now
            state, stop = _begin_stop(state, Then.STOP, now)
            state, kill = _at_once(state, now)
            return state, actions + stop + kill
        if stopping_on_request(state):
            return state, actions
        state, stop = _request_stop(state, StopRequest(None, True, signal_name(event.signum)), now)
        return state, actions + stop
    if state.phase is Phase.STOPPING:
        # A stop request cancels a pending relaunch, but a run already failing still fails.
        state = _stop_instead(state, signal_name(event.signum), event.newest_step)
        state, term = _end_unwinding(state, now)
        actions += term
        if interrupts >= 2:  # a second Ctrl-C means now
            state, kill = _at_once(state, now)
            actions += kill
        return state, actions
    if state.phase is Phase.BACKOFF:
        return _stopped_without_ranks(state, signal_name(event.signum), event.newest_step, actions)
    if state.phase is Phase.STARTING:  # whatever the launch started meanwhile is killed
        actions.append(KillLeftovers(state.attempt))
        return _stopped_without_ranks(state, signal_name(event.signum), event.newest_step, actions)
    state, stop = _begin_stop(state, Then.STOP, now)
    return state, actions + stop


def _at_once(state: State, now: float) -> tuple[State, list[Action]]:
    """SIGKILL a stopping attempt now; but at the second Ctrl-C a save in flight still gets its save timeout (it is
    already SIGTERMed, and the worker finishes the save first), and only a third one abandons it."""
    if state.phase is not Phase.STOPPING or state.stop_stage is StopStage.KILL:
        return state, []
    savers = saving(state)
    if state.interrupts == 2 and savers:
        return state, [
            _record(
                "save_in_flight",
                level="warning",
                ranks=[r.rank for r in savers],
                steps=[r.step for r in savers],
                wait_s=round(saves_end(state, now) - now, 3),
                message="saving, press Ctrl-C again to abandon the save",
            )
        ]
    return _kill(state, now)


def _on_time_limit(state: State, event: TimeLimitRead, now: float) -> tuple[State, list[Action]]:
    return _check_time_limit(replace(state, time_limit=event), now)


def _check_time_limit(state: State, now: float) -> tuple[State, list[Action]]:
    """Once the job's end time is its margin away, the run ends as on Slurm's warning: every rank saves at an agreed
    step and exits, and the run ends with EXIT_REQUEUE to be resubmitted or requeued. A stop already under way keeps
    its own exit code (a person's stop stays one); a pending relaunch is cancelled (it could not save in time)."""
    due = time_limit_deadline(state)
    if due is None or now < due:
        return state, []
    limit = state.time_limit
    assert limit is not None and limit.at is not None  # a deadline means both
    state = replace(state, time_limit_near=True)
    record = _record(
        "time_limit_near",
        level="warning",
        end_time=limit.end_time,
        margin_s=limit.margin_s,
        left_s=round(max(0.0, limit.at - now), 1),
        phase=state.phase.value,
    )
    stopping = stopping_on_request(state) or (state.phase is Phase.STOPPING and state.then is not Then.RELAUNCH)
    if stopping:
        return state, [record]
    state = replace(state, stopped_code=EXIT_REQUEUE)
    source = f"ends {limit.end_time or 'soon'}, margin {limit.margin_s:g} s"
    if state.phase is Phase.RUNNING:
        state, stop = _request_stop(state, StopRequest(None, True, source), now)
        return state, [record, *stop]
    if state.phase is Phase.STOPPING:  # the ranks are going down for a relaunch: there is no time for one
        reason = f"stopped for the job's time limit ({source}) while a failed attempt's ranks went down"
        return replace(state, then=Then.STOP, stop_source=source, reason=reason), [record]
    # BACKOFF, or STARTING (whatever the launch started meanwhile is killed): no rank runs to save anything
    leftovers: list[Action] = [KillLeftovers(state.attempt)] if state.phase is Phase.STARTING else []
    reason = f"stopped for the job's time limit ({source}) with no rank running"
    state = replace(state, phase=Phase.STOPPED, deadline=None, reason=reason)
    return state, [record, *leftovers, _record("run_stopped", attempt=state.attempt, source=source)]


def _on_tick(state: State, event: Tick, now: float) -> tuple[State, list[Action]]:
    state, near = _check_time_limit(state, now)
    if near:
        return state, near
    if state.phase is Phase.RUNNING:
        if state.deadline is not None and now >= state.deadline:  # the graceful stop took too long
            state, stop = _begin_stop(state, Then.STOP, now)
            return state, [_record("stop_timed_out", level="warning", timeout_s=state.policy.stop_timeout_s), *stop]
        return _check_heartbeats(state, now)
    if state.deadline is None or now < state.deadline:
        return state, []
    if state.phase is Phase.BACKOFF:
        return _relaunch(state)
    if state.phase is not Phase.STOPPING:
        return state, []
    alive = [r.rank for r in state.ranks if r.running]
    if state.stop_stage is StopStage.UNWIND:
        return _unwind_timed_out(state, now)
    if state.stop_stage is StopStage.STACKS:
        verdict = [_hang_record(state.hang)] if state.hang is not None and _hang_of_this_attempt(state) else []
        state, actions = _terminate(state, now) if alive else _all_down(state, now)
        return state, [_record("stacks_timed_out", level="warning", ranks=alive), *verdict, *actions]
    if state.stop_stage is StopStage.TERM:
        state, actions = _kill(state, now)
        return state, [
            _record("stop_grace_expired", level="warning", ranks=alive, grace_s=state.policy.kill_grace_s),
            *actions,
        ]
    stuck = [f"rank {r.rank} (pid {r.pid})" for r in state.ranks if r.running]
    reason = f"{', '.join(stuck)} survived SIGKILL for {state.policy.sigkill_wait_s:g} s; not relaunching over it"
    return _fail(state, reason), [KillLeftovers(state.attempt)]  # KillLeftovers logs each survivor's state


def _check_heartbeats(state: State, now: float) -> tuple[State, list[Action]]:
    """Declare a hang once every rank is overdue, naming the rank that went silent first (the likely culprit); or a
    collective that failed with every rank alive, once a rank unwound from it and no exit followed."""
    unwound = recovering_deadline(state)
    if unwound is not None and now >= unwound:
        return _failed_with_every_rank_alive(state, now)
    deadline = hang_deadline(state)
    if deadline is None or now < deadline:
        return state, []
    watched = [r for r in state.ranks if rank_deadline(state, r) is not None]
    rank = min(watched, key=_silent_since)
    hang = _describe_hang(state, rank, now)
    cause = _hang_cause(hang)
    state = _note_failure(replace(state, hang=hang, last_failure=_hang_failure(hang)), rank.rank, cause, hang.step)
    state, then, verdict = _after_failure(state)
    # The verdict waits for the evidence (StacksCollected): `hang_detected` then names the culprit.
    record = _record(
        "hang_suspected",
        level="warning",
        rank=rank.rank,
        attempt=state.attempt,
        phase=hang.phase,
        step=hang.step,
        silent_s=round(hang.silent_s, 3),
        timeout_s=hang.timeout_s,
    )
    state, stop = _begin_stop(state, then, now, stacks_first=True)
    return state, [record, *verdict, *stop]


def _failed_with_every_rank_alive(state: State, now: float) -> tuple[State, list[Action]]:
    """A rank left a failed collective (a connection lost) and no rank exited: the attempt failed in the network. Its
    ranks recover in place, none replaced; or, where they cannot, all are relaunched. The rank named is the one whose
    collective failed first: its peers' failed when it let go of its group, but may have said so sooner."""
    first = min(
        (r for r in state.ranks if r.running and r.heartbeat_phase == RECOVERING_PHASE),
        key=lambda r: r.failed_monotonic if r.failed_monotonic is not None else r.heartbeat_monotonic or 0.0,
    )
    text = f"rank {first.rank} lost a collective's connection with every rank alive (the network?)"
    state = _note_failure(
        replace(state, last_failure=f"{text} in attempt {state.attempt}"), first.rank, Cause(CauseKind.COLLECTIVE, text)
    )
    record = _record("collective_lost", level="error", rank=first.rank, attempt=state.attempt, step=first.step)
    state, then, verdict = _after_failure(state)
    if then is Then.RELAUNCH and state.policy.in_place and all(r.in_place for r in state.ranks if r.running):
        state, unwind = _begin_unwind(state, now)
        return state, [record, *verdict, *unwind]
    state, stop = _begin_stop(state, then, now)
    return state, [record, *verdict, *stop]


def _silent_since(rank: RankState) -> tuple[float, int]:
    """Who went silent first; on a tie (seen at the same poll) the rank behind, which its peers wait for."""
    seen = rank.heartbeat_monotonic if rank.heartbeat_monotonic is not None else -math.inf
    return seen, rank.step if rank.step is not None else -1


def _hang_failure(hang: Hang) -> str:
    """The hang as `last_failure` says it; the same words before and after the stacks name the culprit."""
    where = "before its first heartbeat" if hang.phase == "launch" else f"in phase {hang.phase}"
    after = "" if hang.step is None else f" (last heartbeat at step {hang.step})"
    return (
        f"rank {hang.rank} hung {where}{after}: no heartbeat for {hang.silent_s:.1f} s "
        f"(timeout {hang.timeout_s:g} s) in attempt {hang.attempt}"
    )


def _hang_cause(hang: Hang) -> Cause:
    where = "before its first heartbeat" if hang.phase == "launch" else f"in phase {hang.phase}"
    after = "" if hang.step is None else f" after step {hang.step}"
    on = "" if hang.node is None else f" on {hang.node}"
    named = f" ({hang.cls}: {hang.evidence})" if hang.cls and hang.named_by != "heartbeat" else ""
    return Cause(
        CauseKind.HANG,
        f"hang: rank {hang.rank}{on}{named} silent {where}{after} "
        f"for {hang.silent_s:.1f} s (timeout {hang.timeout_s:g} s)"[:MAX_CAUSE_CHARS],
    )


def _revise_hang_failure(state: State, hang: Hang) -> State:
    """The stacks named another rank or step: the failure history says what the hang record says."""
    if not state.failures or state.failures[-1].attempt != hang.attempt:
        return state
    revised = replace(state.failures[-1], rank=hang.rank, step=hang.step, cause=_hang_cause(hang))
    return replace(state, failures=(*state.failures[:-1], revised))


def _describe_hang(state: State, rank: RankState, now: float) -> Hang:
    hang = state.policy.hang
    if rank.heartbeat_monotonic is None or rank.heartbeat_phase is None:
        assert state.launched_at is not None
        silent, phase, timeout = now - state.launched_at, "launch", hang.first_heartbeat_s
    else:
        silent, phase = now - rank.heartbeat_monotonic, rank.heartbeat_phase
        timeout = phase_timeout(hang, phase, state.step_gaps)
    return Hang(attempt=state.attempt, rank=rank.rank, phase=phase, step=rank.step, silent_s=silent, timeout_s=timeout)


def _update_rank(state: State, rank: int, **changes: Any) -> State:
    ranks = list(state.ranks)
    ranks[rank] = replace(ranks[rank], **changes)
    return replace(state, ranks=tuple(ranks))


def _record(event: str, level: str = "info", **fields: object) -> Record:
    return Record(event, level, tuple(fields.items()))


# Each handler takes the one event class it is keyed by: Any, as a dict cannot say so.
_HANDLERS: dict[type, Callable[[State, Any, float], tuple[State, list[Action]]]] = {
    Started: _on_started,
    RanksLaunched: _on_launched,
    LaunchFailed: _on_launch_failed,
    ChildExited: _on_child_exited,
    DeviceVerdictSeen: _on_device_verdict,
    DeviceExcluded: _on_device_excluded,
    HeartbeatSeen: _on_heartbeat,
    Heartbeats: _on_heartbeats,
    StacksCollected: _on_stacks_collected,
    SignalReceived: _on_signal,
    StopRequested: _on_stop_requested,
    Tick: _on_tick,
    TimeLimitRead: _on_time_limit,
}
