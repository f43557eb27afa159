"""The job's time limit in the pure core: known from the scheduler's end time (TimeLimitRead), not only signalled.
A margin before it the run saves at an agreed step and ends with EXIT_REQUEUE, as on Slurm's USR1 warning; a
SIGTERM at the limit is the scheduler's, never a person's stop. Plain values and a fake clock (`now`)."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    ChildExited,
    KillLeftovers,
    LaunchRanks,
    Phase,
    PublishStopOrder,
    SignalReceived,
    Started,
    StopRequested,
    Then,
    Tick,
    TimeLimitRead,
    decide,
    initial_state,
    next_deadline,
    time_limit_deadline,
)
from supervisor.core.decide import TIME_LIMIT_TERM_SLACK_S
from supervisor.core.stop_requests import StopRequest
from tests.unit.test_core import NOW, POLICY, backoff, record, shape, stopping_for_crash
from tests.unit.test_core_stop import training
from worker.contract import EXIT_REQUEUE, StopOrder

END = NOW + 300.0  # the job ends 5 minutes from NOW (before a hang could be suspected)
MARGIN = 120.0
LIMIT = TimeLimitRead(END, MARGIN, "2026-11-28T12:00:00")
DUE = END - MARGIN


def test_an_end_time_far_off_changes_nothing_but_is_the_next_deadline():
    """Read at NOW with 10 minutes left: no action; the loop wakes at the end time less the margin."""
    state, actions = decide(training(), LIMIT, NOW)
    assert actions == [] and state.phase is Phase.RUNNING and state.time_limit == LIMIT
    assert next_deadline(state) == DUE
    state, actions = decide(state, Tick(), DUE - 0.1)
    assert actions == [] and state.stop_order is None


def test_the_margin_before_the_end_time_saves_at_an_agreed_step_and_ends_with_exit_75():
    """At the end time less the margin: `time_limit_near`, then a stop-and-exit order at the agreed step, as on
    SIGUSR1; the ranks save and exit 0, and the run ends STOPPED with EXIT_REQUEUE."""
    state, _ = decide(training(at=DUE), LIMIT, NOW)
    state, actions = decide(state, Tick(), DUE + 0.5)
    assert shape(actions) == ["time_limit_near", "stop_ordered", PublishStopOrder(StopOrder(1, 57, True))]
    near = dict(record(actions, "time_limit_near").fields)
    assert near == {"end_time": LIMIT.end_time, "margin_s": MARGIN, "left_s": 119.5, "phase": "running"}
    source = "ends 2026-11-28T12:00:00, margin 120 s"
    assert state.stop_source == source and time_limit_deadline(state) is None  # acted on, once
    for rank in (0, 1):
        state, actions = decide(state, ChildExited(0, rank, 0, stopped_at=57), DUE + 3)
    assert (state.phase, state.exit_code, state.stopped_at) == (Phase.STOPPED, EXIT_REQUEUE, 57)
    assert record(actions, "run_stopped").fields == (("attempt", 0), ("step", 57), ("source", source))
    assert state.reason == f"stopped for the job's time limit ({source}) at step 57, checkpoint 57 saved"


def test_an_end_time_read_inside_the_margin_acts_at_once_and_only_once():
    """A successor that starts with less than the margin left, or a limit shortened with `scontrol update`:
    the read itself acts; a later read or tick does not order a second stop."""
    state, actions = decide(training(at=DUE), replace(LIMIT, at=NOW + 60), NOW)
    assert shape(actions)[:2] == ["time_limit_near", "stop_ordered"]
    again, actions = decide(state, replace(LIMIT, at=NOW + 50), NOW + 1)
    assert actions == [] and again.stop_order == state.stop_order
    assert decide(again, Tick(), NOW + 2)[1] == []


def test_a_limit_lengthened_before_its_margin_moves_the_deadline_and_none_means_no_limit():
    """`scontrol update TimeLimit=` before the margin: the new end time counts; an unlimited job has no deadline."""
    state, _ = decide(training(), LIMIT, NOW)
    state, _ = decide(state, replace(LIMIT, at=END + 3600), NOW + 10)
    assert time_limit_deadline(state) == END + 3600 - MARGIN
    assert decide(state, Tick(), DUE + 1)[1] == []
    state, _ = decide(state, TimeLimitRead(None, MARGIN), NOW + 20)
    assert time_limit_deadline(state) is None


def test_a_time_limit_while_starting_stops_with_exit_75_without_launching():
    """No rank runs yet (a successor choosing its checkpoint): the run ends at once, STOPPED with EXIT_REQUEUE."""
    state, actions = decide(initial_state(POLICY), Started(), NOW)
    assert actions == [LaunchRanks(0)]
    state, actions = decide(state, replace(LIMIT, at=NOW + 30), NOW)
    assert shape(actions) == ["time_limit_near", KillLeftovers(0), "run_stopped"]
    assert (state.phase, state.exit_code) == (Phase.STOPPED, EXIT_REQUEUE)


def test_a_time_limit_in_backoff_cancels_the_relaunch_with_exit_75():
    state, actions = decide(backoff(), replace(LIMIT, at=NOW + 30), NOW)
    assert shape(actions) == ["time_limit_near", "run_stopped"]
    assert (state.phase, state.exit_code) == (Phase.STOPPED, EXIT_REQUEUE)
    source = f"ends {LIMIT.end_time}, margin 120 s"
    assert state.reason == f"stopped for the job's time limit ({source}) with no rank running"


def test_a_time_limit_while_stopping_for_a_relaunch_stops_instead_with_exit_75():
    """Ranks going down after a crash: no relaunch could save before the limit, so the run stops once they are down."""
    state, actions = decide(stopping_for_crash(), replace(LIMIT, at=NOW + 30), NOW)
    assert shape(actions) == ["time_limit_near"] and state.then is Then.STOP
    state, _ = decide(state, ChildExited(0, 1, -15), NOW + 1)
    assert (state.phase, state.exit_code) == (Phase.STOPPED, EXIT_REQUEUE)
    assert state.reason is not None and state.reason.startswith("stopped for the job's time limit (ends ")


def test_a_persons_stop_under_way_keeps_its_exit_code():
    """`trainwarden stop` already being carried out: the time limit is journaled, the stop still ends with 0."""
    state, _ = decide(training(at=DUE), StopRequested(StopRequest(None, True, "stop file /run/stop")), DUE)
    state, actions = decide(state, LIMIT, DUE + 1)
    assert shape(actions) == ["time_limit_near"] and state.stopped_code == 0


def test_a_sigterm_at_the_end_time_is_the_limit_not_a_persons_stop():
    """SIGTERM within the slack of the end time, or after it: the run saves and ends with EXIT_REQUEUE (the job hit
    its limit); the same SIGTERM earlier is a person's stop (exit 0)."""
    limit = replace(LIMIT, margin_s=0.0)  # no margin: the SIGTERM is the first word of the limit
    at_limit, _ = decide(training(at=END), limit, NOW)
    state, actions = decide(at_limit, SignalReceived(signal.SIGTERM), END - TIME_LIMIT_TERM_SLACK_S + 1)
    assert shape(actions)[:3] == ["signal_received", "time_limit_reached", "stop_ordered"]
    assert state.stopped_code == EXIT_REQUEUE
    for rank in (0, 1):
        state, _ = decide(state, ChildExited(0, rank, 0, stopped_at=state.stop_order.step), END + 3)
    assert (state.phase, state.exit_code) == (Phase.STOPPED, EXIT_REQUEUE)

    early, actions = decide(at_limit, SignalReceived(signal.SIGTERM), NOW + 100)
    assert "time_limit_reached" not in shape(actions) and early.stopped_code == 0
    unknown, _ = decide(training(), SignalReceived(signal.SIGTERM), END)  # no end time read: a stop as before
    assert unknown.stopped_code == 0
