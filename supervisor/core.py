"""The supervisor's pure decision core: `decide(state, event, now) -> (state, actions)`.

It knows no files, processes or clocks: every fact arrives as an event, every effect leaves as an
action, and time is the `now` argument (monotonic seconds). Phases and their transitions:

    STARTING --RanksLaunched--> RUNNING
    RUNNING  --ChildExited(0), last rank--> FINISHED
    RUNNING  --ChildExited(!=0)--> STOPPING (then relaunch, or fail when restarts are exhausted)
    RUNNING  --SignalReceived--> STOPPING (then stopped)
    STOPPING --last rank exited--> BACKOFF | FAILED | STOPPED
    STOPPING --deadline--> SIGKILL; a second deadline --> FAILED (a rank survived SIGKILL)
    STOPPING --second SIGINT of the run--> SIGKILL now; a stop request cancels a pending relaunch
    BACKOFF  --deadline--> STARTING (next attempt)
    BACKOFF  --SignalReceived--> STOPPED
    STARTING --LaunchFailed--> FAILED
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "Action",
    "ChildExited",
    "Event",
    "HeartbeatSeen",
    "LaunchFailed",
    "LaunchRanks",
    "Phase",
    "Policy",
    "RankState",
    "RanksLaunched",
    "Record",
    "SignalRanks",
    "SignalReceived",
    "Started",
    "State",
    "Then",
    "Tick",
    "decide",
    "describe_exit",
    "initial_state",
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


@dataclass(frozen=True)
class LaunchFailed:
    """The ranks of `attempt` could not be started at all (none is left running)."""

    attempt: int
    error: str


@dataclass(frozen=True)
class ChildExited:
    """A rank's leader process exited; a negative code is the killing signal, as in Popen."""

    attempt: int
    rank: int
    returncode: int


@dataclass(frozen=True)
class HeartbeatSeen:
    """A rank's heartbeat file holds a new record."""

    attempt: int
    rank: int
    seq: int
    step: int
    phase: str


@dataclass(frozen=True)
class SignalReceived:
    """The supervisor got a signal (SIGTERM, SIGINT, ...)."""

    signum: int


@dataclass(frozen=True)
class Tick:
    """Time passed; deadlines are checked."""


Event = Started | RanksLaunched | LaunchFailed | ChildExited | HeartbeatSeen | SignalReceived | Tick

# ---- actions: imperatives ------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchRanks:
    """Start every rank of `attempt` from the newest complete checkpoint."""

    attempt: int


@dataclass(frozen=True)
class SignalRanks:
    """Send `signum` to the process group of every rank of `attempt` still running."""

    attempt: int
    signum: int


@dataclass(frozen=True)
class Record:
    """Write a decision to the supervisor's journal."""

    event: str
    level: str
    fields: tuple[tuple[str, object], ...] = ()


Action = LaunchRanks | SignalRanks | Record

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

    def backoff_s(self, restarts_done: int) -> float:
        """Delay before the next relaunch: none for the first, then exponential up to the cap."""
        if restarts_done == 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_initial_s * self.backoff_factor ** (restarts_done - 1))


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

    @property
    def running(self) -> bool:
        return self.pid is not None and self.returncode is None


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
    sigkill_sent: bool = False
    interrupts: int = 0  # SIGINTs so far: the second one kills at once
    resume_step: int | None = None
    last_failure: str | None = None
    reason: str | None = None

    @property
    def exit_code(self) -> int | None:
        return {Phase.FINISHED: 0, Phase.STOPPED: 0, Phase.FAILED: 1}.get(self.phase)


def initial_state(policy: Policy) -> State:
    return State(policy=policy, ranks=tuple(RankState(r) for r in range(policy.nproc)))


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
    state = replace(state, phase=Phase.RUNNING, ranks=ranks, resume_step=event.resume_step, deadline=None)
    record = _record("ranks_launched", attempt=event.attempt, pids=list(event.pids), resume_step=event.resume_step)
    return state, [record]


def _on_launch_failed(state: State, event: LaunchFailed, now: float) -> tuple[State, list[Action]]:
    reason = f"could not launch ranks: {event.error}"
    return _fail(state, reason), [_record("launch_failed", level="error", attempt=event.attempt, error=event.error)]


def _on_child_exited(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or not 0 <= event.rank < len(state.ranks):
        return state, []
    if not state.ranks[event.rank].running:
        return state, []
    state = _update_rank(state, event.rank, returncode=event.returncode)
    if state.phase is Phase.RUNNING:
        if event.returncode == 0:
            return _on_clean_exit(state, event)
        return _on_crash(state, event, now)
    if state.phase is Phase.STOPPING:
        return _after_rank_down(state, event, now)
    return state, []


def _on_clean_exit(state: State, event: ChildExited) -> tuple[State, list[Action]]:
    actions: list[Action] = [_record("rank_finished", rank=event.rank, attempt=event.attempt)]
    if all(r.returncode == 0 for r in state.ranks):
        state = replace(state, phase=Phase.FINISHED, reason=None)
        actions.append(_record("run_finished", attempt=state.attempt, restarts=state.restarts))
    return state, actions


def _on_crash(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    failure = f"rank {event.rank} {describe_exit(event.returncode)} in attempt {event.attempt}"
    exhausted = state.restarts >= state.policy.max_restarts
    then = Then.FAIL if exhausted else Then.RELAUNCH
    state = replace(state, last_failure=failure)
    actions: list[Action] = [
        _record("rank_crashed", level="error", rank=event.rank, attempt=event.attempt, returncode=event.returncode,
                description=describe_exit(event.returncode)),
    ]
    if exhausted:
        actions.append(_record("restarts_exhausted", level="error", restarts=state.restarts,
                               max_restarts=state.policy.max_restarts))
    state, stop_actions = _begin_stop(state, then, now)
    return state, actions + stop_actions


def _begin_stop(state: State, then: Then, now: float) -> tuple[State, list[Action]]:
    state = replace(state, phase=Phase.STOPPING, then=then, sigkill_sent=False,
                    deadline=now + state.policy.kill_grace_s)
    if not any(r.running for r in state.ranks):
        return _all_down(state, now)
    return state, [SignalRanks(state.attempt, signal.SIGTERM)]


def _after_rank_down(state: State, event: ChildExited, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = [_record("rank_stopped", rank=event.rank, attempt=event.attempt,
                                     description=describe_exit(event.returncode))]
    if any(r.running for r in state.ranks):
        return state, actions
    state, more = _all_down(state, now)
    return state, actions + more


def _all_down(state: State, now: float) -> tuple[State, list[Action]]:
    if state.then is Then.STOP:
        state = replace(state, phase=Phase.STOPPED, deadline=None, reason="stopped on request")
        return state, [_record("run_stopped", attempt=state.attempt)]
    if state.then is Then.FAIL:
        reason = f"{state.last_failure}; restarts exhausted ({state.restarts}/{state.policy.max_restarts})"
        return _fail(state, reason), []
    delay = state.policy.backoff_s(state.restarts)
    state = replace(state, phase=Phase.BACKOFF, deadline=now + delay)
    actions: list[Action] = [_record("relaunch_scheduled", attempt=state.attempt + 1, backoff_s=delay)]
    if delay <= 0:
        state, launch = _relaunch(state)
        actions += launch
    return state, actions


def _relaunch(state: State) -> tuple[State, list[Action]]:
    attempt = state.attempt + 1
    state = replace(
        state,
        phase=Phase.STARTING,
        attempt=attempt,
        restarts=state.restarts + 1,
        ranks=tuple(RankState(r) for r in range(state.policy.nproc)),
        deadline=None,
        then=None,
    )
    return state, [LaunchRanks(attempt)]


def _fail(state: State, reason: str) -> State:
    return replace(state, phase=Phase.FAILED, deadline=None, reason=reason)


def _on_heartbeat(state: State, event: HeartbeatSeen, now: float) -> tuple[State, list[Action]]:
    if event.attempt != state.attempt or not 0 <= event.rank < len(state.ranks):
        return state, []
    if state.ranks[event.rank].heartbeat_seq == event.seq:
        return state, []
    state = _update_rank(state, event.rank, step=event.step, heartbeat_seq=event.seq,
                         heartbeat_monotonic=now, heartbeat_phase=event.phase)
    return state, []


def _on_signal(state: State, event: SignalReceived, now: float) -> tuple[State, list[Action]]:
    interrupts = state.interrupts + (event.signum == signal.SIGINT)
    state = replace(state, interrupts=interrupts)
    actions: list[Action] = [_record("signal_received", signal=_signal_name(event.signum), phase=state.phase.value)]
    if state.phase is Phase.STOPPING:
        # A stop request cancels a pending relaunch, but a run already failing still fails.
        state = replace(state, then=Then.FAIL if state.then is Then.FAIL else Then.STOP)
        if interrupts >= 2 and not state.sigkill_sent:  # a second Ctrl-C means now
            state = replace(state, sigkill_sent=True, deadline=now + state.policy.sigkill_wait_s)
            actions.append(SignalRanks(state.attempt, signal.SIGKILL))
        return state, actions
    if state.phase is Phase.BACKOFF:
        state = replace(state, phase=Phase.STOPPED, deadline=None, reason="stopped on request")
        return state, actions + [_record("run_stopped", attempt=state.attempt)]
    state, stop = _begin_stop(state, Then.STOP, now)
    return state, actions + stop


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _on_tick(state: State, event: Tick, now: float) -> tuple[State, list[Action]]:
    if state.deadline is None or now < state.deadline:
        return state, []
    if state.phase is Phase.BACKOFF:
        return _relaunch(state)
    if state.phase is Phase.STOPPING and not state.sigkill_sent:
        alive = [r.rank for r in state.ranks if r.running]
        state = replace(state, sigkill_sent=True, deadline=now + state.policy.sigkill_wait_s)
        return state, [
            _record("stop_grace_expired", level="warning", ranks=alive, grace_s=state.policy.kill_grace_s),
            SignalRanks(state.attempt, signal.SIGKILL),
        ]
    if state.phase is Phase.STOPPING:
        stuck = [f"rank {r.rank} (pid {r.pid})" for r in state.ranks if r.running]
        reason = f"{', '.join(stuck)} survived SIGKILL for {state.policy.sigkill_wait_s:g} s; not relaunching over it"
        return _fail(state, reason), [_record("rank_unkillable", level="error", ranks=stuck)]
    return state, []


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
    SignalReceived: _on_signal,
    Tick: _on_tick,
}
