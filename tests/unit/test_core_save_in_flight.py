"""The decision core when a stop meets a checkpoint save in flight: wait for it, or say it was lost."""

from __future__ import annotations

import signal

from supervisor.core import (
    ChildExited,
    HeartbeatSeen,
    KillLeftovers,
    Phase,
    SignalRanks,
    SignalReceived,
    State,
    StopStage,
    Then,
    Tick,
    decide,
)
from supervisor.observe.notify import status_line
from tests.unit.test_core import NOW, POLICY, record, running, shape
from tests.unit.test_core_stop import training
from worker.contract import EXIT_SAVE_LOST

SAVE_TIMEOUT_S = POLICY.hang.phase_timeouts_s["save"]
SAVE_SEEN = NOW + 0.5  # when the supervisor saw rank 0 enter its save


def saving_rank_0(state: State, step: int = 40) -> State:
    """`state` after rank 0's newest heartbeat, seen at SAVE_SEEN, says it is saving `step`."""
    state, _ = decide(state, HeartbeatSeen(state.attempt, 0, seq=9, step=step, phase="save"), SAVE_SEEN)
    return state


def interrupted_twice_while_saving() -> State:
    """RUNNING with a graceful stop ordered by Ctrl-C, rank 0 saving, then a second Ctrl-C."""
    state, _ = decide(training(), SignalReceived(signal.SIGINT), NOW)
    state, _ = decide(saving_rank_0(state), SignalReceived(signal.SIGINT), NOW + 1)
    return state


def test_second_sigint_while_a_rank_saves_sigterms_and_waits_for_the_save():
    """The second Ctrl-C SIGTERMs every rank but sends no SIGKILL: the save gets its save timeout, and one
    warning says so and how to abandon it."""
    state, _ = decide(training(), SignalReceived(signal.SIGINT), NOW)
    state, actions = decide(saving_rank_0(state), SignalReceived(signal.SIGINT), NOW + 1)
    assert (state.phase, state.then, state.stop_stage) == (Phase.STOPPING, Then.STOP, StopStage.TERM)
    assert state.deadline == SAVE_SEEN + SAVE_TIMEOUT_S
    assert shape(actions) == [
        "signal_received",
        SignalRanks(0, signal.SIGTERM),
        "stop_waits_for_save",
        "save_in_flight",
    ]
    warning = record(actions, "save_in_flight")
    assert warning.level == "warning"
    wait_s = round(SAVE_SEEN + SAVE_TIMEOUT_S - (NOW + 1), 3)
    assert dict(warning.fields) == {
        "ranks": [0],
        "steps": [40],
        "wait_s": wait_s,
        "message": "saving, press Ctrl-C again to abandon the save",
    }


def test_a_save_finished_after_the_second_sigint_ends_a_clean_stop():
    """The saver beats `train` (its save is complete), then dies of the held SIGTERM: stopped, exit 0."""
    state = interrupted_twice_while_saving()
    state, _ = decide(state, HeartbeatSeen(0, 0, seq=10, step=40, phase="train"), NOW + 3)
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 3)
    state, actions = decide(state, ChildExited(0, 0, -signal.SIGTERM), NOW + 4)
    assert (state.phase, state.exit_code, state.reason) == (Phase.STOPPED, 0, "stopped on request")
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "run_stopped"]


def test_third_sigint_abandons_the_save_and_the_stop_says_it_was_lost():
    """A third Ctrl-C SIGKILLs at once; the saver's death inside its save ends the run stopped with
    EXIT_SAVE_LOST and a reason naming the rank and step, never a clean exit 0."""
    state = interrupted_twice_while_saving()
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 2)
    assert (state.stop_stage, shape(actions)) == (StopStage.KILL, ["signal_received", SignalRanks(0, signal.SIGKILL)])
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 2)
    state, actions = decide(state, ChildExited(0, 0, -signal.SIGKILL), NOW + 2)
    assert (state.phase, state.exit_code, state.saves_lost) == (Phase.STOPPED, EXIT_SAVE_LOST, ((0, 40),))
    assert state.reason == (
        "stopped on request, but the checkpoint save in flight was lost: rank 0 (step 40) went "
        "down inside it; the newest complete checkpoint is older"
    )
    assert shape(actions) == ["rank_stopped", KillLeftovers(0), "save_lost", "run_stopped"]
    lost = record(actions, "save_lost")
    assert (lost.level, dict(lost.fields)) == ("error", {"attempt": 0, "ranks": [0], "steps": [40]})


def test_save_timeout_passing_after_the_second_sigint_kills_and_loses_the_save():
    """The wait is bounded: at the save timeout the saver is SIGKILLed, and the stop exits EXIT_SAVE_LOST."""
    state = interrupted_twice_while_saving()
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 1)
    state, actions = decide(state, Tick(), state.deadline)
    assert shape(actions) == ["stop_grace_expired", SignalRanks(0, signal.SIGKILL)]
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGKILL), SAVE_SEEN + SAVE_TIMEOUT_S)
    assert (state.phase, state.exit_code) == (Phase.STOPPED, EXIT_SAVE_LOST)


def test_second_sigint_while_stopping_for_a_crash_waits_for_a_save_and_the_third_kills():
    """Stopping after a crash with rank 1 saving: Ctrl-C turns the relaunch into a stop, the second one only
    warns, the third SIGKILLs."""
    state, _ = decide(running(), HeartbeatSeen(0, 1, seq=1, step=40, phase="save"), NOW)
    state, _ = decide(state, ChildExited(0, 0, 3), NOW)
    state, _ = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 2)
    assert (state.then, state.stop_stage, shape(actions)) == (
        Then.STOP,
        StopStage.TERM,
        ["signal_received", "save_in_flight"],
    )
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 3)
    assert shape(actions) == ["signal_received", SignalRanks(0, signal.SIGKILL)]


def test_crash_inside_the_stop_orders_save_is_a_lost_save():
    """A rank dying inside the save a stop order asked for: the run ends stopped, but with EXIT_SAVE_LOST."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    state, _ = decide(saving_rank_0(state, step=57), ChildExited(0, 0, -signal.SIGKILL), NOW + 1)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.STOP)
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGTERM), NOW + 2)
    assert (state.phase, state.exit_code, state.saves_lost) == (Phase.STOPPED, EXIT_SAVE_LOST, ((0, 57),))


def test_a_save_lost_to_a_crash_is_the_relaunchs_to_make_good():
    """A crash inside a save relaunches as usual, and a stop requested during the backoff is a clean one."""
    state, _ = decide(running(restarts=1), HeartbeatSeen(1, 0, seq=1, step=40, phase="save"), NOW)
    state, _ = decide(state, ChildExited(1, 0, -signal.SIGKILL), NOW + 1)
    state, _ = decide(state, ChildExited(1, 1, -signal.SIGTERM), NOW + 2)
    assert (state.phase, state.saves_lost) == (Phase.BACKOFF, ())
    state, _ = decide(state, SignalReceived(signal.SIGTERM), NOW + 3)
    assert (state.phase, state.exit_code) == (Phase.STOPPED, 0)


def test_systemd_status_line_of_a_stop_that_lost_a_save_says_so():
    """`systemctl status` shows the lost save (the run's reason), never a clean "stopped on request"."""
    state, _ = decide(interrupted_twice_while_saving(), SignalReceived(signal.SIGINT), NOW + 2)
    state, _ = decide(state, ChildExited(0, 1, -signal.SIGKILL), NOW + 2)
    state, _ = decide(state, ChildExited(0, 0, -signal.SIGKILL), NOW + 2)
    assert status_line(state) == state.reason
    assert status_line(state).startswith("stopped on request, but the checkpoint save in flight was lost: rank 0")
