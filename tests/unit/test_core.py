"""The pure decision core: one test per phase transition or edge, with a fake clock."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.core import (
    Action,
    ChildExited,
    DumpStacks,
    Hang,
    HeartbeatSeen,
    KillLeftovers,
    LaunchFailed,
    LaunchRanks,
    Phase,
    Policy,
    RanksLaunched,
    RankState,
    Record,
    SignalRanks,
    SignalReceived,
    StacksCollected,
    Started,
    State,
    StopStage,
    Then,
    Tick,
    decide,
    describe_exit,
    hang_deadline,
    initial_state,
    next_deadline,
    rank_deadline,
)
from supervisor.core.causes import Cause, CauseKind
from supervisor.core.hangs import Calibration

NOW = 1000.0
PIDS = (100, 101)
POLICY = Policy(
    nproc=2,
    max_restarts=3,
    backoff_initial_s=1.0,
    backoff_factor=2.0,
    backoff_max_s=5.0,
    kill_grace_s=10.0,
    sigkill_wait_s=5.0,
)


def running(policy: Policy = POLICY, *, restarts: int = 0, resume_step: int | None = None) -> State:
    """A RUNNING state with `policy.nproc` ranks (pids 100, 101, ...) after `restarts` relaunches."""
    state, actions = decide(initial_state(policy), Started(), NOW)
    assert actions == [LaunchRanks(0)]
    state = replace(state, attempt=restarts, restarts=restarts)
    pids = tuple(100 + r for r in range(policy.nproc))
    state, _ = decide(state, RanksLaunched(restarts, pids, resume_step), NOW)
    assert state.phase is Phase.RUNNING
    return state


def stopping_for_crash(policy: Policy = POLICY, *, restarts: int = 0) -> State:
    """STOPPING after rank 0 of a 2-rank run exited with code 3; rank 1 still runs."""
    state, _ = decide(running(policy, restarts=restarts), ChildExited(restarts, 0, 3), NOW)
    assert state.phase is Phase.STOPPING
    return state


def backoff(policy: Policy = POLICY) -> State:
    """BACKOFF after the second crash (one restart already done), waiting for its deadline."""
    state = stopping_for_crash(policy, restarts=1)
    state, _ = decide(state, ChildExited(1, 1, -15), NOW)
    assert state.phase is Phase.BACKOFF
    return state


SOLO = replace(POLICY, nproc=1)
HUNG_AT = NOW + 310.0  # `silent()`: rank 1, the last to beat (NOW + 10), passes the 300 s train timeout
HUNG = Hang(attempt=0, rank=0, phase="train", step=10, silent_s=305.0, timeout_s=300.0)  # rank 0 beat at NOW + 5
STACKS = ("stacks/attempt-0-rank-0.txt", "stacks/attempt-0-rank-1.txt")


def with_hang(policy: Policy = POLICY, **changes: object) -> Policy:
    """`policy` with some `HangPolicy` fields changed."""
    return replace(policy, hang=replace(policy.hang, **changes))


def calibrating(policy: Policy = SOLO, **changes: object) -> Policy:
    """`policy` with calibration on after 3 gaps (multiplier 10, p99, floor 30 s), plus `changes`."""
    return with_hang(policy, calibration=Calibration(enabled=True, min_samples=3, **changes))


def beat(state: State, rank: int, seq: int, at: float, phase: str = "train", step: int = 10) -> State:
    """`state` after rank `rank` of the current attempt showed heartbeat `seq` at `at`."""
    state, actions = decide(state, HeartbeatSeen(state.attempt, rank, seq=seq, step=step, phase=phase), at)
    assert actions == []
    return state


def train_beats(state: State, times: list[float], rank: int = 0) -> State:
    """`state` after rank `rank` showed consecutive `train` heartbeats at `times`."""
    for seq, at in enumerate(times, start=1):
        state = beat(state, rank, seq, at, step=seq)
    return state


def silent(policy: Policy = POLICY, *, restarts: int = 0) -> State:
    """RUNNING with both ranks silent after one `train` beat at step 10: rank 0 at NOW + 5, rank 1 at NOW + 10."""
    return beat(beat(running(policy, restarts=restarts), 0, 1, NOW + 5), 1, 1, NOW + 10)


def hung(policy: Policy = POLICY, *, restarts: int = 0) -> State:
    """STOPPING in the STACKS stage after `silent()` was declared hung at HUNG_AT."""
    state, _ = decide(silent(policy, restarts=restarts), Tick(), HUNG_AT)
    assert (state.phase, state.stop_stage) == (Phase.STOPPING, StopStage.STACKS)
    return state


def shape(actions: list[Action]) -> list[object]:
    """Actions with each Record replaced by its event name, so a whole list compares exactly."""
    return [a.event if isinstance(a, Record) else a for a in actions]


def record(actions: list[Action], event: str) -> Record:
    """The one Record named `event` among `actions`."""
    (found,) = [a for a in actions if isinstance(a, Record) and a.event == event]
    return found


# ---- starting ---------------------------------------------------------------------------------


def test_initial_state_has_one_idle_rank_per_process():
    """A fresh state is STARTING attempt 0 with one unlaunched rank per process and no deadline."""
    state = initial_state(POLICY)
    assert state.phase is Phase.STARTING
    assert (state.attempt, state.restarts, state.deadline) == (0, 0, None)
    assert state.ranks == (RankState(0), RankState(1))
    assert not any(r.running for r in state.ranks)


def test_started_launches_first_attempt():
    """`Started` leaves the state STARTING and asks to launch attempt 0."""
    state, actions = decide(initial_state(POLICY), Started(), NOW)
    assert state == initial_state(POLICY)
    assert actions == [LaunchRanks(0)]


def test_ranks_launched_enters_running():
    """`RanksLaunched` for the current attempt enters RUNNING with the pids and the resume step."""
    state, actions = decide(initial_state(POLICY), RanksLaunched(0, PIDS, 25), NOW)
    assert state.phase is Phase.RUNNING
    assert state.ranks == (RankState(0, pid=100), RankState(1, pid=101))
    assert state.resume_step == 25
    assert state.deadline is None
    assert shape(actions) == ["ranks_launched"]
    assert dict(actions[0].fields) == {"attempt": 0, "pids": [100, 101], "resume_step": 25, "resume_source": None}


def test_ranks_launched_of_other_attempt_ignored():
    """`RanksLaunched` for an attempt other than the current one changes nothing."""
    state = initial_state(POLICY)
    assert decide(state, RanksLaunched(1, PIDS, None), NOW) == (state, [])


def test_ranks_launched_while_running_ignored():
    """A repeated `RanksLaunched` while RUNNING changes nothing."""
    state = running()
    assert decide(state, RanksLaunched(0, (200, 201), None), NOW) == (state, [])


def test_launch_failed_fails():
    """A permanent `LaunchFailed` (exit 1 named) ends the run FAILED with the launch error as the reason."""
    failed = LaunchFailed(0, "No such file: train.py", retryable=False, exit_code=1)
    state, actions = decide(initial_state(POLICY), failed, NOW)
    assert state.phase is Phase.FAILED
    assert state.reason == "could not launch ranks: No such file: train.py"
    assert state.exit_code == 1
    assert shape(actions) == ["launch_failed"]
    assert actions[0].level == "error"


def test_child_exit_before_launch_ignored():
    """A child exit while STARTING (no rank has a pid yet) changes nothing."""
    state = initial_state(POLICY)
    assert decide(state, ChildExited(0, 0, 1), NOW) == (state, [])


def test_signal_while_starting_stops_at_once():
    """A signal before any rank is launched ends the run STOPPED with nothing to signal."""
    state, actions = decide(initial_state(POLICY), SignalReceived(signal.SIGTERM), NOW)
    assert state.phase is Phase.STOPPED
    assert state.deadline is None
    assert state.reason == (
        "stopped on request (SIGTERM) with no rank running: no checkpoint is complete, so the run starts again "
        "from its beginning when resumed"
    )
    assert state.stop_stage is None
    assert shape(actions) == ["signal_received", KillLeftovers(0), "run_stopped"]


# ---- running ----------------------------------------------------------------------------------


def test_one_rank_exit_zero_keeps_running():
    """A rank exiting 0 while another still runs keeps the run RUNNING."""
    state, actions = decide(running(), ChildExited(0, 0, 0), NOW)
    assert state.phase is Phase.RUNNING
    assert state.ranks[0].returncode == 0
    assert state.ranks[1].running
    assert shape(actions) == ["rank_finished"]


def test_all_ranks_exit_zero_finishes():
    """When the last rank exits 0 and every rank exited 0, the run is FINISHED with exit code 0."""
    state, _ = decide(running(), ChildExited(0, 1, 0), NOW)
    state, actions = decide(state, ChildExited(0, 0, 0), NOW)
    assert state.phase is Phase.FINISHED
    assert state.exit_code == 0
    assert state.reason is None
    assert shape(actions) == ["rank_finished", "run_finished"]
    assert dict(record(actions, "run_finished").fields) == {"attempt": 0, "restarts": 0}


def test_running_child_exited_nonzero_begins_stop_with_sigterm():
    """A rank exiting non-zero moves to STOPPING, SIGTERMs the attempt and sets the grace deadline."""
    state, actions = decide(running(), ChildExited(0, 1, 3), NOW)
    assert state.phase is Phase.STOPPING
    assert state.deadline == NOW + 10.0
    assert state.stop_stage is StopStage.TERM
    assert state.last_failure == "rank 1 exited with code 3 in attempt 0"
    assert state.ranks[1].returncode == 3
    assert shape(actions) == ["rank_crashed", SignalRanks(0, signal.SIGTERM)]
    crashed = record(actions, "rank_crashed")
    assert crashed.level == "error"
    assert dict(crashed.fields)["description"] == "exited with code 3"


def test_running_child_killed_by_signal_names_the_signal():
    """A rank killed by a signal is reported by the signal's name."""
    state, _ = decide(running(), ChildExited(0, 0, -signal.SIGKILL), NOW)
    assert state.last_failure == "rank 0 killed by SIGKILL in attempt 0"


def test_crash_of_last_running_rank_relaunches_at_once():
    """A crash of the only rank still running needs no stop and relaunches immediately."""
    state, _ = decide(running(), ChildExited(0, 0, 0), NOW)
    state, actions = decide(state, ChildExited(0, 1, 2), NOW)
    assert state.phase is Phase.STARTING
    assert (state.attempt, state.restarts) == (1, 1)
    assert state.stop_stage is None
    assert shape(actions) == ["rank_crashed", KillLeftovers(0), "relaunch_scheduled", LaunchRanks(1)]


def test_child_exit_of_old_attempt_ignored():
    """A child exit reported for a previous attempt changes nothing."""
    state = running(restarts=1)
    assert decide(state, ChildExited(0, 0, 1), NOW) == (state, [])


def test_child_exit_of_already_exited_rank_ignored():
    """A second exit report for a rank that already exited changes nothing."""
    state, _ = decide(running(), ChildExited(0, 0, 0), NOW)
    assert decide(state, ChildExited(0, 0, 1), NOW) == (state, [])


def test_tick_without_deadline_does_nothing():
    """A tick while RUNNING (no deadline) changes nothing."""
    state = running()
    assert decide(state, Tick(), NOW + 3600) == (state, [])


# ---- heartbeats -------------------------------------------------------------------------------


def test_heartbeat_updates_step_and_time():
    """A new heartbeat records the rank's step, sequence number, phase and the time it was seen."""
    state, actions = decide(running(), HeartbeatSeen(0, 1, seq=7, step=42, phase="train"), NOW + 2)
    assert actions == []
    assert state.ranks[1] == RankState(
        1, pid=101, step=42, heartbeat_seq=7, heartbeat_monotonic=NOW + 2, heartbeat_phase="train"
    )
    assert state.ranks[0] == RankState(0, pid=100)


def test_heartbeat_same_seq_keeps_time():
    """A heartbeat with an already-seen sequence number keeps the earlier time and step."""
    state, _ = decide(running(), HeartbeatSeen(0, 0, seq=7, step=42, phase="train"), NOW + 2)
    again, actions = decide(state, HeartbeatSeen(0, 0, seq=7, step=43, phase="save"), NOW + 9)
    assert (again, actions) == (state, [])
    assert again.ranks[0].heartbeat_monotonic == NOW + 2


def test_heartbeat_of_old_attempt_ignored():
    """A heartbeat from a previous attempt changes nothing."""
    state = running(restarts=1)
    assert decide(state, HeartbeatSeen(0, 0, seq=1, step=5, phase="train"), NOW) == (state, [])


def test_heartbeat_of_unknown_rank_ignored():
    """A heartbeat for a rank number beyond the world size changes nothing."""
    state = running()
    assert decide(state, HeartbeatSeen(0, 2, seq=1, step=5, phase="train"), NOW) == (state, [])


def test_ranks_launched_resets_heartbeats():
    """A relaunched attempt starts with no heartbeat or step carried over from the previous one."""
    state, _ = decide(running(), HeartbeatSeen(0, 0, seq=3, step=30, phase="train"), NOW)
    state, _ = decide(state, ChildExited(0, 0, 1), NOW)
    state, _ = decide(state, ChildExited(0, 1, -15), NOW)
    state, _ = decide(state, RanksLaunched(1, (200, 201), 25), NOW)
    assert state.ranks == (RankState(0, pid=200), RankState(1, pid=201))


# ---- stopping after a crash ---------------------------------------------------------------------


def test_stopping_rank_exit_keeps_stopping_until_last():
    """While ranks remain running, a rank going down only records it."""
    policy = replace(POLICY, nproc=3)
    state, _ = decide(running(policy), ChildExited(0, 0, 1), NOW)
    state, actions = decide(state, ChildExited(0, 1, -15), NOW + 1)
    assert state.phase is Phase.STOPPING
    assert state.deadline == NOW + 10.0
    assert shape(actions) == ["rank_stopped"]
    assert dict(actions[0].fields)["description"] == "killed by SIGTERM"


def test_rank_exit_while_stopping_is_not_a_new_crash():
    """A non-zero exit while STOPPING is a rank going down, not another crash."""
    state, actions = decide(stopping_for_crash(), ChildExited(0, 1, 7), NOW + 1)
    assert state.last_failure == "rank 0 exited with code 3 in attempt 0"
    assert "rank_crashed" not in shape(actions)


def test_first_relaunch_has_no_backoff():
    """With no restart done yet, the last rank going down relaunches the next attempt at once."""
    state, actions = decide(stopping_for_crash(), ChildExited(0, 1, -15), NOW + 1)
    assert state.phase is Phase.STARTING
    assert (state.attempt, state.restarts) == (1, 1)
    assert state.deadline is None
    assert state.ranks == (RankState(0), RankState(1))
    assert state.stop_stage is None
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "relaunch_scheduled", LaunchRanks(1)]
    assert dict(record(actions, "relaunch_scheduled").fields) == {"attempt": 1, "backoff_s": 0.0}


def test_later_relaunch_enters_backoff():
    """After a restart was already done, the last rank going down waits in BACKOFF for the first delay."""
    state, actions = decide(stopping_for_crash(restarts=1), ChildExited(1, 1, -15), NOW + 1)
    assert state.phase is Phase.BACKOFF
    assert (state.attempt, state.restarts) == (1, 1)
    assert state.deadline == NOW + 1 + 1.0
    assert state.stop_stage is None
    assert shape(actions) == ["rank_stopped", KillLeftovers(1), "relaunch_scheduled"]
    assert dict(record(actions, "relaunch_scheduled").fields) == {"attempt": 2, "backoff_s": 1.0}


def test_backoff_tick_before_deadline_waits():
    """A tick before the backoff deadline changes nothing."""
    state = backoff()
    assert decide(state, Tick(), state.deadline - 0.001) == (state, [])


def test_backoff_deadline_relaunches_next_attempt():
    """A tick at the backoff deadline starts the next attempt with fresh ranks."""
    state = backoff()
    state, actions = decide(state, Tick(), state.deadline)
    assert state.phase is Phase.STARTING
    assert (state.attempt, state.restarts) == (2, 2)
    assert state.deadline is None
    assert state.then is None
    assert state.ranks == (RankState(0), RankState(1))
    assert actions == [LaunchRanks(2)]


def test_relaunched_attempt_runs_from_resume_step():
    """`RanksLaunched` for the relaunched attempt enters RUNNING with its resume step."""
    state, _ = decide(stopping_for_crash(), ChildExited(0, 1, -15), NOW)
    state, actions = decide(state, RanksLaunched(1, (200, 201), 25), NOW)
    assert state.phase is Phase.RUNNING
    assert (state.attempt, state.restarts, state.resume_step) == (1, 1, 25)
    assert shape(actions) == ["relaunched", "ranks_launched"]
    assert dict(actions[0].fields)["reason"] == "restart.in_place is false"  # which path, and why


def test_backoff_grows_exponentially_to_cap():
    """The relaunch delay is 0 for the first restart, then initial * factor**(n-1), capped at the maximum."""
    assert [POLICY.backoff_s(n) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("restarts", [1000, 1025, 10**6, 10**18])
def test_backoff_after_very_many_restarts_is_the_cap(restarts):
    """However many restarts were done, the delay is backoff_max_s: factor ** n past a float never raises."""
    assert POLICY.backoff_s(restarts) == 5.0


def test_backoff_with_the_largest_factor_is_the_cap():
    """A factor of 2**53 with a 10^7 s start reaches the cap at once and never overflows."""
    policy = replace(POLICY, backoff_initial_s=1e7, backoff_factor=2.0**53, backoff_max_s=60.0)
    assert [policy.backoff_s(n) for n in (0, 1, 2, 100, 10**6)] == [0.0, 60.0, 60.0, 60.0, 60.0]


def test_backoff_from_zero_stays_zero():
    """With backoff_initial_s 0 every relaunch is immediate, even after the factor's power overflows."""
    assert replace(POLICY, backoff_initial_s=0.0).backoff_s(10**6) == 0.0


def test_restarts_exhausted_fails_after_ranks_down():
    """A crash with no restarts left stops the other ranks, then FAILs naming the crash and the count."""
    state, actions = decide(running(restarts=3), ChildExited(3, 0, 3), NOW)
    assert state.phase is Phase.STOPPING
    assert shape(actions) == ["rank_crashed", "restarts_exhausted", SignalRanks(3, signal.SIGTERM)]
    assert dict(record(actions, "restarts_exhausted").fields) == {"restarts": 3, "max_restarts": 3}
    state, actions = decide(state, ChildExited(3, 1, -15), NOW + 1)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 1
    assert state.reason == "rank 0 exited with code 3 in attempt 3; restarts exhausted (3/3)"
    assert state.stop_stage is None
    assert shape(actions) == ["rank_stopped", KillLeftovers(3)]


def test_no_restarts_allowed_single_rank_crash_fails_at_once():
    """With max_restarts 0 and one rank, a crash fails the run immediately with nothing to stop."""
    policy = replace(POLICY, nproc=1, max_restarts=0)
    state, actions = decide(running(policy), ChildExited(0, 0, 1), NOW)
    assert state.phase is Phase.FAILED
    assert state.reason == "rank 0 exited with code 1 in attempt 0; restarts exhausted (0/0)"
    assert shape(actions) == ["rank_crashed", "restarts_exhausted", KillLeftovers(0)]


# ---- stop deadlines ---------------------------------------------------------------------------


def test_stopping_tick_before_deadline_does_nothing():
    """A tick before the grace deadline changes nothing."""
    state = stopping_for_crash()
    assert decide(state, Tick(), NOW + 9.999) == (state, [])


def test_stopping_deadline_sends_sigkill():
    """At the grace deadline the surviving ranks get SIGKILL and a second, shorter deadline starts."""
    state, actions = decide(stopping_for_crash(), Tick(), NOW + 10.0)
    assert state.phase is Phase.STOPPING
    assert state.stop_stage is StopStage.KILL
    assert state.deadline == NOW + 10.0 + 5.0
    assert shape(actions) == ["stop_grace_expired", SignalRanks(0, signal.SIGKILL)]
    expired = record(actions, "stop_grace_expired")
    assert expired.level == "warning"
    assert dict(expired.fields) == {"ranks": [1], "grace_s": 10.0}


def test_rank_exit_after_sigkill_completes_stop():
    """Ranks going down after the SIGKILL complete the stop as planned (here: relaunch)."""
    state, _ = decide(stopping_for_crash(), Tick(), NOW + 10.0)
    state, actions = decide(state, ChildExited(0, 1, -9), NOW + 10.1)
    assert state.phase is Phase.STARTING
    assert state.attempt == 1
    assert state.stop_stage is None
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "relaunch_scheduled", LaunchRanks(1)]


def test_stopping_second_deadline_fails_unkillable():
    """A rank still running at the deadline after SIGKILL fails the run rather than relaunching over it."""
    state, _ = decide(stopping_for_crash(), Tick(), NOW + 10.0)
    state, actions = decide(state, Tick(), NOW + 15.0)
    assert state.phase is Phase.FAILED
    assert state.deadline is None
    assert state.reason == "rank 1 (pid 101) survived SIGKILL for 5 s; not relaunching over it"
    assert actions == [KillLeftovers(0)]  # which logs the survivor's pid and process state


# ---- signals ----------------------------------------------------------------------------------


def test_signal_while_running_stops_ranks():
    """A signal while RUNNING, no rank reporting steps (no worker library): SIGTERM every rank, start the grace."""
    state, actions = decide(running(), SignalReceived(signal.SIGTERM), NOW)
    assert state.phase is Phase.STOPPING
    assert state.deadline == NOW + 10.0
    assert state.stop_stage is StopStage.TERM
    assert shape(actions) == ["signal_received", "stop_requested", SignalRanks(0, signal.SIGTERM)]
    assert dict(actions[0].fields) == {"signal": "SIGTERM", "phase": "running"}


def test_stop_on_request_ends_stopped_when_ranks_down():
    """After a requested stop, the last rank going down ends the run STOPPED with exit code 0."""
    state, _ = decide(running(), SignalReceived(signal.SIGTERM), NOW)
    state, _ = decide(state, ChildExited(0, 0, 0), NOW + 1)
    state, actions = decide(state, ChildExited(0, 1, -15), NOW + 2)
    assert state.phase is Phase.STOPPED
    assert state.exit_code == 0
    assert state.deadline is None
    assert state.reason == "stopped on request"
    assert state.stop_stage is None
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "run_stopped"]


def test_signal_while_stopping_for_crash_stops_instead_of_relaunch():
    """A SIGTERM during a crash stop turns the planned relaunch into a stop."""
    state, actions = decide(stopping_for_crash(), SignalReceived(signal.SIGTERM), NOW + 1)
    assert state.phase is Phase.STOPPING
    assert state.deadline == NOW + 10.0
    assert shape(actions) == ["signal_received"]
    state, _ = decide(state, ChildExited(0, 1, -15), NOW + 2)
    assert state.phase is Phase.STOPPED


def test_sigterm_while_stopping_does_not_escalate():
    """A second SIGTERM while STOPPING sends no SIGKILL and keeps the deadline."""
    state, _ = decide(running(), SignalReceived(signal.SIGTERM), NOW)
    state, actions = decide(state, SignalReceived(signal.SIGTERM), NOW + 1)
    assert state.stop_stage is StopStage.TERM
    assert state.deadline == NOW + 10.0
    assert shape(actions) == ["signal_received"]


def test_second_sigint_while_stopping_kills_now():
    """A second SIGINT while STOPPING SIGKILLs the ranks at once and starts the SIGKILL deadline."""
    state, _ = decide(running(), SignalReceived(signal.SIGINT), NOW)
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    assert state.phase is Phase.STOPPING
    assert state.stop_stage is StopStage.KILL
    assert state.deadline == NOW + 1 + 5.0
    assert shape(actions) == ["signal_received", SignalRanks(0, signal.SIGKILL)]


def test_third_sigint_while_stopping_sends_nothing_more():
    """A SIGINT after SIGKILL was already sent only records the signal."""
    state, _ = decide(running(), SignalReceived(signal.SIGINT), NOW)
    state, _ = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    again, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 2)
    assert again == replace(state, interrupts=3)
    assert shape(actions) == ["signal_received"]


def test_first_sigint_while_stopping_after_crash_does_not_kill():
    """The operator's first Ctrl-C during the stop after a crash cancels the relaunch but sends no SIGKILL."""
    state, _ = decide(running(), ChildExited(0, 1, 3), NOW)
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    assert (state.phase, state.then, state.stop_stage) == (Phase.STOPPING, Then.STOP, StopStage.TERM)
    assert shape(actions) == ["signal_received"]


def test_signal_in_backoff_stops_at_once():
    """A signal during BACKOFF ends the run STOPPED without launching anything."""
    state, actions = decide(backoff(), SignalReceived(signal.SIGTERM), NOW + 0.5)
    assert state.phase is Phase.STOPPED
    assert state.deadline is None
    assert state.attempt == 1
    assert state.reason is not None and state.reason.startswith("stopped on request (SIGTERM) with no rank running")
    assert shape(actions) == ["signal_received", "run_stopped"]


def test_signal_while_stopping_after_restarts_exhausted_still_fails():
    """A stop signal arriving while a run with exhausted restarts is going down still ends it FAILED."""
    state, _ = decide(running(restarts=3), ChildExited(3, 0, 3), NOW)
    state, _ = decide(state, SignalReceived(signal.SIGTERM), NOW + 1)
    state, _ = decide(state, ChildExited(3, 1, -15), NOW + 2)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 1


# ---- hang detection ---------------------------------------------------------------------------


def test_ranks_launched_records_launch_time():
    """`RanksLaunched` stores the launch time from which first-heartbeat deadlines count."""
    state, _ = decide(initial_state(POLICY), RanksLaunched(0, PIDS, None), NOW + 7)
    assert state.launched_at == NOW + 7


def test_relaunch_clears_launch_time():
    """A relaunch clears the previous attempt's launch time until its ranks are launched."""
    state, _ = decide(stopping_for_crash(), ChildExited(0, 1, -15), NOW + 1)
    assert (state.phase, state.launched_at) == (Phase.STARTING, None)


def test_heartbeat_marks_heartbeats_seen():
    """The first heartbeat of the run marks that the script uses the worker library."""
    state = running()
    assert state.heartbeats_seen is False
    assert beat(state, 1, 1, NOW + 1).heartbeats_seen is True


def test_all_ranks_past_train_timeout_declares_hang():
    """Once every rank is silent past its `train` timeout, a hang is declared: stacks first, with a deadline."""
    state, actions = decide(silent(), Tick(), HUNG_AT)
    assert state.phase is Phase.STOPPING
    assert (state.stop_stage, state.then) == (StopStage.STACKS, Then.RELAUNCH)
    assert state.deadline == HUNG_AT + 15.0
    assert state.hang == HUNG
    assert state.last_failure == (
        "rank 0 hung in phase train (last heartbeat at step 10): no heartbeat for 305.0 s (timeout 300 s) in attempt 0"
    )
    assert shape(actions) == ["hang_suspected", DumpStacks(0, ranks=(0, 1), faulthandler_ranks=(0, 1))]
    suspected = record(actions, "hang_suspected")
    assert suspected.level == "warning"
    assert dict(suspected.fields) == {
        "rank": 0,
        "attempt": 0,
        "phase": "train",
        "step": 10,
        "silent_s": 305.0,
        "timeout_s": 300.0,
    }
    # The verdict waits for the evidence: no culprit found, the heartbeats' guess is final.
    state, actions = decide(state, StacksCollected(0, STACKS), HUNG_AT + 2)
    assert dict(record(actions, "hang_detected").fields) == {
        "rank": 0,
        "node": None,
        "attempt": 0,
        "phase": "train",
        "step": 10,
        "silent_s": 305.0,
        "timeout_s": 300.0,
        "named_by": "heartbeat",
        "evidence": None,
        "class": None,
        "cause": "hang: rank 0 silent in phase train after step 10 for 305.0 s (timeout 300 s)",
    }


def test_tick_one_instant_before_hang_deadline_does_nothing():
    """A tick just before the last rank's heartbeat deadline declares nothing."""
    state = silent()
    assert hang_deadline(state) == HUNG_AT
    assert decide(state, Tick(), HUNG_AT - 0.001) == (state, [])


def test_one_rank_overdue_while_peer_beats_is_no_hang():
    """A rank past its deadline is not a hang while a peer still beats within its own timeout."""
    state = beat(beat(running(), 0, 1, NOW + 5), 1, 1, NOW + 200)
    assert rank_deadline(state, state.ranks[0]) == NOW + 305
    assert decide(state, Tick(), NOW + 499.999) == (state, [])
    state, _ = decide(state, Tick(), NOW + 500)
    assert (state.hang.rank, state.hang.silent_s) == (0, 495.0)


def test_peer_in_long_save_keeps_job_alive():
    """A rank in a long `save` keeps the job alive while its peer, blocked waiting for it, is past `train`."""
    state = beat(beat(running(), 0, 1, NOW, phase="save"), 1, 1, NOW, step=10)
    assert hang_deadline(state) == NOW + 1800
    assert decide(state, Tick(), NOW + 1799.999) == (state, [])
    state, _ = decide(state, Tick(), NOW + 1800)
    assert state.hang == Hang(attempt=0, rank=0, phase="save", step=10, silent_s=1800.0, timeout_s=1800.0)


def test_rank_silent_longest_is_named_in_hang():
    """When every rank is past its deadline, the hang names the one that went silent first."""
    state = beat(beat(running(), 0, 1, NOW + 20, step=8), 1, 1, NOW + 5, step=7)
    state, actions = decide(state, Tick(), NOW + 400)
    assert state.hang == Hang(attempt=0, rank=1, phase="train", step=7, silent_s=395.0, timeout_s=300.0)
    assert shape(actions) == ["hang_suspected", DumpStacks(0, ranks=(0, 1), faulthandler_ranks=(0, 1))]


def test_finished_rank_is_not_declared_hung():
    """A rank that already exited 0 has no heartbeat deadline however long it has been silent."""
    state = beat(beat(running(), 0, 1, NOW), 1, 1, NOW)
    state, _ = decide(state, ChildExited(0, 0, 0), NOW + 1)
    state = beat(state, 1, 2, NOW + 250)
    assert rank_deadline(state, state.ranks[0]) is None
    assert decide(state, Tick(), NOW + 549) == (state, [])


def test_required_heartbeat_first_beat_timeout_declares_hang():
    """With heartbeat `required`, a rank with no heartbeat by launch + first_heartbeat_s is hung in `launch`."""
    state, actions = decide(running(with_hang(heartbeat="required")), Tick(), NOW + 900)
    assert (state.phase, state.stop_stage, state.deadline) == (Phase.STOPPING, StopStage.STACKS, NOW + 915)
    assert state.hang == Hang(attempt=0, rank=0, phase="launch", step=None, silent_s=900.0, timeout_s=900.0)
    assert state.last_failure.startswith("rank 0 hung before its first heartbeat:")
    assert state.last_failure.endswith(": no heartbeat for 900.0 s (timeout 900 s) in attempt 0")
    assert shape(actions) == ["hang_suspected", DumpStacks(0, ranks=(0, 1), faulthandler_ranks=())]
    state, actions = decide(state, Tick(), NOW + 915)  # the evidence did not come in time: the guess stands
    assert record(actions, "hang_detected").fields[-2:] == (
        ("cause", "hang: rank 0 silent before its first heartbeat for 900.0 s (timeout 900 s)"),
        ("class", None),
    )


def test_first_heartbeat_hang_failure_names_no_step():
    """The failure text of a hang before any heartbeat does not mention a step the rank never reported."""
    state, _ = decide(running(with_hang(heartbeat="required")), Tick(), NOW + 900)
    assert "step None" not in state.last_failure


def test_required_heartbeat_tick_before_first_beat_timeout_does_nothing():
    """With heartbeat `required`, a tick just before launch + first_heartbeat_s declares nothing."""
    state = running(with_hang(heartbeat="required"))
    assert decide(state, Tick(), NOW + 899.999) == (state, [])


def test_auto_heartbeat_without_any_beat_never_declares_hang():
    """With heartbeat `auto`, a run whose ranks never beat (no worker library) is never declared hung."""
    state = running()
    assert [rank_deadline(state, r) for r in state.ranks] == [None, None]
    assert decide(state, Tick(), NOW + 10**6) == (state, [])


def test_auto_heartbeat_first_beat_timeout_applies_once_heartbeats_seen():
    """With heartbeat `auto`, once some rank has beaten, a rank silent since launch is due by first_heartbeat_s."""
    state = running()
    assert rank_deadline(state, state.ranks[0]) is None
    state = beat(state, 1, 1, NOW + 700)
    assert [rank_deadline(state, r) for r in state.ranks] == [NOW + 900, NOW + 1000]
    state, actions = decide(state, Tick(), NOW + 1000)
    assert state.hang == Hang(attempt=0, rank=0, phase="launch", step=None, silent_s=1000.0, timeout_s=900.0)
    assert shape(actions) == ["hang_suspected", DumpStacks(0, ranks=(0, 1), faulthandler_ranks=(1,))]


def test_auto_heartbeats_seen_survives_relaunch():
    """With heartbeat `auto`, beats seen in an earlier attempt make the first-heartbeat timeout apply after relaunch."""
    state = beat(running(), 0, 1, NOW)
    state, _ = decide(state, ChildExited(0, 0, 1), NOW + 1)
    state, _ = decide(state, ChildExited(0, 1, -15), NOW + 2)
    state, _ = decide(state, RanksLaunched(1, (200, 201), None), NOW + 3)
    assert state.heartbeats_seen is True
    assert [rank_deadline(state, r) for r in state.ranks] == [NOW + 903, NOW + 903]
    state, actions = decide(state, Tick(), NOW + 903)
    assert state.hang == Hang(attempt=1, rank=0, phase="launch", step=None, silent_s=900.0, timeout_s=900.0)
    assert shape(actions) == ["hang_suspected", DumpStacks(1, ranks=(0, 1), faulthandler_ranks=())]


def test_heartbeat_off_never_declares_hang():
    """With heartbeat `off`, no rank has a deadline and no tick declares a hang."""
    state = beat(running(with_hang(heartbeat="off")), 0, 1, NOW)
    assert [rank_deadline(state, r) for r in state.ranks] == [None, None]
    assert next_deadline(state) is None
    assert decide(state, Tick(), NOW + 10**6) == (state, [])


def test_save_phase_gets_its_longer_timeout():
    """A rank whose newest heartbeat named `save` may stay silent for the `save` timeout, not the `train` one."""
    state = beat(running(SOLO), 0, 1, NOW, phase="save")
    assert rank_deadline(state, state.ranks[0]) == NOW + 1800
    assert decide(state, Tick(), NOW + 1799.999) == (state, [])
    state, _ = decide(state, Tick(), NOW + 1800)
    assert state.hang == Hang(attempt=0, rank=0, phase="save", step=10, silent_s=1800.0, timeout_s=1800.0)


def test_unknown_custom_phase_gets_default_timeout():
    """A phase not named in phase_timeouts_s gets default_timeout_s."""
    state = beat(running(with_hang(SOLO, default_timeout_s=777.0)), 0, 1, NOW, phase="shuffle_shards")
    assert rank_deadline(state, state.ranks[0]) == NOW + 777
    state, _ = decide(state, Tick(), NOW + 777)
    assert state.hang == Hang(attempt=0, rank=0, phase="shuffle_shards", step=10, silent_s=777.0, timeout_s=777.0)


def test_heartbeat_resets_deadline():
    """A new heartbeat moves the rank's deadline to its time plus the phase timeout."""
    state = beat(running(SOLO), 0, 1, NOW + 10)
    assert next_deadline(state) == NOW + 310
    state = beat(state, 0, 2, NOW + 200)
    assert next_deadline(state) == NOW + 500
    assert decide(state, Tick(), NOW + 310) == (state, [])


def test_heartbeat_same_seq_does_not_reset_deadline():
    """A heartbeat with an already-seen sequence number leaves the deadline where it was."""
    state = beat(running(SOLO), 0, 1, NOW + 10)
    again, _ = decide(state, HeartbeatSeen(0, 0, seq=1, step=10, phase="train"), NOW + 200)
    assert next_deadline(again) == NOW + 310


# ---- calibration ------------------------------------------------------------------------------


def test_gap_recorded_between_consecutive_train_beats():
    """Consecutive `train` heartbeats of a rank record the seconds between them."""
    state = train_beats(running(SOLO), [NOW, NOW + 2, NOW + 5])
    assert state.step_gaps == (2.0, 3.0)


def test_no_gap_recorded_across_other_phases():
    """Gaps are recorded only between consecutive `train` beats: not train->save, save->train or launch->train."""
    state = beat(running(SOLO), 0, 1, NOW + 1)
    state = beat(state, 0, 2, NOW + 2, phase="save")
    state = beat(state, 0, 3, NOW + 60)
    assert state.step_gaps == ()
    state = beat(state, 0, 4, NOW + 61)
    assert state.step_gaps == (1.0,)


def test_gaps_measured_per_rank_and_pooled():
    """Each rank's gap is measured from its own previous beat, and all ranks' gaps go into one pool."""
    state = beat(running(), 0, 1, NOW)
    state = beat(state, 1, 1, NOW + 1)
    state = beat(state, 0, 2, NOW + 2)
    state = beat(state, 1, 2, NOW + 4)
    assert state.step_gaps == (2.0, 3.0)


def test_gaps_keep_only_the_calibration_window():
    """Only the newest `window` gaps are kept."""
    state = train_beats(running(calibrating(window=2)), [NOW, NOW + 1, NOW + 3, NOW + 6])
    assert state.step_gaps == (2.0, 3.0)


def test_configured_train_timeout_until_min_samples():
    """With fewer than min_samples gaps, the configured `train` timeout applies."""
    state = train_beats(running(calibrating()), [NOW, NOW + 5, NOW + 10])
    assert state.step_gaps == (5.0, 5.0)
    assert rank_deadline(state, state.ranks[0]) == NOW + 10 + 300


def test_calibrated_train_timeout_replaces_configured_after_min_samples():
    """Once min_samples gaps are seen, the `train` timeout is multiplier * p99 of the gaps."""
    state = train_beats(running(calibrating()), [NOW, NOW + 5, NOW + 10, NOW + 15])
    assert rank_deadline(state, state.ranks[0]) == NOW + 15 + 50
    assert decide(state, Tick(), NOW + 64.999) == (state, [])
    state, _ = decide(state, Tick(), NOW + 65)
    assert state.hang == Hang(attempt=0, rank=0, phase="train", step=4, silent_s=50.0, timeout_s=50.0)


def test_calibration_off_keeps_configured_train_timeout():
    """With calibration disabled, gaps are still recorded but the configured `train` timeout applies."""
    state = train_beats(running(SOLO), [NOW, NOW + 5, NOW + 10, NOW + 15])
    assert state.step_gaps == (5.0, 5.0, 5.0)
    assert rank_deadline(state, state.ranks[0]) == NOW + 15 + 300


def test_calibration_does_not_shorten_save_timeout():
    """The calibrated timeout applies to `train` only; a `save` beat keeps the `save` timeout."""
    state = train_beats(running(calibrating()), [NOW, NOW + 5, NOW + 10, NOW + 15])
    state = beat(state, 0, 5, NOW + 16, phase="save")
    assert rank_deadline(state, state.ranks[0]) == NOW + 16 + 1800


def test_fast_step_calibrates_to_floor_not_hair_trigger():
    """A 0.2 s step calibrates to the 30 s floor, not to 10 * 0.2 = 2 s."""
    times = [NOW + 0.2 * i for i in range(5)]
    state = train_beats(running(calibrating()), times)
    last = times[-1]
    assert rank_deadline(state, state.ranks[0]) == last + 30.0
    assert decide(state, Tick(), last + 29.999) == (state, [])
    state, _ = decide(state, Tick(), last + 30.0)
    assert (state.hang.rank, state.hang.timeout_s) == (0, 30.0)


def test_step_gaps_survive_relaunch():
    """Gaps learned in one attempt are kept across a relaunch and calibrate the next attempt's timeout."""
    state = train_beats(running(calibrating()), [NOW, NOW + 5, NOW + 10, NOW + 15])
    state, _ = decide(state, ChildExited(0, 0, 1), NOW + 16)
    state, _ = decide(state, RanksLaunched(1, (200,), 4), NOW + 17)
    assert state.step_gaps == (5.0, 5.0, 5.0)
    state = beat(state, 0, 1, NOW + 20)
    assert state.step_gaps == (5.0, 5.0, 5.0)
    assert rank_deadline(state, state.ranks[0]) == NOW + 20 + 50


def test_initial_state_carries_step_gaps():
    """`initial_state` takes gaps learned by an earlier supervisor, and they calibrate at once."""
    state = initial_state(calibrating(), step_gaps=(4.0, 4.0, 4.0))
    assert state.step_gaps == (4.0, 4.0, 4.0)
    state, _ = decide(state, RanksLaunched(0, (100,), None), NOW)
    state = beat(state, 0, 1, NOW + 1)
    assert rank_deadline(state, state.ranks[0]) == NOW + 1 + 40


# ---- stack collection after a hang ------------------------------------------------------------


def test_stacks_collected_moves_to_term_with_sigterm():
    """`StacksCollected` stores the dump paths in the hang and SIGTERMs the attempt with the grace deadline."""
    state, actions = decide(hung(), StacksCollected(0, STACKS), HUNG_AT + 3)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.TERM, Then.RELAUNCH)
    assert state.deadline == HUNG_AT + 3 + 10.0
    assert state.hang == replace(HUNG, stacks=STACKS)
    assert shape(actions) == ["stacks_collected", "hang_detected", SignalRanks(0, signal.SIGTERM)]
    assert dict(record(actions, "stacks_collected").fields) == {
        "attempt": 0,
        "paths": list(STACKS),
        "culprit": None,
        "last_steps": {},
    }


def test_stacks_showing_ranks_blocked_behind_the_culprit_sigkill_them_at_once_and_sigterm_the_culprit():
    """Ranks the stacks show inside a collective, waiting for the culprit, cannot act on SIGTERM: SIGKILL now."""
    state, actions = decide(hung(), StacksCollected(0, STACKS, culprit=1, blocked=(0,)), HUNG_AT + 3)
    assert (state.stop_stage, state.deadline) == (StopStage.TERM, HUNG_AT + 3 + 10.0)
    assert shape(actions) == [
        "stacks_collected",
        "hang_detected",
        "ranks_killed_at_once",
        SignalRanks(0, signal.SIGKILL, (0,)),
        SignalRanks(0, signal.SIGTERM, (1,)),
    ]
    assert dict(record(actions, "ranks_killed_at_once").fields) == {
        "ranks": [0],
        "attempt": 0,
        "why": "blocked in a collective waiting for rank 1",
    }


def test_a_lost_node_sigkills_the_other_ranks_at_once_but_lets_a_save_in_flight_finish():
    """A node's ranks lost: every other rank waits in a collective for them forever (SIGKILL now), except one inside
    a save, which is SIGTERMed and given its save timeout as after any crash."""
    state = beat(beat(running(replace(POLICY, nproc=3)), 1, 1, NOW, phase="save"), 2, 1, NOW)
    lost = Cause(CauseKind.NODE_LOST, "node n2 lost: silent")
    state, actions = decide(state, ChildExited(0, 0, -signal.SIGKILL, cause=lost, node="n2", lost_with=(0,)), NOW + 1)
    assert shape(actions)[-4:] == [
        "ranks_killed_at_once",
        SignalRanks(0, signal.SIGKILL, (2,)),
        SignalRanks(0, signal.SIGTERM, (1,)),
        "stop_waits_for_save",
    ]
    assert dict(record(actions, "ranks_killed_at_once").fields)["why"] == "blocked in a collective with a lost node"


def test_a_crashed_rank_sigterms_its_peers_with_the_grace():
    """An ordinary crash kills nobody at once: the peers' collectives fail on the closed connection and they exit."""
    _, actions = decide(running(), ChildExited(0, 1, -signal.SIGSEGV), NOW + 1)
    assert shape(actions)[-1] == SignalRanks(0, signal.SIGTERM) and "ranks_killed_at_once" not in shape(actions)


def test_stacks_naming_a_culprit_rename_the_hung_rank():
    """When the stacks show one rank outside every collective, the hang names it, with its phase and timeout."""
    state = beat(beat(running(), 0, 1, NOW, step=30), 1, 1, NOW + 2, phase="save", step=30)
    state, _ = decide(state, Tick(), NOW + 1802)
    assert state.hang.rank == 0  # silent first, by heartbeats
    state, _ = decide(state, StacksCollected(0, STACKS, culprit=1, last_steps=((0, 35), (1, 35))), NOW + 1803)
    assert state.hang == Hang(
        attempt=0, rank=1, phase="save", step=35, silent_s=1802.0, timeout_s=1800.0, stacks=STACKS, named_by="stacks"
    )


def test_stacks_last_steps_correct_the_hung_rank_step():
    """The event log's newest step replaces the throttled heartbeat's step in the hang."""
    state, _ = decide(hung(), StacksCollected(0, STACKS, last_steps=((0, 17), (1, 18))), HUNG_AT + 3)
    assert state.hang == replace(HUNG, stacks=STACKS, step=17)


def test_stacks_tick_before_deadline_does_nothing():
    """A tick before the stack-collection deadline changes nothing."""
    state = hung()
    assert decide(state, Tick(), HUNG_AT + 14.999) == (state, [])


def test_stacks_deadline_moves_to_term_with_stacks_timed_out():
    """At the stack-collection deadline the attempt is SIGTERMed anyway, with a warning naming the live ranks."""
    state, actions = decide(hung(), Tick(), HUNG_AT + 15)
    assert (state.phase, state.stop_stage) == (Phase.STOPPING, StopStage.TERM)
    assert state.deadline == HUNG_AT + 15 + 10.0
    assert state.hang.stacks == ()
    assert shape(actions) == ["stacks_timed_out", "hang_detected", SignalRanks(0, signal.SIGTERM)]
    timed_out = record(actions, "stacks_timed_out")
    assert timed_out.level == "warning"
    assert dict(timed_out.fields) == {"ranks": [0, 1]}


def test_term_deadline_after_stacks_sends_sigkill():
    """After the stacks stage, the grace deadline escalates to SIGKILL as in any stop."""
    state, _ = decide(hung(), StacksCollected(0, STACKS), HUNG_AT + 3)
    state, actions = decide(state, Tick(), HUNG_AT + 13)
    assert (state.stop_stage, state.deadline) == (StopStage.KILL, HUNG_AT + 13 + 5.0)
    assert shape(actions) == ["stop_grace_expired", SignalRanks(0, signal.SIGKILL)]


def test_stacks_collected_of_old_attempt_ignored():
    """`StacksCollected` for an attempt other than the current one changes nothing."""
    state = hung(restarts=1)
    assert decide(state, StacksCollected(0, STACKS), HUNG_AT + 1) == (state, [])


def test_stacks_collected_outside_stacks_stage_ignored():
    """`StacksCollected` while RUNNING or in the TERM stage of a crash stop changes nothing."""
    for state in (running(), stopping_for_crash()):
        assert decide(state, StacksCollected(0, STACKS), NOW + 1) == (state, [])


def test_hang_relaunches_after_ranks_down():
    """A hung attempt with restarts left relaunches once its ranks are down."""
    state, _ = decide(hung(), StacksCollected(0, STACKS), HUNG_AT + 1)
    state, _ = decide(state, ChildExited(0, 0, -15), HUNG_AT + 2)
    state, actions = decide(state, ChildExited(0, 1, -15), HUNG_AT + 3)
    assert (state.phase, state.attempt, state.restarts, state.stop_stage) == (Phase.STARTING, 1, 1, None)
    assert state.hang.stacks == STACKS
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "relaunch_scheduled", LaunchRanks(1)]


def test_ranks_down_during_stacks_stage_complete_the_stop_once_the_evidence_is_in():
    """Ranks all going down while the evidence is collected (their flight recorders may name the culprit) complete
    the stop when it is in, or at the stacks deadline."""
    state, _ = decide(hung(), ChildExited(0, 0, -6), HUNG_AT + 1)
    assert state.stop_stage is StopStage.STACKS
    state, actions = decide(state, ChildExited(0, 1, -6), HUNG_AT + 2)
    assert (state.phase, state.stop_stage, shape(actions)) == (Phase.STOPPING, StopStage.STACKS, ["rank_stopped"])
    collected, _ = decide(state, StacksCollected(0, STACKS, culprit=1), HUNG_AT + 3)
    timed_out, actions = decide(state, Tick(), HUNG_AT + 15)
    for state in (collected, timed_out):
        assert (state.phase, state.attempt, state.stop_stage) == (Phase.STARTING, 1, None)
    assert collected.hang.rank == 1 and timed_out.hang.rank == 0
    assert shape(actions) == [
        "stacks_timed_out",
        "hang_detected",
        KillLeftovers(0),
        "relaunch_scheduled",
        LaunchRanks(1),
    ]


def test_hang_with_restarts_exhausted_fails_after_ranks_down():
    """A hang with no restarts left records the exhaustion, still collects stacks, and FAILs once ranks are down."""
    state, actions = decide(silent(restarts=3), Tick(), HUNG_AT)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.STACKS, Then.FAIL)
    assert shape(actions) == [
        "hang_suspected",
        "restarts_exhausted",
        DumpStacks(3, ranks=(0, 1), faulthandler_ranks=(0, 1)),
    ]
    assert dict(record(actions, "restarts_exhausted").fields) == {"restarts": 3, "max_restarts": 3}
    state, _ = decide(state, StacksCollected(3, STACKS), HUNG_AT + 1)
    state, _ = decide(state, ChildExited(3, 0, -15), HUNG_AT + 2)
    state, actions = decide(state, ChildExited(3, 1, -15), HUNG_AT + 3)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 1
    assert state.reason == (
        "rank 0 hung in phase train (last heartbeat at step 10): "
        "no heartbeat for 305.0 s (timeout 300 s) in attempt 3; restarts exhausted (3/3)"
    )
    assert shape(actions) == ["rank_stopped", KillLeftovers(3)]


def test_first_sigint_during_stacks_stage_keeps_collecting():
    """A first SIGINT during stack collection turns the relaunch into a stop but lets the stacks finish."""
    state = hung()
    state, actions = decide(state, SignalReceived(signal.SIGINT), HUNG_AT + 1)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.STACKS, Then.STOP)
    assert state.deadline == HUNG_AT + 15
    assert shape(actions) == ["signal_received"]


def test_second_sigint_during_stacks_stage_kills_at_once():
    """A second SIGINT during stack collection SIGKILLs at once; stacks arriving later are ignored."""
    state, _ = decide(hung(), SignalReceived(signal.SIGINT), HUNG_AT + 1)
    state, actions = decide(state, SignalReceived(signal.SIGINT), HUNG_AT + 2)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.KILL, Then.STOP)
    assert state.deadline == HUNG_AT + 2 + 5.0
    assert shape(actions) == ["signal_received", SignalRanks(0, signal.SIGKILL)]
    assert decide(state, StacksCollected(0, STACKS), HUNG_AT + 3) == (state, [])


# ---- next deadline ----------------------------------------------------------------------------


def test_next_deadline_none_when_nothing_pending():
    """With no phase deadline and no rank expected to beat, there is no next deadline."""
    assert next_deadline(initial_state(POLICY)) is None
    assert next_deadline(running()) is None


def test_hang_deadline_is_latest_rank_deadline():
    """While RUNNING, the job's hang deadline is the latest of the ranks' heartbeat deadlines, and the next one."""
    state = beat(beat(running(), 0, 1, NOW + 10), 1, 1, NOW + 5, phase="save")
    assert [rank_deadline(state, r) for r in state.ranks] == [NOW + 310, NOW + 1805]
    assert hang_deadline(state) == NOW + 1805
    assert next_deadline(state) == NOW + 1805


def test_hang_deadline_none_without_rank_deadlines():
    """With no rank expected to beat, or outside RUNNING, there is no hang deadline."""
    assert hang_deadline(running()) is None
    assert hang_deadline(hung()) is None


def test_next_deadline_is_earliest_of_phase_and_hang_deadlines():
    """The next deadline is the phase deadline when it comes first, else the hang deadline."""
    state = silent()
    assert next_deadline(replace(state, deadline=NOW + 50)) == NOW + 50
    assert next_deadline(replace(state, deadline=NOW + 500)) == HUNG_AT


def test_next_deadline_while_stopping_is_the_stop_deadline():
    """While STOPPING, ranks have no heartbeat deadline and the next deadline is the stage's."""
    state = hung()
    assert [rank_deadline(state, r) for r in state.ranks] == [None, None]
    assert next_deadline(state) == HUNG_AT + 15
    assert next_deadline(stopping_for_crash()) == NOW + 10
    assert next_deadline(backoff()) == NOW + 1.0


# ---- terminal phases and exit codes -----------------------------------------------------------


@pytest.mark.parametrize("phase", [Phase.FINISHED, Phase.STOPPED, Phase.FAILED])
def test_terminal_state_ignores_events(phase):
    """Once terminal, every event leaves the state unchanged and produces no action."""
    state = replace(running(), phase=phase, deadline=NOW)
    events = [
        Started(),
        RanksLaunched(0, PIDS, None),
        LaunchFailed(0, "x"),
        ChildExited(0, 0, 1),
        HeartbeatSeen(0, 0, 1, 1, "train"),
        StacksCollected(0, ("stacks-0.txt",)),
        SignalReceived(signal.SIGINT),
        Tick(),
    ]
    for event in events:
        assert decide(state, event, NOW + 100) == (state, [])


@pytest.mark.parametrize(
    ("phase", "code"),
    [
        (Phase.FINISHED, 0),
        (Phase.STOPPED, 0),
        (Phase.FAILED, 1),
        (Phase.STARTING, None),
        (Phase.RUNNING, None),
        (Phase.STOPPING, None),
        (Phase.BACKOFF, None),
    ],
)
def test_exit_code_per_phase(phase, code):
    """FINISHED and STOPPED exit 0, FAILED exits 1, and a non-terminal phase has no exit code."""
    assert replace(initial_state(POLICY), phase=phase).exit_code == code


def test_only_finished_stopped_failed_are_terminal():
    """Exactly FINISHED, STOPPED and FAILED are terminal phases."""
    assert {p for p in Phase if p.terminal} == {Phase.FINISHED, Phase.STOPPED, Phase.FAILED}


@pytest.mark.parametrize(
    ("returncode", "text"),
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (65, "exited with code 65"),
        (-9, "killed by SIGKILL"),
        (-15, "killed by SIGTERM"),
        (-2, "killed by SIGINT"),
        (-99, "killed by signal 99"),
    ],
)
def test_describe_exit(returncode, text):
    """Exit codes read as 'exited with code N', negative codes as the killing signal's name or number."""
    assert describe_exit(returncode) == text


# ---- a save in flight when ranks are stopped (issue 5) ----


def test_peer_crash_during_save_waits_for_the_save_timeout_before_sigkill():
    """Rank 0 began saving 100 s ago (save timeout 1800 s) when rank 1 crashed: SIGTERM now, SIGKILL only after
    the save had its whole timeout, and the wait is journaled."""
    state = beat(running(), 0, 1, NOW - 100, phase="save")
    state, actions = decide(state, ChildExited(0, 1, 3), NOW)
    assert (state.stop_stage, state.deadline) == (StopStage.TERM, NOW - 100 + 1800)
    assert shape(actions) == ["rank_crashed", SignalRanks(0, signal.SIGTERM), "stop_waits_for_save"]
    assert dict(record(actions, "stop_waits_for_save").fields) == {"ranks": [0], "wait_s": 1700.0}
    assert decide(state, Tick(), NOW + 1699.999) == (state, [])
    state, actions = decide(state, Tick(), NOW + 1700)
    assert actions[-1] == SignalRanks(0, signal.SIGKILL)


def test_save_past_its_timeout_gets_only_the_kill_grace():
    """A save already past its timeout (it hung) is not waited for: the usual grace applies."""
    state = beat(running(), 0, 1, NOW - 1900, phase="save")
    state, actions = decide(state, ChildExited(0, 1, 3), NOW)
    assert state.deadline == NOW + 10.0
    assert shape(actions) == ["rank_crashed", SignalRanks(0, signal.SIGTERM)]


def test_save_heartbeat_seen_after_sigterm_extends_the_grace():
    """The save began just before the crash but its heartbeat is read after the SIGTERM: the deadline moves."""
    state, _ = decide(running(), ChildExited(0, 1, 3), NOW)
    assert state.deadline == NOW + 10.0
    state = beat(state, 0, 1, NOW + 1, phase="save")
    assert state.deadline == NOW + 1 + 1800
    state = beat(state, 0, 2, NOW + 5, phase="train")  # the save ended: the deadline stays (the rank exits now)
    assert state.deadline == NOW + 1 + 1800


def test_rank_config_error_fails_the_run_with_exit_78_without_relaunch():
    """A rank exiting EXIT_CONFIG stops its peers and fails the run with 78: relaunching cannot help."""
    state, actions = decide(running(), ChildExited(0, 1, 78), NOW)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.FAIL)
    assert shape(actions) == ["rank_config_error", SignalRanks(0, signal.SIGTERM)]
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 1)
    assert (state.phase, state.exit_code) == (Phase.FAILED, 78)
    assert state.reason == (
        "rank 1 exited with code 78 (its configuration is invalid) in attempt 0; relaunching cannot help"
    )


@pytest.mark.parametrize("seed", range(30))
def test_hang_deadline_is_the_latest_rank_deadline(seed: int) -> None:
    """The hang deadline (worked out from the newest beat per phase, for speed at thousands of ranks) is exactly
    the latest deadline of any running rank, whatever the mix of phases, silent, exited and calibrated ranks."""
    import random

    rng = random.Random(seed)
    policy = replace(POLICY, nproc=12, hang=replace(POLICY.hang, heartbeat=rng.choice(["auto", "required"])))
    state = running(policy)
    ranks = []
    for rank in state.ranks:
        beat = rng.choice([None, NOW + rng.uniform(0, 100)])
        phase = None if beat is None and rng.random() < 0.7 else rng.choice(["train", "save", "eval", "custom"])
        ranks.append(
            replace(rank, heartbeat_monotonic=beat, heartbeat_phase=phase, returncode=0 if rng.random() < 0.2 else None)
        )
    gaps = tuple(rng.uniform(0.1, 2.0) for _ in range(rng.choice([0, 50])))
    state = replace(state, ranks=tuple(ranks), heartbeats_seen=rng.random() < 0.5, step_gaps=gaps)
    each = [d for r in state.ranks if (d := rank_deadline(state, r)) is not None]
    assert hang_deadline(state) == (max(each) if each else None)
