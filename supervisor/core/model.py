"""The decision core's vocabulary: events (past-tense facts), actions (imperatives), the policy and the state,
and the questions asked of a state (deadlines, a rank's exit in words). Pure: plain frozen values, no I/O."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field, replace
from enum import Enum

from supervisor.core.blame import Verdict
from supervisor.core.causes import Cause
from supervisor.core.devices import DeviceVerdict
from supervisor.core.hangs import SAVE_PHASE, HangPolicy, beat_deadline
from supervisor.core.rollback import AbortInfo, AnomalyPolicy, Rollback
from supervisor.core.stop_requests import StopRequest
from worker.contract import (
    EXIT_FAILED,
    EXIT_SAVE_LOST,
    RECOVERING_PHASE,
    StopOrder,
)

__all__ = [
    "saving",
    "signal_name",
    "Action",
    "ChargeDevice",
    "CheckpointRefusal",
    "ChildExited",
    "DeviceExcluded",
    "DeviceVerdict",
    "DeviceVerdictSeen",
    "describe_exit",
    "duration",
    "DumpStacks",
    "Event",
    "Failure",
    "FAILURES_KEPT",
    "Hang",
    "hang_deadline",
    "Heartbeats",
    "HeartbeatSeen",
    "History",
    "initial_state",
    "KillLeftovers",
    "LaunchFailed",
    "LaunchRanks",
    "next_deadline",
    "Phase",
    "Policy",
    "PublishStopOrder",
    "PublishUnwind",
    "rank_deadline",
    "LOST_NODE_UNWIND_S",
    "RECOVERING_GRACE_S",
    "recovering_deadline",
    "RanksLaunched",
    "RankState",
    "Record",
    "SignalRanks",
    "SignalReceived",
    "SlowSaves",
    "StacksCollected",
    "Started",
    "State",
    "StopRequested",
    "StopStage",
    "Then",
    "Tick",
    "TimeLimitRead",
    "time_limit_deadline",
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
    """How far stopping has gone: collect stacks (after a hang), then SIGTERM, then SIGKILL; or, recovering in
    place, the survivors unwind from the failed attempt and wait for the next (none is signalled)."""

    UNWIND = "unwind"
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
    kept: tuple[int, ...] | None = None  # recovering in place, the ranks whose processes went on (None: as asked)
    not_kept: str | None = None  # why the launcher relaunched the ranks it was asked to keep


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
    device: DeviceVerdict | None = None  # it left with EXIT_BAD_DEVICE: the persistent verdict it left for


@dataclass(frozen=True)
class SlowSaves:
    """A rank's background checkpoint writes outlast its save interval: each save waits for the previous one."""

    write_s: float  # the write that was waited for
    interval_s: float  # the training between the two saves
    setting: str  # what to set, in the rank's words ("worker.save_checkpoint_steps: 40 or more")


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
    inexact: str | None = None  # why the rank's resume is not exact (worker.verify), once it knows
    slow_saves: SlowSaves | None = None  # once its background writes outlast its save interval
    in_place: bool = False  # it runs its training function through worker.run: it can recover in place
    failed_s: float | None = None  # recovering in place: how long before this beat its collective failed


@dataclass(frozen=True)
class Heartbeats:
    """New heartbeat records of many ranks, taken in together: one event, one pass over the ranks, for a burst
    of local beats or a fleet's second of them."""

    beats: tuple[HeartbeatSeen, ...]


@dataclass(frozen=True)
class StopRequested:
    """Someone asked for a checkpoint at a step, then an exit or not (stop file); signals arrive as SignalReceived."""

    request: StopRequest
    newest_step: int | None = None  # while no rank runs: the newest state complete on every rank (the run ends there)


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
class DeviceVerdictSeen:
    """A rank logged a transient verdict on a device (its step went on with the re-run's result)."""

    verdict: DeviceVerdict


@dataclass(frozen=True)
class DeviceExcluded:
    """The node ledger excludes the device `verdict` names from now on (`why`): its attempt must move off it."""

    verdict: DeviceVerdict
    why: str


@dataclass(frozen=True)
class SignalReceived:
    """The supervisor got a signal (SIGTERM, SIGINT, ...)."""

    signum: int
    newest_step: int | None = None  # while no rank runs: the newest state complete on every rank (the run ends there)


@dataclass(frozen=True)
class Tick:
    """Time passed; deadlines are checked."""


@dataclass(frozen=True)
class TimeLimitRead:
    """The job's end time as the scheduler says it now (read again now and then: a time limit can be changed).

    `at`: when the job ends, in the supervisor's clock (monotonic; None: no limit); `end_time`: as the scheduler
    wrote it, for the journal; `margin_s`: how long before `at` the run saves at an agreed step and ends with
    EXIT_REQUEUE (the job's own warning lead, `--signal=B:USR1@N`, when it has one)."""

    at: float | None
    margin_s: float
    end_time: str = ""


Event = (
    Started
    | RanksLaunched
    | LaunchFailed
    | ChildExited
    | HeartbeatSeen
    | Heartbeats
    | StacksCollected
    | DeviceVerdictSeen
    | DeviceExcluded
    | SignalReceived
    | StopRequested
    | Tick
    | TimeLimitRead
)

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
    keep: tuple[int, ...] = ()  # ranks whose processes recover in place: they go on into this attempt


@dataclass(frozen=True)
class PublishUnwind:
    """Tell the ranks of `attempt` that it unwinds (with NCCL, each aborts its communicators: worker.recovery)."""

    attempt: int


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
    """SIGKILL whatever is left of `attempt`'s process trees (grandchildren outliving their rank); the ranks in
    `keep` recover in place: they live on."""

    attempt: int
    keep: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChargeDevice:
    """Charge the node (GPU) of a verdict in the node ledger; the launcher answers DeviceExcluded when that
    excludes it."""

    verdict: DeviceVerdict


@dataclass(frozen=True)
class Record:
    """Write a decision to the supervisor's journal."""

    event: str
    level: str
    fields: tuple[tuple[str, object], ...] = ()


Action = (
    LaunchRanks | SignalRanks | DumpStacks | KillLeftovers | PublishStopOrder | PublishUnwind | ChargeDevice | Record
)

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
    in_place: bool = False  # a failed rank's survivors recover in place (restart.in_place)
    in_place_off: str = "restart.in_place is false"  # why not, when not
    in_place_timeout_s: float = 30.0  # survivors not unwound by then: a full relaunch
    can_move: bool = False  # the launcher can relaunch on other nodes (multi-node): not off a bad device otherwise

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
    in_place: bool = False  # its heartbeat says it can recover in place (worker.run)
    failed_monotonic: float | None = None  # recovering in place: when its collective failed, by its beat

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
    cls: str | None = None  # host-side | in-collective | desync | silent (supervisor.core.blame); None: unknown
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
    time_limit: TimeLimitRead | None = None  # the job's end time, as last read
    time_limit_near: bool = False  # the run is ending for it: saving at an agreed step, then EXIT_REQUEUE
    keep: tuple[int, ...] = ()  # the ranks recovering in place into the next attempt, until it is launched
    full_relaunch: str | None = None  # why the next attempt relaunches every rank, until it is launched
    recovery: str | None = None  # how the current attempt came after a failed one, in words (`status`)
    reason: str | None = None

    @property
    def exit_code(self) -> int | None:
        stopped = EXIT_SAVE_LOST if self.saves_lost else self.stopped_code  # a stop that lost a save is not clean
        return {Phase.FINISHED: 0, Phase.STOPPED: stopped, Phase.FAILED: self.failure_code}.get(self.phase)

    @property
    def recovering_in_place(self) -> bool:
        """The survivors of a failed attempt unwind, or wait for the next attempt to be launched, in their own
        processes (not once the run ended or backs off: a launch that failed leaves `keep` behind)."""
        underway = self.phase in (Phase.STOPPING, Phase.STARTING)
        return underway and (self.stop_stage is StopStage.UNWIND or bool(self.keep))

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
    return replace(
        state, attempt=history.attempt + 1, restarts=history.restarts, failures=history.failures[-FAILURES_KEPT:]
    )


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
    deadlines = [
        d
        for phase, beat in newest.items()
        if (
            d := beat_deadline(
                hang,
                phase=phase,
                last_beat=None if phase is None else beat,
                launched_at=state.launched_at,
                expect_beat=expect_beat,
                gaps=state.step_gaps,
            )
        )
        is not None
    ]
    return max(deadlines) if deadlines else None


# A rank that unwound to recover in place while no rank of its attempt exited waits this long for that exit (seen
# within milliseconds) before its own failed collective is the attempt's failure (every rank alive: the network).
RECOVERING_GRACE_S = 0.1

# The survivors of a lost node unwind within this long, or never: their collectives raise once its connections close
# (its processes died), and wait on for ever when it is cut off or powered off. Then every rank is relaunched.
LOST_NODE_UNWIND_S = 5.0


def recovering_deadline(state: State) -> float | None:
    """When a rank that unwound while every rank runs makes its failed collective the attempt's failure."""
    if state.phase is not Phase.RUNNING:
        return None
    beats = [
        r.heartbeat_monotonic
        for r in state.ranks
        if r.running and r.heartbeat_phase == RECOVERING_PHASE and r.heartbeat_monotonic is not None
    ]
    return min(beats) + RECOVERING_GRACE_S if beats else None


def next_deadline(state: State) -> float | None:
    """The earliest moment a Tick can change anything: the phase deadline, the hang deadline, a rank unwound on its
    own, or the time limit's."""
    deadlines = (state.deadline, hang_deadline(state), recovering_deadline(state), time_limit_deadline(state))
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


def time_limit_deadline(state: State) -> float | None:
    """When the run must begin to end for the job's time limit (its margin before it), until it has begun."""
    limit = state.time_limit
    if limit is None or limit.at is None or state.time_limit_near or state.phase.terminal:
        return None
    return limit.at - limit.margin_s


def describe_exit(returncode: int) -> str:
    """'exited with code 3' or 'killed by SIGKILL', as a person would say it."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def saving(state: State) -> list[RankState]:
    """The running ranks whose newest heartbeat says they are inside a checkpoint save."""
    return [r for r in state.ranks if r.running and r.heartbeat_phase == SAVE_PHASE]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def duration(seconds: float) -> str:
    """41s, 12m04s, 3h07m, 2d05h: as precise as a glance needs."""
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
