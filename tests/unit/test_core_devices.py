"""The decision core on re-run verdicts about a rank's device: charge it, move off it, or say it cannot."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    ChargeDevice,
    ChildExited,
    DeviceExcluded,
    DeviceVerdict,
    DeviceVerdictSeen,
    LaunchRanks,
    Phase,
    SignalRanks,
    Then,
    decide,
)
from supervisor.core.causes import CauseKind
from tests.unit.test_core import NOW, POLICY, record, running, shape
from worker.contract import EXIT_BAD_DEVICE, EXIT_REQUEUE

MOVABLE = replace(POLICY, can_move=True)
PERSISTENT = DeviceVerdict(0, 1, "persistent", 60, 59, "rank 1's norm 1e+35 came back", node="node7", gpu=1)
TRANSIENT = replace(PERSISTENT, verdict="transient", evidence="gone on a re-run")


def test_a_persistent_verdict_charges_the_device_and_relaunches_without_it():
    """A rank leaving with EXIT_BAD_DEVICE: the verdict journalled, its device charged, the attempt stopped and
    relaunched (the launcher leaves the excluded node out), the failure named after the device."""
    state = running(MOVABLE)
    state, actions = decide(state, ChildExited(0, 0, EXIT_BAD_DEVICE, device=PERSISTENT), NOW)
    assert shape(actions) == ["sdc_verdict", ChargeDevice(PERSISTENT), SignalRanks(0, signal.SIGTERM)]
    journal = dict(record(actions, "sdc_verdict").fields)
    assert (journal["rank"], journal["node"], journal["gpu"], journal["verdict"]) == (1, "node7", 1, "persistent")
    assert (state.phase, state.then) == (Phase.STOPPING, Then.RELAUNCH)
    failure = state.failures[-1]
    assert (failure.rank, failure.step, failure.node, failure.cause.kind) == (1, 60, "node7", CauseKind.BAD_DEVICE)
    assert "GPU 1 of node7" in failure.cause.text
    state, actions = decide(state, ChildExited(0, 1, EXIT_BAD_DEVICE, device=PERSISTENT), NOW)
    assert (state.phase, actions[-1]) == (Phase.STARTING, LaunchRanks(1))  # the first relaunch: no backoff


def test_a_run_that_cannot_move_ends_with_75_saying_what_it_would_have_done():
    """One machine: the same verdict ends the run with EXIT_REQUEUE, naming the GPU and the relaunch it could not
    make (`cannot_move`)."""
    state = running(POLICY)
    state, actions = decide(state, ChildExited(0, 1, EXIT_BAD_DEVICE, device=PERSISTENT), NOW)
    assert shape(actions) == ["sdc_verdict", ChargeDevice(PERSISTENT), "cannot_move", SignalRanks(0, signal.SIGTERM)]
    assert dict(record(actions, "cannot_move").fields) == {
        "device": "GPU 1 of node7",
        "would": "relaunch without GPU 1 of node7",
    }
    state, _ = decide(state, ChildExited(0, 0, EXIT_BAD_DEVICE, device=PERSISTENT), NOW)
    assert (state.phase, state.exit_code) == (Phase.FAILED, EXIT_REQUEUE)
    assert "would relaunch without GPU 1 of node7" in (state.reason or "")


def test_a_transient_verdict_is_journalled_and_charged_and_training_goes_on():
    """A transient verdict (its step went on with the re-run's result) is a strike: charged, nothing stopped."""
    state = running(MOVABLE)
    after, actions = decide(state, DeviceVerdictSeen(TRANSIENT), NOW)
    assert shape(actions) == ["sdc_verdict", ChargeDevice(TRANSIENT)]
    assert record(actions, "sdc_verdict").level == "warning"
    assert after == state


def test_strikes_that_exclude_a_device_move_the_attempt_off_it():
    """The ledger excluding the device of a running attempt (its strikes added up) ends that attempt as a failure
    of that device; excluded for an attempt already over, it changes nothing."""
    state = running(MOVABLE)
    why = "3 transient faults in 8h00m"
    stopped, actions = decide(state, DeviceExcluded(TRANSIENT, why), NOW)
    assert shape(actions) == [SignalRanks(0, signal.SIGTERM)]
    assert (stopped.phase, stopped.then) == (Phase.STOPPING, Then.RELAUNCH)
    assert stopped.failures[-1].cause.text.startswith(f"GPU 1 of node7 is excluded: {why}")
    old, actions = decide(state, DeviceExcluded(replace(TRANSIENT, attempt=7), why), NOW)
    assert (old, actions) == (state, [])


def test_a_bad_device_exit_without_its_verdict_is_a_crash():
    """Exit 69 whose verdict could not be read (an unreadable log) is an ordinary crash: no device is charged."""
    state = running(MOVABLE)
    state, actions = decide(state, ChildExited(0, 1, EXIT_BAD_DEVICE), NOW)
    assert not any(isinstance(a, ChargeDevice) for a in actions)
    assert state.failures[-1].cause.kind is CauseKind.EXIT
