"""Graceful stops in the pure core: stop orders at an agreed step, their end, their timeout, and signals."""

from __future__ import annotations

import signal

from supervisor.core import (
    ChildExited,
    HeartbeatSeen,
    KillLeftovers,
    Phase,
    PublishStopOrder,
    SignalRanks,
    SignalReceived,
    State,
    StopRequested,
    Then,
    Tick,
    decide,
)
from supervisor.core.stop_requests import StopRequest, agreed_step
from tests.unit.test_core import NOW, POLICY, backoff, record, running, shape, stopping_for_crash
from worker.contract import StopOrder

FILE = "stop file /run/stop"


def training(at: float = NOW, step: int = 40, step_time_s: float = 0.1) -> State:
    """RUNNING, both ranks' newest train heartbeats at `at` showing `step` and `step_time_s`."""
    state = running()
    for rank in (0, 1):
        beat = HeartbeatSeen(0, rank, seq=1, step=step, phase="train", step_time_s=step_time_s)
        state, _ = decide(state, beat, at)
    return state


def test_agreed_step_extrapolates_each_rank_then_leads_by_a_second_and_two_steps():
    """Step 40 seen 0.5 s ago at 0.1 s a step: by now 45, a second later 55, so the order names step 57."""
    assert agreed_step(training().ranks, NOW + 0.5) == 57
    assert agreed_step(running().ranks, NOW) is None  # no rank reports steps


def test_signal_orders_every_rank_to_save_at_the_agreed_step_and_exit_within_the_stop_timeout():
    """SIGTERM with ranks reporting steps: still RUNNING, an exit order published, the stop timeout armed."""
    state, actions = decide(training(), SignalReceived(signal.SIGTERM), NOW + 0.5)
    assert state.phase is Phase.RUNNING
    assert (state.stop_order, state.stop_source) == (StopOrder(1, 57, True), "SIGTERM")
    assert state.deadline == NOW + 0.5 + POLICY.stop_timeout_s
    assert shape(actions) == ["signal_received", "stop_ordered", PublishStopOrder(StopOrder(1, 57, True))]


def test_stop_file_step_in_the_future_is_ordered_as_asked_without_a_timeout():
    """`500` names step 500: ordered as is; no timeout, training goes on until then."""
    state, actions = decide(training(), StopRequested(StopRequest(500, True, FILE)), NOW)
    assert state.stop_order == StopOrder(1, 500, True) and state.deadline is None
    assert dict(record(actions, "stop_ordered").fields) == {"order": 1, "step": 500, "exit": True, "source": FILE}


def test_a_step_too_early_is_warned_about_and_replaced_by_the_agreed_step():
    """`45` when ranks are about to pass it: a warning naming both steps, and the agreed step instead."""
    state, actions = decide(training(), StopRequested(StopRequest(45, False, FILE)), NOW)
    assert state.stop_order == StopOrder(1, 52, False)
    warning = record(actions, "stop_step_too_early")
    assert warning.level == "warning" and dict(warning.fields)["requested"] == 45


def test_continue_order_ends_once_every_rank_is_past_its_step():
    """A save-and-continue order is withdrawn when both ranks beat past its step, not before."""
    state, _ = decide(training(), StopRequested(StopRequest(60, False, FILE)), NOW)
    state, actions = decide(state, HeartbeatSeen(0, 0, seq=2, step=61, phase="train"), NOW + 2)
    assert actions == [] and state.stop_order is not None
    state, actions = decide(state, HeartbeatSeen(0, 1, seq=2, step=61, phase="train"), NOW + 2)
    assert state.stop_order is None
    assert shape(actions) == ["stop_order_done", PublishStopOrder(None)]


def test_ranks_exiting_after_the_order_end_the_run_stopped_with_the_step():
    """Both ranks exit 0 having carried out the order: STOPPED, exit 0, the step and checkpoint in the reason."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    state, _ = decide(state, ChildExited(0, 0, 0, stopped_at=52), NOW + 3)
    assert state.phase is Phase.RUNNING
    state, actions = decide(state, ChildExited(0, 1, 0, stopped_at=52), NOW + 3)
    assert (state.phase, state.exit_code, state.stopped_at) == (Phase.STOPPED, 0, 52)
    assert state.reason == "stopped on request (SIGTERM) at step 52, checkpoint 52 saved"
    assert shape(actions) == ["rank_finished", "run_stopped"]


def test_stop_timeout_escalates_to_sigterm_of_the_ranks():
    """Ranks that do not reach the agreed step within the stop timeout get SIGTERM, and the run ends stopped."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    assert decide(state, Tick(), state.deadline - 0.001) == (state, [])
    state, actions = decide(state, Tick(), state.deadline)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.STOP)
    assert shape(actions) == ["stop_timed_out", SignalRanks(0, signal.SIGTERM)]


def test_second_sigint_during_a_graceful_stop_kills_at_once():
    """The first Ctrl-C orders a graceful stop; the second sends SIGTERM and SIGKILL right away."""
    state, _ = decide(training(), SignalReceived(signal.SIGINT), NOW)
    state, actions = decide(state, SignalReceived(signal.SIGINT), NOW + 1)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.STOP)
    assert shape(actions)[-2:] == [SignalRanks(0, signal.SIGTERM), SignalRanks(0, signal.SIGKILL)]


def test_second_sigterm_during_a_graceful_stop_changes_nothing():
    """SIGTERM again (systemd, an impatient operator) does not reorder or escalate."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    again, actions = decide(state, SignalReceived(signal.SIGTERM), NOW + 1)
    assert again.stop_order == state.stop_order and shape(actions) == ["signal_received"]


def test_crash_during_a_graceful_stop_stops_instead_of_relaunching():
    """A rank crashing while the run is stopping on request does not bring a relaunch."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    state, _ = decide(state, ChildExited(0, 1, 1), NOW + 1)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.STOP)


def test_crash_long_before_a_far_exit_order_still_relaunches():
    """An exit order at a far step is not a stop yet: a crash before it relaunches as usual."""
    state, _ = decide(training(), StopRequested(StopRequest(5000, True, FILE)), NOW)
    state, _ = decide(state, ChildExited(0, 1, 1), NOW + 1)
    assert (state.phase, state.then) == (Phase.STOPPING, Then.RELAUNCH)


def test_requests_without_running_ranks():
    """In backoff an exit request ends the run stopped; a continue request is dropped with a warning."""
    state = backoff()
    dropped, actions = decide(state, StopRequested(StopRequest(70, False, FILE)), NOW)
    assert dropped == state and record(actions, "stop_request_dropped").level == "warning"
    stopped, actions = decide(state, StopRequested(StopRequest(None, True, FILE)), NOW)
    assert (stopped.phase, stopped.exit_code) == (Phase.STOPPED, 0)
    assert shape(actions) == ["run_stopped"]


def test_a_stop_in_backoff_ends_the_run_at_its_newest_complete_state():
    """No rank runs to save at an agreed step: STOPPED at the newest complete state the runner names (stopped_at),
    exit 0, the reason and the journal saying so."""
    for event in (StopRequested(StopRequest(None, True, FILE), newest_step=100), SignalReceived(signal.SIGTERM, 100)):
        state, actions = decide(backoff(), event, NOW)
        assert (state.phase, state.exit_code, state.stopped_at) == (Phase.STOPPED, 0, 100)
        source = FILE if isinstance(event, StopRequested) else "SIGTERM"
        assert state.stop_source == source
        assert state.reason == (
            f"stopped on request ({source}) with no rank running: the run ends at its newest complete state, "
            "step 100; steps trained past it are lost"
        )
        assert dict(record(actions, "run_stopped").fields) == {
            "attempt": 1,
            "source": source,
            "step": 100,
            "ranks": "none",
        }


def test_a_stop_with_no_complete_checkpoint_says_the_run_starts_again_from_its_beginning():
    state, _ = decide(backoff(), StopRequested(StopRequest(None, True, FILE)), NOW)
    assert state.stopped_at is None and state.reason is not None
    assert state.reason.endswith("no checkpoint is complete, so the run starts again from its beginning when resumed")


def test_a_stop_while_a_relaunch_is_being_prepared_kills_what_the_launch_started_and_ends_at_the_newest_state():
    """STARTING (the relaunch's checkpoints being verified, its step being started): STOPPED at once."""
    state, _ = decide(backoff(), Tick(), NOW + 10)
    assert state.phase is Phase.STARTING
    state, actions = decide(state, SignalReceived(signal.SIGTERM, newest_step=80), NOW + 10)
    assert (state.phase, state.stopped_at) == (Phase.STOPPED, 80)
    assert KillLeftovers(state.attempt) in actions


def test_a_stop_while_a_failed_attempt_goes_down_cancels_the_relaunch_and_ends_at_the_newest_state():
    """STOPPING before a relaunch: no relaunch; once every rank is down, STOPPED at the newest complete state."""
    state = stopping_for_crash(POLICY)
    state, actions = decide(state, StopRequested(StopRequest(None, True, FILE), newest_step=60), NOW)
    assert (state.phase, state.then, state.stopped_at) == (Phase.STOPPING, Then.STOP, 60)
    assert shape(actions) == ["stop_requested"]
    state, _ = decide(state, ChildExited(0, 1, -15), NOW + 1)
    assert (state.phase, state.exit_code, state.stopped_at) == (Phase.STOPPED, 0, 60)
    assert state.reason is not None and "failed attempt's ranks went down" in state.reason and "step 60" in state.reason


def test_a_stop_while_stopping_to_stop_keeps_the_first_stop():
    """A stop already under way (its own agreed step) is not replaced by a later request's newest state."""
    state, _ = decide(training(), SignalReceived(signal.SIGTERM), NOW)
    state, _ = decide(state, Tick(), NOW + POLICY.stop_timeout_s + 1)  # the graceful stop timed out: STOPPING
    assert (state.phase, state.then) == (Phase.STOPPING, Then.STOP)
    after, _ = decide(state, StopRequested(StopRequest(None, True, FILE), newest_step=30), NOW + 400)
    assert (after.then, after.stopped_at, after.stop_source) == (Then.STOP, None, "SIGTERM")
