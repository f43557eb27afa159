"""The controller is not the network (issue #39): who is cut off is judged by the peers, a step waits for the
controller (bounded), and a step Slurm cannot create yet is tried again. The rules with plain values and a fake
clock; then the Slurm launcher following them, its Slurm calls and agents faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.core import LaunchFailed
from supervisor.launch import slurm, slurmctl
from supervisor.launch.controller import (
    STEP_RETRIES,
    ControllerWait,
    cut_off,
    retry_delay_s,
    step_not_created_yet,
)
from supervisor.launch.launcher import Isolated
from worker.contract import EXIT_REQUEUE, RunLayout

# ---- the rules ----


@pytest.mark.parametrize(
    ("remote", "silent", "heard_other", "reachable", "verdict"),
    [
        ({"b", "c"}, {"b"}, True, False, False),  # a node crashed, another is heard: the controller does not matter
        ({"b", "c"}, {"b"}, False, False, False),  # c is not silent: our link works
        ({"b", "c"}, {"b", "c"}, True, False, False),  # a node that finished was heard within the timeout
        (set(), set(), False, False, False),  # no agent to judge by (between attempts): never cut off
        ({"b", "c"}, {"b", "c"}, False, None, None),  # every other node silent: ask the controller first
        ({"b", "c"}, {"b", "c"}, False, True, False),  # it answers: they are lost, not us
        ({"b", "c"}, {"b", "c"}, False, False, True),  # peers and controller out of reach: it is us
    ],
)
def test_isolation_is_judged_by_the_peers_never_by_the_controller_alone(
    remote, silent, heard_other, reachable, verdict
):
    assert cut_off(remote, silent, heard_other, reachable) is verdict


@pytest.mark.parametrize(
    ("said", "not_yet"),
    [
        ("srun: error: Unable to create step for job 12: Memory required by task is not available", True),
        ("srun: error: Unable to create step for job 12: Requested nodes are busy", True),
        ("srun: Job 12 step creation temporarily disabled, retrying (Requested nodes are busy)", True),
        ("srun: error: Unable to contact slurm controller (connect failure)", True),
        ("srun: error: Socket timed out on send/recv operation", True),
        (
            "srun: error: Unable to create step for job 12: Required node not available (down, drained or reserved)",
            True,
        ),
        ("srun: error: Unable to create step for job 12: Invalid generic resource (gres) specification", False),
        ("srun: error: Invalid generic resource (gres) specification", False),
        ("srun: error: execve(): python3: No such file or directory", False),
        ("srun: error: Invalid job id specified", False),
        ("", False),
    ],
)
def test_srun_errors_that_a_retry_may_get_past(said, not_yet):
    assert step_not_created_yet(said) is not_yet


def test_step_retries_back_off_and_stay_bounded():
    assert [retry_delay_s(n) for n in range(1, 7)] == [1, 2, 4, 8, 15, 15]
    assert sum(retry_delay_s(n) for n in range(1, STEP_RETRIES + 1)) <= 60


def test_the_controller_wait_notices_once_and_ends_at_its_bound():
    wait = ControllerWait(wait_s=70.0)
    assert wait.back(100.0) is None  # never out of reach: nothing to say

    assert wait.out_of_reach(100.0) == (True, False)
    assert wait.next_try(100.0) == 101.0
    assert wait.out_of_reach(101.0) == (False, False)
    assert wait.next_try(101.0) == 103.0
    assert wait.out_of_reach(103.0) == (False, False)
    assert wait.next_try(103.0) == 107.0
    assert wait.out_of_reach(168.0) == (False, False)
    assert wait.next_try(168.0) == 170.0  # never asked again past the bound: judged then
    assert wait.out_of_reach(170.0) == (False, True)

    assert wait.back(171.0) == 71.0
    assert wait.out_of_reach(500.0) == (True, False)  # a later outage is a new one
    assert wait.back(501.0) == 1.0

    assert wait.out_of_reach(620.0, asked=600.0) == (True, False)  # counted from the question that timed out
    assert wait.back(621.0) == 21.0


# ---- the Slurm launcher following them ----


class _Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, object]]] = []

    def _add(self, event: str, **fields: object) -> None:
        self.records.append((event, fields))

    info = warning = error = _add

    def events(self) -> list[str]:
        return [event for event, _ in self.records]


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "twnode[1-3]")
    monkeypatch.setenv("TRAINWARDEN_SUPERVISOR_ADDR", "127.0.0.1")
    (tmp_path / "t.py").write_text("")
    config_path = tmp_path / "job.yaml"
    config_path.write_text(f"script: {tmp_path / 't.py'}\nnodes: 2\nspare_nodes: 1\nslurm: {{controller_wait_s: 70}}\n")
    config = load_config(config_path)
    posted: list[object] = []
    log = _Log()
    made = slurm.SlurmLauncher(config, RunLayout(tmp_path / "run"), posted.append, log)
    planned: list[int] = []
    monkeypatch.setattr(made, "_plan", lambda attempt, known: planned.append(attempt))  # no thread, no Slurm
    made.planned, made.log = planned, log  # type: ignore[attr-defined]
    yield made
    made._server.close()
    made._hub.close()


def test_a_plan_the_controller_cannot_answer_waits_for_it_instead_of_handing_over(launcher):
    unreachable = slurm._Planned(0, error="scontrol: timed out after 15 s", reachable=False)

    assert launcher._planned(unreachable) == []  # not Isolated: no agent was heard to judge our link by
    assert launcher.log.events() == ["controller_unreachable"]
    assert launcher._retry_at is not None
    assert launcher.next_deadline() == launcher._retry_at

    launcher._retry_at = 0.0  # the backoff is over: the plan is asked again
    launcher.poll()
    assert launcher.planned == [0]
    assert launcher._planned(unreachable) == []
    assert launcher.log.events() == ["controller_unreachable"]  # journaled once per outage


def test_the_controller_back_is_journaled_and_the_step_starts(launcher, monkeypatch):
    started: list[dict[str, int]] = []
    monkeypatch.setattr(launcher, "_start_step", lambda attempt, places, spares: started.append(places))
    launcher._planned(slurm._Planned(0, error="timed out", reachable=False))

    launcher._planned(slurm._Planned(0, ("twnode1", "twnode2", "twnode3"), {}))

    assert launcher.log.events() == ["controller_unreachable", "controller_back"]
    assert started == [{"twnode1": 0, "twnode2": 1}]  # each node with its place


def test_a_controller_out_of_reach_past_the_wait_ends_the_launch_with_75(launcher):
    launcher._planned(slurm._Planned(0, error="timed out", reachable=False))
    assert launcher._controller.since is not None
    launcher._controller.since -= 70.0

    (failed,) = launcher._planned(slurm._Planned(0, error="timed out", reachable=False))

    assert isinstance(failed, LaunchFailed)
    assert failed.exit_code == EXIT_REQUEUE
    assert "out of reach for 70 s (slurm.controller_wait_s)" in failed.error


def test_a_step_slurm_cannot_create_yet_is_retried_with_backoff_then_left_to_the_core(launcher):
    said = "srun: error: Unable to create step for job 7: Memory required by task is not available"
    busy = slurm._LinkChecked(0, True, (), f"srun exited with code 1 before every agent connected: {said}", said)
    for tries in range(1, STEP_RETRIES + 1):
        assert launcher._link_checked(busy) == []
        assert launcher._step_tries == tries
    (failed,) = launcher._link_checked(busy)
    assert isinstance(failed, LaunchFailed) and failed.retryable and failed.exit_code is None
    assert launcher.log.events() == ["step_retry"] * STEP_RETRIES


def test_a_plan_that_failed_while_the_controller_answers_again_is_asked_again_then_left_to_the_core(launcher):
    slow = slurm._Planned(0, error="scontrol: timed out after 15 s", reachable=True)
    for _ in range(STEP_RETRIES):
        assert launcher._planned(slow) == []
    (failed,) = launcher._planned(slow)
    assert isinstance(failed, LaunchFailed) and failed.retryable and failed.exit_code is None
    assert launcher.log.events() == ["step_retry"] * STEP_RETRIES


def test_a_step_slurm_refuses_for_good_ends_the_run_at_once_and_one_it_says_nothing_of_is_relaunched(launcher):
    said = "srun: error: Invalid generic resource (gres) specification"
    why = f"srun exited with code 1 before every agent connected: {said}"
    (refused,) = launcher._link_checked(slurm._LinkChecked(0, True, (), why, said))
    assert (refused.retryable, refused.exit_code, refused.error) == (False, 1, why)

    (silent,) = launcher._link_checked(slurm._LinkChecked(0, True, (), "srun exited with code -9 before every agent"))
    assert silent.retryable and silent.exit_code is None  # no words, no verdict: a relaunch, while restarts are left
    (no_agent,) = launcher._link_checked(slurm._LinkChecked(0, True, (), "no agent connected within 60 s of srun"))
    assert no_agent.retryable and no_agent.exit_code is None
    assert launcher.log.events() == []


def test_srun_failing_with_the_controller_out_of_reach_waits_for_it(launcher):
    assert launcher._link_checked(slurm._LinkChecked(0, False, (), "srun exited with code 1")) == []
    assert launcher.log.events() == ["controller_unreachable"]


def test_every_other_node_silent_and_the_controller_out_of_reach_is_still_isolation(launcher):
    launcher._attempt = 0
    launcher._nodes = {
        "twnode2": slurm._Node("twnode2", 1, (1,), peer=object(), state="running"),  # type: ignore[arg-type]
    }
    (isolated,) = launcher._link_checked(slurm._LinkChecked(0, False, ("twnode2",), "every other node went silent"))
    assert isinstance(isolated, Isolated)


def test_no_isolation_when_the_controller_is_out_of_reach_but_a_peer_is_heard(launcher, monkeypatch):
    monkeypatch.setattr(slurmctl, "controller_reachable", lambda timeout=5.0: pytest.fail("no link check"))
    launcher._attempt = 0
    now = slurm.time.monotonic()
    lost: list[str] = []
    monkeypatch.setattr(launcher, "_lose", lambda node, why: lost.append(node.name) or [])
    launcher._nodes = {
        name: slurm._Node(name, i, (i,), peer=object(), state="running", heard=heard)  # type: ignore[arg-type]
        for i, (name, heard) in enumerate([("twnode2", now - 60.0), ("twnode3", now)], start=1)
    }
    launcher._silent_nodes(now)
    assert lost == ["twnode2"]
    assert not launcher._checking_link
