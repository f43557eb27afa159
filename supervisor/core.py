"""The supervisor's pure decision core: `decide(state, event, now) -> (state, actions)`.

It knows no files, processes or clocks: every fact arrives as an event, every effect leaves as an
action, and time is the `now` argument (monotonic seconds). Phases and their transitions:

    STARTING --RanksLaunched--> RUNNING
    RUNNING  --ChildExited(0), last rank--> FINISHED
    RUNNING  --ChildExited(!=0)--> STOPPING (then relaunch, or fail: on a crash loop with EXIT_CRASH_LOOP, when
             restarts are exhausted, at once with EXIT_CONFIG when its cause is not retryable)
    RUNNING  --ChildExited(EXIT_ANOMALY, or any failure; abort info of some rank)--> STOPPING (then roll back past
             the bad data, or fail); a peer may die of the abort (SIGABRT) before the aborting rank exits
    RUNNING  --ChildExited(EXIT_CONFIG)--> STOPPING (then fail with EXIT_CONFIG: a relaunch cannot help)
    RUNNING  --ChildExited(EXIT_CHECKPOINT_REFUSED, or killed while leaving; refusal)--> STOPPING (then relaunch
             passing over the refused step, or fail when restarts are exhausted; fail with EXIT_CONFIG if
             worker.resume_training named it)
    RUNNING  --a heartbeat deadline passed (Tick)--> STOPPING, stacks stage first (a hang, `hang_suspected`; its
             verdict, `hang_detected`, once the evidence is in; a crash loop fails)
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
    STARTING --LaunchFailed--> FAILED (with EXIT_CONFIG if not retryable)

Every failed attempt leaves a `Failure` (the rank that failed first, the step it reached, the cause). The crash-loop
breaker ends the run with EXIT_CRASH_LOOP once the last `crash_loop_attempts` attempts failed with the same cause at
the same step, or none of them got past the step it resumed from (see `crash_loop`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from enum import Enum

from supervisor.blame import Verdict
from supervisor.causes import MAX_CAUSE_CHARS, Cause, CauseKind, explain_exit
from supervisor.hangs import SAVE_PHASE, TRAIN_PHASE, HangPolicy, beat_deadline, phase_timeout, with_gaps
from supervisor.rollback import AbortInfo, AnomalyPolicy, Rollback, plan_rollback
from supervisor.stop_requests import StopRequest, agreed_step
from worker.contract import (
    EXIT_ANOMALY,
    EXIT_CONFIG,
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_REQUEUE,
    EXIT_SAVE_LOST,
    StopOrder,
)

__all__ = [
    "Action",
    "CheckpointRefusal",
    "ChildExited",
    "DumpStacks",
    "Event",
    "FAILURES_KEPT",
    "Failure",
    "Hang",
    "HeartbeatSeen",
    "History",
    "Heartbeats",
    "KillLeftovers",
    "LaunchFailed",
    "LaunchRanks",
    "Phase",
    "Policy",
    "PublishStopOrder",
    "RankState",
    "RanksLaunched",
    "Record",
    "SignalRanks",
    "SignalReceived",
    "StacksCollected",
    "Started",
    "State",
    "StopRequested",
    "StopStage",
    "saves_end",
    "saving",
    "stopping_on_request",
    "Then",
    "Tick",
    "crash_loop",
    "decide",
    "describe_exit",
    "initial_state",
    "hang_deadline",
    "next_deadline",
    "rank_deadline",
]


class Phase(Enum):
    """Where the run stands; the words operators know from supervisord."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.FINISHED, Phase.STOPPED, Phase.FAILED)


class Then(Enum):
    """What to do once every rank of a stopping attempt is down."""

    RELAUNCH = "relaunch"
    FAIL = "fail"
    STOP = "stop"


class StopStage(Enum):
    """How far stopping has gone: collect stacks (after a hang), then SIGTERM, then SIGKILL."""

    STACKS = "stacks"
    TERM = "term"
    KILL = "kill"


# ---- events: past-tense facts -------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The supervisor is up and the config is valid."""


@dataclass(frozen=True)
class RanksLaunched:
    """Every rank of `attempt` was started; `resume_step` is the checkpoint they resume from."""

    attempt: int
    pids: tuple[int, ...]
    resume_step: int | None
    passed_over: tuple[tuple[int, str], ...] = ()  # newer checkpoints not resumed from, and why
    resume_source: str | None = None  # where the checkpoint is, when not the run's regular checkpoints
    resume_named: bool = False  # the checkpoint is the one `worker.resume_training` names (attempt 0 only)


@dataclass(frozen=True)
class LaunchFailed:
    """The ranks of `attempt` could not be started at all (none is left running); `retryable` False: never will."""

    attempt: int
    error: str
    retryable: bool = True  # False: fail with EXIT_CONFIG (the run dir's checkpoints need another world size)
    exit_code: int | None = None  # fail with this code instead (EXIT_REQUEUE: too few healthy nodes)


@dataclass(frozen=True)
class CheckpointRefusal:
    """What a rank logged when it refused to load its resume checkpoint (`checkpoint_refused`)."""

    step: int
    path: str
    error: str


@dataclass(frozen=True)
class ChildExited:
    """A rank's leader process exited; a negative code is the killing signal, as in Popen.

    `abort` is what a rank of the attempt logged when it aborted on anomalies (this one, exiting EXIT_ANOMALY, or a
    peer: this one may die of the abort first, by SIGABRT); `refused` what it logged when it refused its
    resume checkpoint (it then exits EXIT_CHECKPOINT_REFUSED, unless a peer's stop kills it on its way out).
    """

    attempt: int
    rank: int
    returncode: int
    abort: AbortInfo | None = None
    stopped_at: int | None = None  # the step of the stop order the rank carried out before exiting 0
    refused: CheckpointRefusal | None = None
    cause: Cause | None = None  # why it failed, from its stderr; None: only the returncode is known
    step: int | None = None  # the newest step the rank logged (truer than its throttled heartbeat)
    node: str | None = None  # the host it ran on, in a multi-node run
    lost_with: tuple[int, ...] = ()  # its node was lost: the ranks lost with it (their exits follow)


@dataclass(frozen=True)
class HeartbeatSeen:
    """A rank's heartbeat file holds a new record."""

    attempt: int
    rank: int
    seq: int
    step: int
    phase: str
    step_time_s: float | None = None  # the rank's smoothed step duration
    # Progress a worker-library rank reports besides (None when it does not): for observers, never for decisions.
    loss: float | None = None  # the last step's loss
    compute_s: float | None = None  # smoothed time per step before waiting for peers (a slow rank's is larger)
    total_steps: int | None = None  # the steps the loop trains to (`warden.steps(total)`)
    save_s: float | None = None  # seconds this rank process spent saving checkpoints so far
    last_save_s: float | None = None  # the newest save's duration
    skipped: int | None = None  # batches this rank process skipped
    anomalies: tuple[tuple[str, int], ...] | None = None  # what this rank process saw itself: (kind, count)
    age_s: float = 0.0  # how long before the supervisor got it the rank wrote it (a node agent batches its beats)


@dataclass(frozen=True)
class Heartbeats:
    """New heartbeat records of many ranks, taken in together: one event, one pass over the ranks, for a burst
    of local beats or a fleet's second of them."""

    beats: tuple[HeartbeatSeen, ...]


@dataclass(frozen=True)
class StopRequested:
    """Someone asked for a checkpoint at a step, then an exit or not (stop file); signals arrive as SignalReceived."""

    request: StopRequest


@dataclass(frozen=True)
class StacksCollected:
    """Stack dumps of a hung attempt's ranks were written (`paths`, possibly none).

    `culprit`: the rank the evidence names, if it does, with `verdict` saying of which class and why, and `node`
    where it ran (multi-node); `blocked`: then, the ranks the stacks show inside a collective (waiting for the
    culprit); `last_steps`: (rank, step) pairs from the ranks' event logs, truer than the throttled heartbeats.
    """

    attempt: int
    paths: tuple[str, ...]
    culprit: int | None = None
    last_steps: tuple[tuple[int, int], ...] = ()
    blocked: tuple[int, ...] = ()
    verdict: Verdict | None = None
    node: str | None = None


@dataclass(frozen=True)
class SignalReceived:
    """The supervisor got a signal (SIGTERM, SIGINT, ...)."""

    signum: int


@dataclass(frozen=True)
class Tick:
    """Time passed; deadlines are checked."""


Event = (Started | RanksLaunched | LaunchFailed | ChildExited | HeartbeatSeen | Heartbeats | StacksCollected
         | SignalReceived
         | StopRequested | Tick)

# ---- actions: imperatives ------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchRanks:
    """Start every rank of `attempt` from the newest complete checkpoint (at or before `resume_at_most`).

    Ranks whose data position is below `skip_to_batch` jump to it; `refused` steps (and why) are passed over.
    """

    attempt: int
    resume_at_most: int | None = None
    skip_to_batch: int | None = None
    refused: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class SignalRanks:
    """Send `signum` to the process group of every rank of `attempt` still running (of `ranks`, when given)."""

    attempt: int
    signum: int
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DumpStacks:
    """Collect the evidence of a hang (stacks, flight recorders) from every running rank; `faulthandler_ranks` have
    the worker library's handler. `collective_failed`: not a hang, a collective failed (its culprit is sought)."""

    attempt: int
    ranks: tuple[int, ...]
    faulthandler_ranks: tuple[int, ...]
    collective_failed: bool = False


@dataclass(frozen=True)
class PublishStopOrder:
    """Write the stop order every rank polls (None: remove it)."""

    order: StopOrder | None


@dataclass(frozen=True)
class KillLeftovers:
    """SIGKILL whatever is left of `attempt`'s process trees (grandchildren outliving their rank)."""

    attempt: int


@dataclass(frozen=True)
class Record:
    """Write a decision to the supervisor's journal."""

    event: str
    level: str
    fields: tuple[tuple[str, object], ...] = ()


Action = LaunchRanks | SignalRanks | DumpStacks | KillLeftovers | PublishStopOrder | Record

# ---- state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """The knobs of restart and stop behaviour, from the job config."""

    nproc: int
    max_restarts: int
    backoff_initial_s: float
    backoff_factor: float
    backoff_max_s: float
    kill_grace_s: float
    sigkill_wait_s: float = 5.0
    stop_timeout_s: float = 300.0  # a graceful stop (save at the next agreed step) may take this long
    hang: HangPolicy = field(default_factory=HangPolicy)
    anomaly: AnomalyPolicy = field(default_factory=AnomalyPolicy)
    crash_loop_attempts: int = 3  # this many failed attempts in a row, the same way or without progress: stop (0: off)

    def backoff_s(self, restarts_done: int) -> float:
        """Delay before the next relaunch: none for the first, then exponential up to the cap."""
        if restarts_done == 0 or self.backoff_initial_s == 0:
            return 0.0
        try:
            growth = float(self.backoff_factor) ** (restarts_done - 1)  # float: an int ** 10**6 is a huge int
        except OverflowError:  # 2.0 ** 1024 and beyond: long past any cap
            return self.backoff_max_s
        return min(self.backoff_max_s, self.backoff_initial_s * growth)  # a product past 1e308 is inf, not an error


@dataclass(frozen=True)
class RankState:
    """One rank of the current attempt as the supervisor sees it."""

    rank: int
    pid: int | None = None
    returncode: int | None = None
    step: int | None = None
    heartbeat_seq: int | None = None
    heartbeat_monotonic: float | None = None  # when the supervisor last saw a new beat
    heartbeat_phase: str | None = None
    step_time_s: float | None = None

    @property
    def running(self) -> bool:
        return self.pid is not None and self.returncode is None


@dataclass(frozen=True)
class Hang:
    """The newest hang: which rank went silent, in which phase, for how long, and where its stacks are."""

    attempt: int
    rank: int
    phase: str
    step: int | None
    silent_s: float
    timeout_s: float
    stacks: tuple[str, ...] = ()
    named_by: str = "heartbeat"  # or what named the culprit: flight_recorder, process_state, stacks
    cls: str | None = None  # host-side | in-collective | desync | silent (supervisor.blame); None: unknown
    evidence: str | None = None  # what named it, in one line
    node: str | None = None  # the host the culprit ran on, in a multi-node run


@dataclass(frozen=True)
class Failure:
    """One failed attempt: the rank that failed first, the step it reached, the step it resumed from, and why."""

    attempt: int
    rank: int
    step: int | None  # the newest step the rank reported; None: none
    resume_step: int | None
    cause: Cause
    progressed: bool | None  # some rank got past `resume_step`; None: cannot tell (no rank reports steps)
    node: str | None = None  # the host the rank ran on, in a multi-node run


FAILURES_KEPT = 10  # the failure history in the state (and status): the newest ones


@dataclass(frozen=True)
class History:
    """What a supervisor that died mid-run leaves the next one (in the state file): the newest attempt, the restarts
    so far and the failures the crash-loop breaker counts, so a restart neither forgets a crash loop nor reuses an
    attempt's number (the attempt it was running is lost with it: the next one gets the number after)."""

    attempt: int
    restarts: int
    failures: tuple[Failure, ...]


@dataclass(frozen=True)
class State:
    """Everything the supervisor knows about the run."""

    policy: Policy
    phase: Phase = Phase.STARTING
    attempt: int = 0
    restarts: int = 0
    ranks: tuple[RankState, ...] = ()
    deadline: float | None = None  # monotonic; meaning depends on the phase
    then: Then | None = None
    stop_stage: StopStage | None = None
    interrupts: int = 0  # SIGINTs so far: the second one kills at once
    launched_at: float | None = None  # monotonic launch time of the current attempt
    heartbeats_seen: bool = False  # some rank of this run has ever beaten: the script uses the worker library
    step_gaps: tuple[float, ...] = ()  # seconds between consecutive train beats, all ranks, all attempts
    hang: Hang | None = None
    rollback: Rollback | None = None  # the newest rollback; its skip window holds for every later attempt
    rollback_pending: bool = False  # the next launch is that rollback
    give_up: str | None = None  # why a failing stop fails, when it is not exhausted restarts
    stop_order: StopOrder | None = None  # the order ranks are carrying out
    stop_source: str | None = None  # who asked for it
    stopped_at: int | None = None  # the step a stop-and-exit order saved at, once the ranks exited
    orders: int = 0  # stop orders issued so far (their ids)
    failure_code: int = EXIT_FAILED  # the exit code when FAILED
    resume_step: int | None = None
    resume_source: str | None = None  # None: the run's regular checkpoints; else a snapshot slot or load_checkpoint
    resume_passed_over: tuple[tuple[int, str], ...] = ()
    resume_named: bool = False  # the current attempt resumed from the checkpoint worker.resume_training names
    refused_steps: tuple[tuple[int, str], ...] = ()  # checkpoints a rank refused to load, and why: never resumed from
    last_failure: str | None = None
    failures: tuple[Failure, ...] = ()  # the newest FAILURES_KEPT failed attempts, oldest first
    saves_lost: tuple[tuple[int, int | None], ...] = ()  # (rank, step): went down inside a save, this attempt
    stopped_code: int = 0  # the exit code of a clean stop: EXIT_REQUEUE when Slurm's time-limit warning asked
    reason: str | None = None

    @property
    def exit_code(self) -> int | None:
        stopped = EXIT_SAVE_LOST if self.saves_lost else self.stopped_code  # a stop that lost a save is not clean
        return {Phase.FINISHED: 0, Phase.STOPPED: stopped, Phase.FAILED: self.failure_code}.get(self.phase)

    @property
    def cause(self) -> str | None:
        """Why the newest failed attempt failed, in one line."""
        return self.failures[-1].cause.text if self.failures else None


def initial_state(policy: Policy, step_gaps: tuple[float, ...] = (), history: History | None = None) -> State:
    """A run before its first launch; `step_gaps` carries calibration over from an earlier supervisor, `history`
    its attempts, restarts and failures when it died mid-run."""
    state = State(policy=policy, ranks=tuple(RankState(r) for r in range(policy.nproc)), step_gaps=step_gaps)
    if history is None:
        return state
    return replace(state, attempt=history.attempt + 1, restarts=history.restarts,
                   failures=history.failures[-FAILURES_KEPT:])


def rank_deadline(state: State, rank: RankState) -> float | None:
    """When `rank` must show a new heartbeat (monotonic), or None."""
    if state.phase is not Phase.RUNNING or not rank.running or state.launched_at is None:
        return None
    hang = state.policy.hang
    return beat_deadline(
        hang,
        phase=rank.heartbeat_phase,
        last_beat=rank.heartbeat_monotonic,
        launched_at=state.launched_at,
        expect_beat=hang.heartbeat == "required" or state.heartbeats_seen,
        gaps=state.step_gaps,
    )


def hang_deadline(state: State) -> float | None:
    """When the job counts as hung: once every running rank with a deadline is past it.

    In a collective job one stuck rank stalls every peer within a step, so all go silent; a rank
    legitimately in a long phase (rank 0's slow save) keeps its peers, blocked waiting for it, alive.
    """
    if state.phase is not Phase.RUNNING or state.launched_at is None:
        return None
    # A rank's deadline grows with its newest beat for a given phase: the newest beat per phase is all it takes
    # (one timeout worked out per phase, not per rank: a calibrated one reads every gap sample).
    newest: dict[str | None, float] = {}  # phase (None: no beat yet) -> the newest beat of a running rank in it
    for rank in state.ranks:
        if rank.running:
            phase = rank.heartbeat_phase if rank.heartbeat_monotonic is not None else None
            beat = -math.inf if rank.heartbeat_monotonic is None or phase is None else rank.heartbeat_monotonic
            newest[phase] = max(newest.get(phase, -math.inf), beat)
    hang = state.policy.hang
    expect_beat = hang.heartbeat == "required" or state.heartbeats_seen
    deadlines = [d for phase, beat in newest.items()
                 if (d := beat_deadline(hang, phase=phase, last_beat=None if phase is None else beat,
                                        launched_at=state.launched_at, expect_beat=expect_beat,
                                        gaps=state.step_gaps)) is not None]
    return max(deadlines) if deadlines else None


def next_deadline(state: State) -> float | None:
    """The earliest moment a Tick can change anything: the phase deadline or the hang deadline."""
    present = [d for d in (state.deadline, hang_deadline(state)) if d is not None]
    return min(present) if present else None


def describe_exit(returncode: int) -> str:
    """'exited with code 3' or 'killed by SIGKILL', as a person would say it."""
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    return f"exited with code {returncode}"


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
    state = replace(state, phase=Phase.RUNNING, ranks=ranks, resume_step=event.resume_step, deadline=None,
                    launched_at=now, resume_passed_over=event.passed_over, resume_source=event.resume_source,
                    resume_named=event.resume_named)
    record = _record("ranks_launched", attempt=event.attempt, pids=list(event.pids), resume_step=event.resume_step,
                     resume_source=event.resume_source)
    return state, [record]


def _on_launch_failed(state: State, event: LaunchFailed, now: float) -> tuple[State, list[Action]]:
    record = _record("launch_failed", level="error", attempt=event.attempt, error=event.error,
                     retryable=event.retryable)
    if event.exit_code is not None:
        return replace(_fail(state, f"not launched: {event.error}"), failure_code=event.exit_code), [record]
    if not event.retryable:
        return replace(_fail(state, f"not launched: {event.error}"), failure_code=EXIT_CONFIG), [record]
    return _fail(state, f"could not launch ranks: {event.error}"), [record]


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
    actions: list[Action] = [_record("rank_finished", rank=event.rank, attempt=event.attempt,
                                     stopped_at=event.stopped_at)]
    if not all(r.returncode == 0 for r in state.ranks):
        return state, actions
    if event.stopped_at is None:
        state = replace(state, phase=Phase.FINISHED, deadline=None, reason=None)
        return state, [*actions, _record("run_finished", attempt=state.attempt, restarts=state.restarts)]
    step = event.stopped_at
    state = replace(state, phase=Phase.STOPPED, deadline=None, stopped_at=step,
                    reason=f"stopped on request ({state.stop_source}) at step {step}, checkpoint {step} saved")
    return state, [*actions, _record("run_stopped", attempt=state.attempt, step=step, source=state.stop_source)]


def _on_crash(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    """The attempt's first failure: relaunch, or give up (a cause no relaunch can fix, a crash loop, no restarts)."""
    failure = f"rank {event.rank} {describe_exit(event.returncode)} in attempt {event.attempt}"
    cause = event.cause or explain_exit(event.returncode)
    state = _note_failure(replace(state, last_failure=failure), event.rank, cause, event.step, node=event.node)
    on = {} if event.node is None else {"node": event.node}
    actions: list[Action] = [
        _record("rank_crashed", level="error", rank=event.rank, attempt=event.attempt, returncode=event.returncode,
                description=describe_exit(event.returncode), step=state.failures[-1].step, cause=cause.text, **on),
    ]
    if not cause.retryable:  # a model that does not fit its checkpoint fails the same way on every relaunch
        state = replace(state, failure_code=EXIT_CONFIG,
                        give_up=f"not retryable: rank {event.rank} failed in attempt {event.attempt}: {cause.text}")
        state, stop = _begin_stop(state, Then.FAIL, now)
        return state, [*actions, _record("not_retryable", level="error", rank=event.rank, cause=cause.text), *stop]
    then, verdict = Then.STOP, []  # a stop on request is carried out; the failure changes nothing
    if not stopping_on_request(state):
        state, then, verdict = _after_failure(state)
    others = [r.rank for r in state.ranks if r.rank not in event.lost_with]  # they wait in a collective for them
    blocked = ("blocked in a collective with a lost node", others) if cause.kind is CauseKind.NODE_LOST else None
    # A failed collective's culprit is rarely the first rank to go: the flight recorders of all name it.
    evidence = cause.kind is CauseKind.COLLECTIVE
    state, stop_actions = _begin_stop(state, then, now, blocked=blocked, stacks_first=evidence)
    return state, actions + verdict + stop_actions


def _on_anomaly_abort(state: State, event: ChildExited, abort: AbortInfo, now: float) -> tuple[State, list[Action]]:
    failure = _abort_failure(event, abort)
    state = _note_failure(replace(state, last_failure=failure), event.rank, Cause(CauseKind.ANOMALY, failure),
                          abort.abort_step)
    state, then, actions = _rollback_or_fail(state, event, abort, failure)
    state, stop = _begin_stop(state, then, now)
    return state, [*actions, *stop]


def _abort_while_stopping(state: State, event: ChildExited, abort: AbortInfo, now: float) -> tuple[State, list[Action]]:
    """An abort seen only once the stop began (a peer died of it first, taken for a crash): roll back after all."""
    failure = _abort_failure(event, abort)
    state = _revise_failure(replace(state, last_failure=failure), event.rank, Cause(CauseKind.ANOMALY, failure),
                            abort.abort_step)
    state, then, actions = _rollback_or_fail(state, event, abort, failure)
    state, down = _after_rank_down(replace(state, then=then), event, now)
    return state, [*actions, *down]


def _abort_failure(event: ChildExited, abort: AbortInfo) -> str:
    what = "anomalies" if not abort.suspect_ranks else (
        f"a feature-value fault seen by rank {', '.join(map(str, abort.suspect_ranks))} (suspect hardware)")
    how = "aborted" if event.returncode == EXIT_ANOMALY else f"{describe_exit(event.returncode)} after an abort"
    return (f"rank {event.rank} {how} on {what} in steps {abort.first_step}-{abort.abort_step} "
            f"(batches {abort.first_batch}-{abort.abort_batch}) in attempt {event.attempt}")


def _rollback_or_fail(state: State, event: ChildExited, abort: AbortInfo,
                      failure: str) -> tuple[State, Then, list[Action]]:
    """Roll back past the abort's data on the next launch; fail if this region was rolled back too often
    (EXIT_ANOMALY) or no relaunch is left."""
    record = _record("anomaly_abort", level="error", rank=event.rank, attempt=event.attempt,
                     first_step=abort.first_step, abort_step=abort.abort_step, first_batch=abort.first_batch,
                     abort_batch=abort.abort_batch, suspect_ranks=list(abort.suspect_ranks))
    plan = plan_rollback(state.policy.anomaly, state.rollback, abort)
    if plan is None:
        tries = state.policy.anomaly.max_tries
        times = "once" if tries == 1 else f"{tries} times"
        state = replace(state, give_up=f"{failure}; this region was already rolled back {times}",
                        failure_code=EXIT_ANOMALY)
        return state, Then.FAIL, [record, _record("rollbacks_exhausted", level="error", tries=tries)]
    then = _failure_outcome(state)
    if then is Then.FAIL:  # no relaunch left to roll back with
        return state, then, [record, *_exhausted_records(state, then)]
    state = replace(state, rollback=plan, rollback_pending=True)
    decision = _record("rollback_scheduled", resume_at_most=plan.resume_at_most, skip_to_batch=plan.skip_to_batch,
                       tries=plan.tries, skip_after=plan.skip_after)
    return state, then, [record, decision]


def _revise_failure(state: State, rank: int, cause: Cause, step: int | None) -> State:
    """This attempt's failure was taken for something else (a peer's crash): the history says what it was."""
    if not state.failures or state.failures[-1].attempt != state.attempt:
        return _note_failure(state, rank, cause, step)
    revised = replace(state.failures[-1], rank=rank, step=step, cause=cause)
    return replace(state, failures=(*state.failures[:-1], revised))


def _on_config_error(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    failure = (f"rank {event.rank} exited with code {EXIT_CONFIG} (its configuration is invalid) "
               f"in attempt {event.attempt}")
    cause = event.cause or explain_exit(EXIT_CONFIG)
    state = replace(state, last_failure=failure, give_up=f"{failure}; relaunching cannot help",
                    failure_code=EXIT_CONFIG)
    state = _note_failure(state, event.rank, cause, event.step)
    state, stop = _begin_stop(state, Then.FAIL, now)
    return state, [_record("rank_config_error", level="error", rank=event.rank, attempt=event.attempt,
                           cause=cause.text), *stop]


def _on_checkpoint_refused(state: State, event: ChildExited, refusal: CheckpointRefusal,
                           now: float) -> tuple[State, list[Action]]:
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


def _refused_while_stopping(state: State, event: ChildExited, refusal: CheckpointRefusal,
                            now: float) -> tuple[State, list[Action]]:
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
        state = replace(state, failure_code=EXIT_CONFIG,
                        give_up=f"the checkpoint named by worker.resume_training (step {refusal.step}) was {reason}")
    record = _record("checkpoint_refused", level="error", rank=event.rank, attempt=event.attempt, step=refusal.step,
                     path=refusal.path, error=refusal.error)
    return state, [record]


def stopping_on_request(state: State) -> bool:
    """An exit order is being carried out now: graceful (with a timeout), or some rank already obeyed it."""
    order = state.stop_order
    obeyed = any(r.returncode == 0 for r in state.ranks)
    return order is not None and order.exit and (state.deadline is not None or obeyed)


def _on_stop_requested(state: State, event: StopRequested, now: float) -> tuple[State, list[Action]]:
    return _request_stop(state, event.request, now)


def _request_stop(state: State, request: StopRequest, now: float) -> tuple[State, list[Action]]:
    """Order every rank to save at an agreed step, then exit or go on; without ranks, stop or say why not."""
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
        state = replace(state, then=Then.FAIL if state.then is Then.FAIL else Then.STOP)
        return state, [_record("stop_requested", source=source, how="ranks already stopping")]
    reason = f"stopped on request ({source}) with no ranks running"
    state = replace(state, phase=Phase.STOPPED, deadline=None, reason=reason)
    return state, [_record("run_stopped", attempt=state.attempt, source=source)]


def _order_stop(state: State, request: StopRequest, earliest: int, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = []
    step = earliest if request.step is None else request.step
    if step < earliest:
        actions.append(_record("stop_step_too_early", level="warning", requested=step, step=earliest,
                               source=request.source, reason="passed, or too close for every rank to act together"))
        step = earliest
    order = StopOrder(id=state.orders + 1, step=step, exit=request.exit)
    graceful = request.exit and request.step is None  # "now": bounded by the stop timeout
    state = replace(state, stop_order=order, stop_source=request.source, orders=order.id,
                    deadline=now + state.policy.stop_timeout_s if graceful else state.deadline)
    actions += [_record("stop_ordered", order=order.id, step=step, exit=order.exit, source=request.source),
                PublishStopOrder(order)]
    return state, actions


def _exhausted_records(state: State, then: Then) -> list[Action]:
    if then is not Then.FAIL:
        return []
    return [_record("restarts_exhausted", level="error", restarts=state.restarts,
                    max_restarts=state.policy.max_restarts)]


def _failure_outcome(state: State) -> Then:
    return Then.FAIL if state.restarts >= state.policy.max_restarts else Then.RELAUNCH


def _note_failure(state: State, rank: int, cause: Cause, step: int | None = None, node: str | None = None) -> State:
    """Add this attempt's failure to the history: did any rank get past the step the attempt resumed from?"""
    step = state.ranks[rank].step if step is None else step
    reached = max((s for s in (step, *(r.step for r in state.ranks)) if s is not None), default=None)
    reports_steps = (state.heartbeats_seen or state.policy.hang.heartbeat == "required"
                     or any(f.step is not None for f in state.failures))  # the script uses the worker library
    progressed = None if reached is None and not reports_steps else (
        reached is not None and reached > (state.resume_step or 0))
    failure = Failure(state.attempt, rank, step, state.resume_step, cause, progressed, node)
    return replace(state, failures=(*state.failures, failure)[-FAILURES_KEPT:])


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
        attempts = [f.attempt for f in state.failures[-state.policy.crash_loop_attempts:]]
        state = replace(state, give_up=loop, failure_code=EXIT_CRASH_LOOP)
        return state, Then.FAIL, [_record("crash_loop", level="error", attempts=attempts, reason=loop)]
    then = _failure_outcome(state)
    return state, then, _exhausted_records(state, then)


def _begin_stop(state: State, then: Then, now: float, *, stacks_first: bool = False,
                blocked: tuple[str, Collection[int]] | None = None) -> tuple[State, list[Action]]:
    state = replace(state, phase=Phase.STOPPING, then=then)
    if not any(r.running for r in state.ranks):
        return _all_down(state, now)
    if stacks_first:
        running = tuple(r.rank for r in state.ranks if r.running)
        with_handler = tuple(r.rank for r in state.ranks if r.running and r.heartbeat_seq is not None)
        state = replace(state, stop_stage=StopStage.STACKS, deadline=now + state.policy.hang.stacks_timeout_s)
        return state, [DumpStacks(state.attempt, running, with_handler, collective_failed=not _hang_of_this_attempt(
            state))]
    return _terminate(state, now, blocked)


def _terminate(state: State, now: float, blocked: tuple[str, Collection[int]] | None = None
               ) -> tuple[State, list[Action]]:
    """SIGTERM every rank; SIGKILL follows after the grace, or once a rank's save in flight had its save timeout.

    `blocked` (why, ranks): ranks known to wait inside a collective for a peer that will never come (it was lost,
    or it hangs) cannot run a SIGTERM handler, and have nothing to save: they get SIGKILL at once, not the grace.
    A rank inside a save still gets its save timeout."""
    grace_end = now + state.policy.kill_grace_s
    state = replace(state, stop_stage=StopStage.TERM, deadline=max(grace_end, saves_end(state, now)))
    savers = [r.rank for r in saving(state)]
    held, saves = (set() if blocked is None else set(blocked[1])), set(savers)  # sets: thousands of ranks
    doomed = tuple(r.rank for r in state.ranks if r.running and r.rank in held and r.rank not in saves)
    killed = set(doomed)
    termed = tuple(r.rank for r in state.ranks if r.running and r.rank not in killed)
    actions: list[Action] = []
    if doomed:
        assert blocked is not None
        actions += [_record("ranks_killed_at_once", ranks=list(doomed), attempt=state.attempt, why=blocked[0]),
                    SignalRanks(state.attempt, signal.SIGKILL, doomed)]
    if termed:
        actions.append(SignalRanks(state.attempt, signal.SIGTERM, termed if doomed else None))
    if state.deadline > grace_end:
        actions.append(_record("stop_waits_for_save", ranks=savers, wait_s=round(state.deadline - now, 3)))
    return state, actions


def saves_end(state: State, now: float) -> float:
    """When the saves in flight are past their save timeout (a worker finishes its save before obeying SIGTERM)."""
    timeout = phase_timeout(state.policy.hang, SAVE_PHASE, state.step_gaps)
    started = [r.heartbeat_monotonic for r in saving(state) if r.heartbeat_monotonic is not None]
    return max((t + timeout for t in started), default=now)


def saving(state: State) -> list[RankState]:
    """The running ranks whose newest heartbeat says they are inside a checkpoint save."""
    return [r for r in state.ranks if r.running and r.heartbeat_phase == SAVE_PHASE]


def _kill(state: State, now: float) -> tuple[State, list[Action]]:
    state = replace(state, stop_stage=StopStage.KILL, deadline=now + state.policy.sigkill_wait_s)
    return state, [SignalRanks(state.attempt, signal.SIGKILL)]


def _after_rank_down(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = [_record("rank_stopped", rank=event.rank, attempt=event.attempt,
                                     description=describe_exit(event.returncode))]
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
        state = replace(state, phase=Phase.STOPPED, deadline=None, reason="stopped on request")
        return state, actions + [_record("run_stopped", attempt=state.attempt)]
    if state.then is Then.FAIL:
        exhausted = f"{state.last_failure}; restarts exhausted ({state.restarts}/{state.policy.max_restarts})"
        return _fail(state, state.give_up or exhausted), actions
    delay = state.policy.backoff_s(state.restarts)
    # A save lost to a crash is the relaunch's to make good (it resumes from an older checkpoint), not a stop's.
    state = replace(state, phase=Phase.BACKOFF, deadline=now + delay, saves_lost=())
    actions.append(_record("relaunch_scheduled", attempt=state.attempt + 1, backoff_s=delay))
    if delay <= 0:
        state, launch = _relaunch(state)
        actions += launch
    return state, actions


def _stopped_losing_saves(state: State, actions: list[Action]) -> tuple[State, list[Action]]:
    """Stopped, but a rank went down inside a save: exit EXIT_SAVE_LOST, never the 0 of a clean stop."""
    lost = ", ".join(f"rank {rank}" + ("" if step is None else f" (step {step})") for rank, step in state.saves_lost)
    reason = (f"stopped on request, but the checkpoint save in flight was lost: {lost} went down inside it; "
              "the newest complete checkpoint is older")
    state = replace(state, phase=Phase.STOPPED, deadline=None, reason=reason)
    return state, [*actions, _record("save_lost", level="error", attempt=state.attempt,
                                     ranks=[rank for rank, _ in state.saves_lost],
                                     steps=[step for _, step in state.saves_lost]),
                   _record("run_stopped", attempt=state.attempt, exit_code=EXIT_SAVE_LOST)]


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
    return state, [LaunchRanks(attempt, resume_at_most, skip_to, state.refused_steps)]


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
        ranks[beat.rank] = replace(before, step=beat.step, heartbeat_seq=beat.seq, heartbeat_monotonic=written,
                                   heartbeat_phase=beat.phase, step_time_s=beat.step_time_s or before.step_time_s)
        changed, saving = True, saving or beat.phase == SAVE_PHASE
    if not changed:
        return state, []
    window = state.policy.hang.calibration.window
    state = replace(state, ranks=tuple(ranks), step_gaps=with_gaps(state.step_gaps, gaps, window),
                    heartbeats_seen=True)
    if state.stop_stage is StopStage.TERM and saving and state.deadline is not None:
        state = replace(state, deadline=max(state.deadline, saves_end(state, now)))  # a save seen late
    return _continue_order_done(state)


def _continue_order_done(state: State) -> tuple[State, list[Action]]:
    """A save-and-continue order is done once every running rank is past its step."""
    order = state.stop_order
    if order is None or order.exit or state.phase is not Phase.RUNNING:
        return state, []
    if not all(r.step is not None and r.step > order.step for r in state.ranks if r.running):
        return state, []
    state = replace(state, stop_order=None)
    return state, [_record("stop_order_done", order=order.id, step=order.step, source=state.stop_source),
                   PublishStopOrder(None)]


def _on_stacks_collected(state: State, event: StacksCollected, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or state.stop_stage is not StopStage.STACKS:
        return state, []
    records = [_record("stacks_collected", attempt=event.attempt, paths=list(event.paths), culprit=event.culprit,
                       last_steps=dict(event.last_steps))]
    if _hang_of_this_attempt(state):
        assert state.hang is not None
        hang = _refine_hang(state, state.hang, event)
        state = _revise_hang_failure(replace(state, hang=hang, last_failure=_hang_failure(hang)), hang)
        records.append(_hang_record(hang))
    elif event.verdict is not None and event.verdict.rank is not None:  # a collective failed: its culprit
        state, named = _blame_crash(state, event.verdict, event.node)
        records.append(named)
    blocked = (f"blocked in a collective waiting for rank {event.culprit}", event.blocked) if event.blocked else None
    state, actions = _terminate(state, now, blocked) if any(r.running for r in state.ranks) else _all_down(state, now)
    return state, [*records, *actions]


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
    phase = culprit.heartbeat_phase or "launch"
    timeout = state.policy.hang.first_heartbeat_s if phase == "launch" else phase_timeout(
        state.policy.hang, phase, state.step_gaps)
    return replace(hang, stacks=event.paths, rank=culprit.rank, phase=phase, timeout_s=timeout, node=event.node,
                   step=steps.get(culprit.rank, culprit.step), named_by=hang.named_by if verdict else "stacks")


def _hang_record(hang: Hang) -> Record:
    """The hang's final verdict, for the journal: once the evidence is in, or its time ran out."""
    return _record("hang_detected", level="error", rank=hang.rank, node=hang.node, attempt=hang.attempt,
                   phase=hang.phase, step=hang.step, silent_s=round(hang.silent_s, 3), timeout_s=hang.timeout_s,
                   named_by=hang.named_by, evidence=hang.evidence, cause=_hang_cause(hang).text,
                   **{"class": hang.cls})


def _blame_crash(state: State, verdict: Verdict, node: str | None) -> tuple[State, Record]:
    """A collective failed: the failure is the culprit's, as its flight recorder names it, not the first to exit."""
    first = state.failures[-1]
    where = "" if node is None else f" on {node}"
    cause = Cause(CauseKind.COLLECTIVE, f"{verdict.cls}: rank {verdict.rank}{where}: {verdict.evidence} "
                                        f"(first seen as rank {first.rank}: {first.cause.text})"[:MAX_CAUSE_CHARS],
                  first.cause.same_as)
    state = replace(state, failures=(*state.failures[:-1], replace(first, rank=verdict.rank, cause=cause, node=node)),
                    last_failure=f"rank {verdict.rank}{where} ({verdict.cls}) failed a collective in attempt "
                                 f"{first.attempt}: {verdict.evidence}")
    return state, _record("culprit_named", level="error", rank=verdict.rank, node=node, attempt=first.attempt,
                          named_by=verdict.named_by, evidence=verdict.evidence, first_failed=first.rank,
                          cause=cause.text, **{"class": verdict.cls})


def _on_signal(state: State, event: SignalReceived, now: float) -> tuple[State, list[Action]]:
    interrupts = state.interrupts + (event.signum == signal.SIGINT)
    state = replace(state, interrupts=interrupts)
    if event.signum == signal.SIGUSR1:  # Slurm's warning before the time limit: save, stop, be requeued
        state = replace(state, stopped_code=EXIT_REQUEUE)
    actions: list[Action] = [_record("signal_received", signal=_signal_name(event.signum), phase=state.phase.value)]
    if state.phase is Phase.RUNNING:
        if interrupts >= 2:  # a second Ctrl-C means now
            state, stop = _begin_stop(state, Then.STOP, now)
            state, kill = _at_once(state, now)
            return state, actions + stop + kill
        if stopping_on_request(state):
            return state, actions
        state, stop = _request_stop(state, StopRequest(None, True, _signal_name(event.signum)), now)
        return state, actions + stop
    if state.phase is Phase.STOPPING:
        # A stop request cancels a pending relaunch, but a run already failing still fails.
        state = replace(state, then=Then.FAIL if state.then is Then.FAIL else Then.STOP)
        if interrupts >= 2:  # a second Ctrl-C means now
            state, kill = _at_once(state, now)
            actions += kill
        return state, actions
    if state.phase is Phase.BACKOFF:
        state = replace(state, phase=Phase.STOPPED, deadline=None, reason="stopped on request")
        return state, actions + [_record("run_stopped", attempt=state.attempt)]
    state, stop = _begin_stop(state, Then.STOP, now)
    return state, actions + stop


def _at_once(state: State, now: float) -> tuple[State, list[Action]]:
    """SIGKILL a stopping attempt now; but at the second Ctrl-C a save in flight still gets its save timeout (it is
    already SIGTERMed, and the worker finishes the save first), and only a third one abandons it."""
    if state.phase is not Phase.STOPPING or state.stop_stage is StopStage.KILL:
        return state, []
    savers = saving(state)
    if state.interrupts == 2 and savers:
        return state, [_record("save_in_flight", level="warning", ranks=[r.rank for r in savers],
                               steps=[r.step for r in savers], wait_s=round(saves_end(state, now) - now, 3),
                               message="saving, press Ctrl-C again to abandon the save")]
    return _kill(state, now)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _on_tick(state: State, event: Tick, now: float) -> tuple[State, list[Action]]:
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
    if state.stop_stage is StopStage.STACKS:
        verdict = [_hang_record(state.hang)] if state.hang is not None and _hang_of_this_attempt(state) else []
        state, actions = _terminate(state, now) if alive else _all_down(state, now)
        return state, [_record("stacks_timed_out", level="warning", ranks=alive), *verdict, *actions]
    if state.stop_stage is StopStage.TERM:
        state, actions = _kill(state, now)
        return state, [_record("stop_grace_expired", level="warning", ranks=alive,
                               grace_s=state.policy.kill_grace_s), *actions]
    stuck = [f"rank {r.rank} (pid {r.pid})" for r in state.ranks if r.running]
    reason = f"{', '.join(stuck)} survived SIGKILL for {state.policy.sigkill_wait_s:g} s; not relaunching over it"
    return _fail(state, reason), [KillLeftovers(state.attempt)]  # KillLeftovers logs each survivor's state


def _check_heartbeats(state: State, now: float) -> tuple[State, list[Action]]:
    """Declare a hang once every rank is overdue, naming the rank that went silent first (the likely culprit)."""
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
    record = _record("hang_suspected", level="warning", rank=rank.rank, attempt=state.attempt, phase=hang.phase,
                     step=hang.step, silent_s=round(hang.silent_s, 3), timeout_s=hang.timeout_s)
    state, stop = _begin_stop(state, then, now, stacks_first=True)
    return state, [record, *verdict, *stop]


def _silent_since(rank: RankState) -> tuple[float, int]:
    """Who went silent first; on a tie (seen at the same poll) the rank behind, which its peers wait for."""
    seen = rank.heartbeat_monotonic if rank.heartbeat_monotonic is not None else -math.inf
    return seen, rank.step if rank.step is not None else -1


def _hang_failure(hang: Hang) -> str:
    """The hang as `last_failure` says it; the same words before and after the stacks name the culprit."""
    where = "before its first heartbeat" if hang.phase == "launch" else f"in phase {hang.phase}"
    after = "" if hang.step is None else f" (last heartbeat at step {hang.step})"
    return (f"rank {hang.rank} hung {where}{after}: no heartbeat for {hang.silent_s:.1f} s "
            f"(timeout {hang.timeout_s:g} s) in attempt {hang.attempt}")


def _hang_cause(hang: Hang) -> Cause:
    where = "before its first heartbeat" if hang.phase == "launch" else f"in phase {hang.phase}"
    after = "" if hang.step is None else f" after step {hang.step}"
    on = "" if hang.node is None else f" on {hang.node}"
    named = f" ({hang.cls}: {hang.evidence})" if hang.cls and hang.named_by != "heartbeat" else ""
    return Cause(CauseKind.HANG, f"hang: rank {hang.rank}{on}{named} silent {where}{after} "
                                 f"for {hang.silent_s:.1f} s (timeout {hang.timeout_s:g} s)"[:MAX_CAUSE_CHARS])


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


def _update_rank(state: State, rank: int, **changes: object) -> State:
    ranks = list(state.ranks)
    ranks[rank] = replace(ranks[rank], **changes)
    return replace(state, ranks=tuple(ranks))


def _record(event: str, level: str = "info", **fields: object) -> Record:
    return Record(event, level, tuple(fields.items()))


_HANDLERS = {
    Started: _on_started,
    RanksLaunched: _on_launched,
    LaunchFailed: _on_launch_failed,
    ChildExited: _on_child_exited,
    HeartbeatSeen: _on_heartbeat,
    Heartbeats: _on_heartbeats,
    StacksCollected: _on_stacks_collected,
    SignalReceived: _on_signal,
    StopRequested: _on_stop_requested,
    Tick: _on_tick,
}
