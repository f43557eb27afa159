"""`trainwarden status` while ranks come and go: hang detection said truly, heartbeat ages that keep growing."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from supervisor.core import ChildExited, HeartbeatSeen, Phase, RanksLaunched, State, decide, initial_state
from supervisor.observe.status import read_status, render, snapshot, write_status
from tests.unit.test_status import NOW, POLICY, running
from worker.contract import RunLayout

HANG_OFF = "hang detection is off"


def shown(state: State, now: float = NOW) -> dict[str, Any]:
    """The status `trainwarden status` reads for `state`, with a live supervisor."""
    return {**snapshot(state, now=now, extra={"run_dir": "runs/x", "last_checkpoint": None}), "supervisor_alive": True}


def beating() -> State:
    """RUNNING attempt 0 with rank 0's train heartbeat seen at NOW."""
    state, _ = decide(running(), HeartbeatSeen(0, 0, seq=1, step=12, phase="train"), NOW)
    return state


def test_relaunching_after_a_crash_does_not_say_hang_detection_is_off():
    """Rank 1 crashed, the relaunch's ranks have not beaten yet: the run's ranks did, so no heartbeats-off line."""
    state, _ = decide(beating(), ChildExited(0, 1, 3), NOW + 1)
    state, _ = decide(state, ChildExited(0, 0, -15), NOW + 2)
    assert state.phase is Phase.STARTING
    assert shown(state)["heartbeats"] == "on"
    assert HANG_OFF not in render(shown(state))
    state, _ = decide(state, RanksLaunched(1, (200, 201), None), NOW + 3)
    assert HANG_OFF not in render(shown(state, NOW + 4))


def test_backoff_after_a_crash_does_not_say_hang_detection_is_off():
    """Waiting to relaunch (the second relaunch backs off): still no heartbeats-off line."""
    state, _ = decide(replace(beating(), restarts=1), ChildExited(0, 1, 3), NOW + 1)
    state, _ = decide(state, ChildExited(0, 0, -15), NOW + 2)
    assert state.phase is Phase.BACKOFF
    assert HANG_OFF not in render(shown(state))


def test_nothing_launched_yet_says_nothing_about_heartbeats():
    """Starting (checkpoints being verified), no rank has a pid: no heartbeat line at all."""
    assert "heartbeat" not in render(shown(initial_state(POLICY))).replace("no heartbeat", "")


def test_a_plain_script_still_says_hang_detection_is_off():
    """Ranks launched, none of the run ever beat, heartbeat mode auto: the line stays, it is true."""
    assert "  heartbeats: none seen (script does not use the worker library?): hang detection is off" in (
        render(shown(running())).splitlines()
    )


def test_required_heartbeats_not_seen_yet_do_not_say_hang_detection_is_off():
    """`hang.heartbeat: required` waits for a first beat on a deadline: detection is on, and the line says so."""
    state = replace(running(), policy=replace(POLICY, hang=replace(POLICY.hang, heartbeat="required")))
    lines = render(shown(state)).splitlines()
    assert "  heartbeats: none seen yet (hang.heartbeat: required: a rank silent past first_heartbeat_s hangs)" in lines
    assert not any(HANG_OFF in line for line in lines)


def test_heartbeat_mode_off_says_hang_detection_is_off_even_with_beats():
    """`hang.heartbeat: off`: the one place detection is off while ranks beat; said with the setting to change."""
    state = replace(beating(), policy=replace(POLICY, hang=replace(POLICY.hang, heartbeat="off")))
    assert "  hang detection is off (hang.heartbeat: off)" in render(shown(state)).splitlines()


def test_a_state_file_from_before_heartbeat_mode_renders_as_auto():
    """A state file written by an older supervisor (no `heartbeat_mode`) still renders, as `auto`."""
    status = shown(running())
    del status["heartbeat_mode"]
    assert any(HANG_OFF in line for line in render(status).splitlines())


@pytest.mark.parametrize("pid", [None, 2**31 - 1])
def test_heartbeat_ages_keep_growing_when_the_supervisor_is_gone(tmp_path, pid):
    """A supervisor that died (or none named) no longer rewrites the file: ages still grow by the time since."""
    layout = RunLayout(tmp_path)
    status = snapshot(beating(), now=NOW + 1.0, extra={"supervisor_pid": pid})
    status["updated_at"] = time.time() - 10.0
    write_status(layout, status, durable=False)
    read = read_status(layout)
    assert read["supervisor_alive"] is False
    assert read["ranks"][0]["heartbeat_age_s"] == pytest.approx(11.0, abs=1.0)
