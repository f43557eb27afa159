"""Who takes a multi-node run's supervision, and when: an agent standing for successor, a supervisor taking the
lease, and the one that handed over waiting (real files in a tmp run dir; Slurm stubbed out by its answers)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from supervisor.launch import slurmctl, succession
from supervisor.launch.succession import Succession, stand_for_successor, take_lease, wait_after_handover
from supervisor.rundir.lease import ABDICATED, HELD, RELEASED, Lease, claim, newest
from worker.contract import RunLayout

HERE = socket.gethostname()
TTL = 10.0


@pytest.fixture(autouse=True)
def _in_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(slurmctl, "job_running", lambda job: job == "7")
    monkeypatch.setattr(succession, "STAGGER_S", 0.0)


def held(generation: int, host: str, *, age: float = 0.0, state: str = HELD, batch: bool = True) -> Lease:
    return Lease(generation, host, 4242, time.time() - age, TTL, state, "7", batch)


def plan(order: tuple[str, ...] = (HERE,)) -> Succession:
    return Succession(1, TTL, order, ("run", "job.yaml"), "/", {"PATH": "/bin"})


def stand(
    layout: RunLayout, order: tuple[str, ...] = (HERE,), *, reachable: bool = True, wait_s: float = 5.0
) -> Lease | None:
    return stand_for_successor(
        layout, plan(order), here=HERE, deadline=time.monotonic() + wait_s, reachable=lambda: reachable
    )[0]


def test_the_first_candidate_claims_the_next_generation_once_the_lease_lapsed(tmp_path):
    """The supervisor stopped renewing longer than its ttl ago: the first agent in the order claims generation 2."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", age=TTL + 1))
    won = stand(layout)
    assert won is not None and (won.generation, won.host, won.pid, won.batch) == (2, HERE, os.getpid(), False)
    assert newest(layout) == won


def test_an_abdicated_lease_is_claimed_without_waiting_for_its_ttl(tmp_path):
    """The supervisor found itself cut off and abdicated just now: the first candidate takes over at once."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", state=ABDICATED))
    assert stand(layout).generation == 2


def test_a_candidate_waits_while_the_supervisor_still_renews(tmp_path):
    """A fresh lease of a live supervisor (only this agent's link broke): no claim, until the deadline."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", age=-60))  # renewed "in the future": fresh throughout the wait
    assert stand_for_successor(layout, plan(), here=HERE, deadline=time.monotonic() + 0.3, reachable=lambda: True) == (
        None,
        "the supervisor's lease did not lapse",
    )


def test_a_later_candidate_waits_its_turn_and_finds_the_first_one_took_over(tmp_path):
    """The second in the order waits a stagger longer; meanwhile the first claimed: it stands down."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", state=ABDICATED))
    claim(layout, held(2, "first-candidate"))
    assert stand(layout, ("first-candidate", HERE)) is None


def test_a_candidate_that_cannot_reach_the_controller_does_not_claim(tmp_path):
    """Cut off itself (the isolated batch host's own agent, say), a candidate leaves the run to others."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", state=ABDICATED))
    assert stand(layout, reachable=False, wait_s=0.3) is None and newest(layout).generation == 1


def test_no_succession_after_the_run_ended_or_outside_the_order(tmp_path):
    """A released lease (the run ended) and a node not in the order never lead to a claim."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", state=RELEASED))
    assert stand(layout) is None
    claim(layout, held(2, "batch-host", state=ABDICATED))
    assert stand(layout, ("someone-else",)) is None


def test_a_live_foreign_lease_refuses_a_second_supervisor(tmp_path):
    """A fresh lease of another host: `trainwarden run` says who supervises the run dir, and claims nothing."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "other-host"))
    refused = take_lease(layout, ttl_s=TTL, batch=True)
    assert isinstance(refused, str) and "already supervised by pid 4242 on other-host" in refused


def test_a_successor_finds_the_generation_its_agent_claimed_for_it(tmp_path):
    """The agent claimed in its own name and became the supervisor (same pid): no second claim."""
    layout = RunLayout(tmp_path)
    mine = claim(layout, Lease(3, HERE, os.getpid(), time.time(), TTL, HELD, "7", False))
    assert take_lease(layout, ttl_s=TTL, batch=False) == mine


def test_the_batch_process_that_handed_over_ends_with_the_successors_exit_code(tmp_path):
    """While a successor holds the run the batch process waits as keeper; its release gives the exit code."""
    layout = RunLayout(tmp_path)
    ours = claim(layout, held(1, HERE, state=ABDICATED))
    claim(layout, Lease(2, "successor", 9, time.time(), TTL, RELEASED, "7", False, 75))
    said: list[str] = []
    assert wait_after_handover(layout, ours, say=said.append, reachable=lambda: True) == 75


def test_a_handed_over_successor_leaves_at_once_when_another_supervises(tmp_path):
    """A successor is not the job's batch process: with a newer holder alive it has nothing left to do."""
    layout = RunLayout(tmp_path)
    ours = claim(layout, held(2, HERE, state=ABDICATED, batch=False))
    claim(layout, held(3, "next"))
    assert wait_after_handover(layout, ours, say=print, reachable=lambda: True) == 0


def test_a_supervisor_whose_link_is_back_and_nobody_took_over_reclaims_the_run(tmp_path):
    """Abdicated, no candidate claimed, the controller answers again: the next generation is ours."""
    layout = RunLayout(tmp_path)
    ours = claim(layout, Lease(1, HERE, os.getpid(), time.time(), TTL, ABDICATED, "7", True))
    again = wait_after_handover(layout, ours, say=print, reachable=lambda: True)
    assert isinstance(again, Lease) and (again.generation, again.batch) == (2, True)


class _Slurm:
    """What the successor asks Slurm to do at the end, recorded instead of done."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def cancel_job(self, job: str) -> None:
        self.calls.append(("cancel", job))

    def requeue_job(self, job: str, *, exclude: object, nodes: object) -> None:
        self.calls.append(("requeue", job, tuple(exclude), nodes))


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> _Slurm:
    fake = _Slurm()
    monkeypatch.setattr(slurmctl, "cancel_job", fake.cancel_job)
    monkeypatch.setattr(slurmctl, "requeue_job", fake.requeue_job)
    return fake


def test_a_successor_with_no_keeper_cancels_the_job_when_the_run_ends(tmp_path, fake_slurm):
    """The batch script died with its host: nothing else would end the allocation, so the successor does."""
    said: list[str] = []
    succession.end_job(RunLayout(tmp_path), 0, exclude=["twnode1"], nodes=(2, 3), say=said.append)
    assert fake_slurm.calls == [("cancel", "7")] and "ending job 7" in said[0]


def test_a_successor_ending_75_requeues_the_job_away_from_the_excluded_nodes(tmp_path, fake_slurm):
    """Requeue me: Slurm restarts the job's batch script later, with the node range and the exclusions set."""
    succession.end_job(RunLayout(tmp_path), 75, exclude=["twnode1", "twnode2"], nodes=(2, 3), say=print)
    assert fake_slurm.calls == [("requeue", "7", ("twnode1", "twnode2"), (2, 3))]
