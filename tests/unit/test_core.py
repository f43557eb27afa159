"""The pure decision core: one test per phase transition or edge, with a fake clock."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.core import (
    Action,
    ChildExited,
    HeartbeatSeen,
    LaunchFailed,
    LaunchRanks,
    Phase,
    Policy,
    RanksLaunched,
    RankState,
    Record,
    SignalRanks,
    SignalReceived,
    Started,
    State,
    Then,
    Tick,
    decide,
    describe_exit,
    initial_state,
)

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
    assert dict(actions[0].fields) == {"attempt": 0, "pids": [100, 101], "resume_step": 25}


def test_ranks_launched_of_other_attempt_ignored():
    """`RanksLaunched` for an attempt other than the current one changes nothing."""
    state = initial_state(POLICY)
    assert decide(state, RanksLaunched(1, PIDS, None), NOW) == (state, [])


def test_ranks_launched_while_running_ignored():
    """A repeated `RanksLaunched` while RUNNING changes nothing."""
    state = running()
    assert decide(state, RanksLaunched(0, (200, 201), None), NOW) == (state, [])


def test_launch_failed_fails():
    """`LaunchFailed` ends the run FAILED with the launch error as the reason."""
    state, actions = decide(initial_state(POLICY), LaunchFailed(0, "No such file: train.py"), NOW)
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
    assert state.reason == "stopped on request"
    assert shape(actions) == ["signal_received", "run_stopped"]


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
    assert state.sigkill_sent is False
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
    assert shape(actions) == ["rank_crashed", "relaunch_scheduled", LaunchRanks(1)]


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
    assert state.ranks[1] == RankState(1, pid=101, step=42, heartbeat_seq=7, heartbeat_monotonic=NOW + 2,
                                       heartbeat_phase="train")
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
    assert shape(actions) == ["rank_stopped", "relaunch_scheduled", LaunchRanks(1)]
    assert dict(record(actions, "relaunch_scheduled").fields) == {"attempt": 1, "backoff_s": 0.0}


def test_later_relaunch_enters_backoff():
    """After a restart was already done, the last rank going down waits in BACKOFF for the first delay."""
    state, actions = decide(stopping_for_crash(restarts=1), ChildExited(1, 1, -15), NOW + 1)
    assert state.phase is Phase.BACKOFF
    assert (state.attempt, state.restarts) == (1, 1)
    assert state.deadline == NOW + 1 + 1.0
    assert shape(actions) == ["rank_stopped", "relaunch_scheduled"]
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
    assert shape(actions) == ["ranks_launched"]


def test_backoff_grows_exponentially_to_cap():
    """The relaunch delay is 0 for the first restart, then initial * factor**(n-1), capped at the maximum."""
    assert [POLICY.backoff_s(n) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


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
    assert shape(actions) == ["rank_stopped"]


def test_no_restarts_allowed_single_rank_crash_fails_at_once():
    """With max_restarts 0 and one rank, a crash fails the run immediately with nothing to stop."""
    policy = replace(POLICY, nproc=1, max_restarts=0)
    state, actions = decide(running(policy), ChildExited(0, 0, 1), NOW)
    assert state.phase is Phase.FAILED
    assert state.reason == "rank 0 exited with code 1 in attempt 0; restarts exhausted (0/0)"
    assert shape(actions) == ["rank_crashed", "restarts_exhausted"]


# ---- stop deadlines ---------------------------------------------------------------------------


def test_stopping_tick_before_deadline_does_nothing():
    """A tick before the grace deadline changes nothing."""
    state = stopping_for_crash()
    assert decide(state, Tick(), NOW + 9.999) == (state, [])


def test_stopping_deadline_sends_sigkill():
    """At the grace deadline the surviving ranks get SIGKILL and a second, shorter deadline starts."""
    state, actions = decide(stopping_for_crash(), Tick(), NOW + 10.0)
    assert state.phase is Phase.STOPPING
    assert state.sigkill_sent is True
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
    assert shape(actions) == ["rank_stopped", "relaunch_scheduled", LaunchRanks(1)]


def test_stopping_second_deadline_fails_unkillable():
    """A rank still running at the deadline after SIGKILL fails the run rather than relaunching over it."""
    state, _ = decide(stopping_for_crash(), Tick(), NOW + 10.0)
    state, actions = decide(state, Tick(), NOW + 15.0)
    assert state.phase is Phase.FAILED
    assert state.deadline is None
    assert state.reason.startswith("rank 1 (pid 101) survived SIGKILL for 5 s; ")
    assert shape(actions) == ["rank_unkillable"]
    assert actions[0].level == "error"
    assert dict(actions[0].fields) == {"ranks": ["rank 1 (pid 101)"]}


# ---- signals ----------------------------------------------------------------------------------


def test_signal_while_running_stops_ranks():
    """A signal while RUNNING SIGTERMs every rank and starts the grace deadline."""
    state, actions = decide(running(), SignalReceived(signal.SIGTERM), NOW)
    assert state.phase is Phase.STOPPING
    assert state.deadline == NOW + 10.0
    assert state.sigkill_sent is False
    assert shape(actions) == ["signal_received", SignalRanks(0, signal.SIGTERM)]
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
    assert shape(actions) == ["rank_stopped", "run_stopped"]


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
    assert state.sigkill_sent is False
    assert state.deadline == NOW + 10.0
    assert shape(actions) == ["signal_received"]


def test_second_sigint_while_stopping_kills_now():
    """A second SIGINT while STOPPING SIGKILLs the ranks at once and starts the SIGKILL deadline."""
    state, _ = decide(running(), SignalReceived(signal.SIGINT), NOW)
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    assert state.phase is Phase.STOPPING
    assert state.sigkill_sent is True
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
    assert (state.phase, state.then, state.sigkill_sent) == (Phase.STOPPING, Then.STOP, False)
    assert shape(actions) == ["signal_received"]


def test_signal_in_backoff_stops_at_once():
    """A signal during BACKOFF ends the run STOPPED without launching anything."""
    state, actions = decide(backoff(), SignalReceived(signal.SIGTERM), NOW + 0.5)
    assert state.phase is Phase.STOPPED
    assert state.deadline is None
    assert state.attempt == 1
    assert state.reason == "stopped on request"
    assert shape(actions) == ["signal_received", "run_stopped"]


def test_signal_while_stopping_after_restarts_exhausted_still_fails():
    """A stop signal arriving while a run with exhausted restarts is going down still ends it FAILED."""
    state, _ = decide(running(restarts=3), ChildExited(3, 0, 3), NOW)
    state, _ = decide(state, SignalReceived(signal.SIGTERM), NOW + 1)
    state, _ = decide(state, ChildExited(3, 1, -15), NOW + 2)
    assert state.phase is Phase.FAILED
    assert state.exit_code == 1


# ---- terminal phases and exit codes -----------------------------------------------------------


@pytest.mark.parametrize("phase", [Phase.FINISHED, Phase.STOPPED, Phase.FAILED])
def test_terminal_state_ignores_events(phase):
    """Once terminal, every event leaves the state unchanged and produces no action."""
    state = replace(running(), phase=phase, deadline=NOW)
    events = [Started(), RanksLaunched(0, PIDS, None), LaunchFailed(0, "x"), ChildExited(0, 0, 1),
              HeartbeatSeen(0, 0, 1, 1, "train"), SignalReceived(signal.SIGINT), Tick()]
    for event in events:
        assert decide(state, event, NOW + 100) == (state, [])


@pytest.mark.parametrize(
    ("phase", "code"),
    [(Phase.FINISHED, 0), (Phase.STOPPED, 0), (Phase.FAILED, 1),
     (Phase.STARTING, None), (Phase.RUNNING, None), (Phase.STOPPING, None), (Phase.BACKOFF, None)],
)
def test_exit_code_per_phase(phase, code):
    """FINISHED and STOPPED exit 0, FAILED exits 1, and a non-terminal phase has no exit code."""
    assert replace(initial_state(POLICY), phase=phase).exit_code == code


def test_only_finished_stopped_failed_are_terminal():
    """Exactly FINISHED, STOPPED and FAILED are terminal phases."""
    assert {p for p in Phase if p.terminal} == {Phase.FINISHED, Phase.STOPPED, Phase.FAILED}


@pytest.mark.parametrize(
    ("returncode", "text"),
    [(0, "exited with code 0"), (3, "exited with code 3"), (65, "exited with code 65"),
     (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (-2, "killed by SIGINT"),
     (-99, "killed by signal 99")],
)
def test_describe_exit(returncode, text):
    """Exit codes read as 'exited with code N', negative codes as the killing signal's name or number."""
    assert describe_exit(returncode) == text
