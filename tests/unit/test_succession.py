"""Who takes a multi-node run's supervision, and when: an agent standing for successor, a supervisor taking the
lease, and the one that handed over waiting (real files in a tmp run dir; Slurm stubbed out by its answers)."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import replace

import pytest

from supervisor.launch import slurmctl, succession
from supervisor.launch.succession import Succession, stand_for_successor, take_lease, take_over, wait_after_handover
from supervisor.rundir.lease import ABDICATED, HELD, RELEASED, Lease, claim, newest, read_keeper
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


def test_a_candidate_waits_for_the_controller_past_its_deadline_and_claims_when_it_answers(tmp_path):
    """The batch host died while the controller was down: the candidate keeps its claim for the controller's return
    (a successor needs it for its first step), up to controller_wait_s past its own deadline, and says so once."""
    layout = RunLayout(tmp_path)
    claim(layout, held(1, "batch-host", state=ABDICATED))
    answers = iter([False] * 6 + [True])
    said: list[str] = []
    waiting = replace(plan(), controller_wait_s=30.0)
    won, why = stand_for_successor(
        layout, waiting, here=HERE, deadline=time.monotonic() + 0.2, reachable=lambda: next(answers), say=said.append
    )
    assert won is not None and won.generation == 2 and why == "claimed"
    assert len(said) == 1 and "waiting up to 30 s (slurm.controller_wait_s)" in said[0]
    assert Succession.from_json(waiting.to_json()) == waiting


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
    assert said[-1] == (  # the keeper's log says which code it passes on
        "the supervisor on successor (lease generation 2) ended the run with exit code 75; the job's keeper exits "
        "with 75"
    )


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


def dead_pid() -> int:
    """A pid no process of this host has."""
    pid = 2**22 + 4321
    while succession.pid_alive(pid):
        pid += 1
    return pid


@pytest.mark.parametrize(
    ("state", "code"), [(HELD, None), (RELEASED, None)], ids=["killed (lease still held)", "python error (released)"]
)
def test_a_fresh_batch_supervisor_takes_over_from_one_that_died_on_this_host_at_once(tmp_path, state, code):
    """The batch script's supervisor was SIGKILLed (its fresh lease still held by a pid gone from this host) or died
    of a Python error (released without an exit code): `--take-over` claims the next generation at once, without
    waiting for the ttl, as the job's batch process."""
    layout = RunLayout(tmp_path)
    claim(layout, Lease(1, HERE, dead_pid(), time.time(), TTL, state, "7", True, code))
    taken = take_over(layout, ttl_s=TTL, say=print)
    assert isinstance(taken, Lease) and (taken.generation, taken.host, taken.batch) == (2, HERE, True)


def test_take_over_of_a_run_this_job_ended_exits_with_the_runs_code_and_claims_nothing(tmp_path):
    """The supervisor exited 1 because the run failed (its lease released with 1): no second run, the same code."""
    layout = RunLayout(tmp_path)
    claim(layout, Lease(1, HERE, dead_pid(), time.time(), TTL, RELEASED, "7", True, 1))
    said: list[str] = []
    assert take_over(layout, ttl_s=TTL, say=said.append) == 1
    assert newest(layout).generation == 1 and "already ended with exit 1" in said[0]


def test_take_over_of_a_run_an_earlier_job_released_starts_it_as_a_plain_run_would(tmp_path):
    """The lease was released by the job before (exit 75, resubmitted): that is not this job's end."""
    layout = RunLayout(tmp_path)
    claim(layout, Lease(1, "other-host", 9, time.time(), TTL, RELEASED, "6", True, 75))
    taken = take_over(layout, ttl_s=TTL, say=print)
    assert isinstance(taken, Lease) and taken.generation == 2


def test_take_over_waits_as_keeper_when_a_successor_elsewhere_claimed_first_and_ends_with_its_code(tmp_path):
    """The lease lapsed before the fresh supervisor started and twnode2's agent took the run: the batch process
    keeps the job alive (keeper file) and exits with the code the successor released."""
    layout = RunLayout(tmp_path)
    claim(layout, Lease(1, HERE, dead_pid(), time.time() - 2 * TTL, TTL, HELD, "7", True))
    claim(layout, held(2, "twnode2", batch=False))
    said: list[str] = []

    def release_later() -> None:
        time.sleep(0.5)
        claim(layout, Lease(3, "twnode3", 9, time.time(), TTL, RELEASED, "7", False, 0))

    threading.Thread(target=release_later, daemon=True).start()
    assert take_over(layout, ttl_s=TTL, say=said.append) == 0
    assert "handed over to twnode2" in said[0] and read_keeper(layout) is not None


def test_take_over_refuses_a_run_another_jobs_live_supervisor_holds(tmp_path, monkeypatch):
    """Not a successor of ours: the same refusal as a plain `trainwarden run`, no keeper."""
    monkeypatch.setattr(slurmctl, "job_running", lambda job: job in ("7", "8"))
    layout = RunLayout(tmp_path)
    claim(layout, Lease(1, "other-host", 4242, time.time(), TTL, HELD, "8", True))
    refused = take_over(layout, ttl_s=TTL, say=print)
    assert isinstance(refused, str) and "already supervised by pid 4242 on other-host" in refused
    assert read_keeper(layout) is None


class _Slurm:
    """What the successor asks Slurm to do at the end, recorded instead of done."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.missing: str | None = None  # what `sinfo` shows the partition lacks

    def shortfall(self, exclude: object, minimum: int) -> str | None:
        self.calls.append(("sinfo", tuple(exclude), minimum))
        return self.missing

    def cancel_job(self, job: str) -> None:
        self.calls.append(("cancel", job))

    def resubmit_job(self, job: str, *, exclude: object, nodes: object) -> str:
        self.calls.append(("resubmit", job, tuple(exclude), nodes))
        return "8"


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> _Slurm:
    fake = _Slurm()
    monkeypatch.setattr(slurmctl, "cancel_job", fake.cancel_job)
    monkeypatch.setattr(slurmctl, "resubmit_job", fake.resubmit_job)
    monkeypatch.setattr(slurmctl, "shortfall", fake.shortfall)
    return fake


def test_a_successor_with_no_keeper_cancels_the_job_when_the_run_ends(tmp_path, fake_slurm):
    """The batch script died with its host: nothing else would end the allocation, so the successor does."""
    said: list[str] = []
    succession.end_job(RunLayout(tmp_path), 0, exclude=["twnode1"], nodes=(2, 3), say=said.append)
    assert fake_slurm.calls == [("cancel", "7")] and "ending job 7" in said[0]


def test_a_successor_ending_75_resubmits_the_job_for_a_node_range_away_from_the_excluded_nodes(tmp_path, fake_slurm):
    """Requeue me: the batch script again as a new job after this one, for the node range the run accepts away from
    the ledger's exclusions (a requeue would keep the job's node count); then this job ends."""
    said: list[str] = []
    succession.end_job(RunLayout(tmp_path), 75, exclude=["twnode1", "twnode2"], nodes=(2, 3), say=said.append)
    assert fake_slurm.calls == [
        ("sinfo", ("twnode1", "twnode2"), 2),
        ("resubmit", "7", ("twnode1", "twnode2"), (2, 3)),
        ("cancel", "7"),
    ]
    assert said == ["exit 75, requeue me: job 8 carries on once job 7 ended (the batch script is gone)"]


def test_a_successor_ending_75_submits_nothing_the_partition_could_never_hold(tmp_path, fake_slurm):
    """Two of four nodes excluded, a third drained, two needed: a new job would stay pending for ever
    (BadConstraints); none is submitted, one line names what is missing, and the job ends."""
    fake_slurm.missing = "partition debug can never hold the job: it needs at least 2 node(s), 4 in it, 1 usable"
    said: list[str] = []
    succession.end_job(RunLayout(tmp_path), 75, exclude=["twnode1", "twnode2"], nodes=(2, 3), say=said.append)
    assert fake_slurm.calls == [("sinfo", ("twnode1", "twnode2"), 2), ("cancel", "7")]
    assert said == [f"not resubmitting job 7: {fake_slurm.missing}; ending it (exit 75: resubmit when nodes are back)"]


def test_a_successor_waits_for_the_controller_before_it_resubmits_and_ends_the_job(tmp_path, fake_slurm):
    """The run ended with 75 while the controller was out of reach: the successor waits for it (bounded by
    controller_wait_s), then resubmits and ends the job, instead of leaving both undone."""
    answers = iter([False, False, True])
    said: list[str] = []
    succession.end_job(
        RunLayout(tmp_path),
        75,
        exclude=["twnode1"],
        nodes=(2, 3),
        say=said.append,
        controller_wait_s=30.0,
        reachable=lambda: next(answers),
    )
    assert [call[0] for call in fake_slurm.calls] == ["sinfo", "resubmit", "cancel"]
    assert "waiting up to 30 s (slurm.controller_wait_s) to end the job" in said[0]


class _Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, object]]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.records.append((event, fields))


@pytest.mark.parametrize(
    ("before", "said"),
    [
        (Lease(1, HERE, 4242, 0.0, TTL, HELD, "7", True), "supervisor_replaced"),  # SIGKILLed: nobody charged
        (Lease(1, HERE, 4242, 0.0, TTL, RELEASED, "7", True), "supervisor_replaced"),  # a Python error
        (Lease(1, "twnode1", 4242, 0.0, TTL, HELD, "7", True), "supervision_taken_over"),  # its host died: charged
        (Lease(1, HERE, 4242, 0.0, TTL, ABDICATED, "7", True), None),  # our own, taken back after isolation
        (Lease(1, HERE, 4242, 0.0, TTL, RELEASED, "7", True, 75), None),  # the run ended: a fresh start
    ],
)
def test_a_new_supervisor_names_how_it_took_over_and_charges_only_a_host_that_went(tmp_path, before, said):
    """The predecessor died on this live host (its lease held, or released without an exit code): journaled as
    replaced, no node charged. Its host went silent: that host is charged (as before)."""
    from types import SimpleNamespace

    from supervisor.launch.slurm import SlurmLauncher

    layout = RunLayout(tmp_path)
    claim(layout, before)
    charged: list[str] = []
    launcher = SimpleNamespace(
        _lease=Lease(2, HERE, os.getpid(), time.time(), TTL, HELD, "7", True),
        _layout=layout,
        _host=HERE,
        _log=_Log(),
        _charge=lambda node, why, kind: charged.append(node),
    )
    SlurmLauncher._charge_predecessor(launcher)  # type: ignore[arg-type]
    assert [event for event, _ in launcher._log.records] == ([said] if said else [])
    assert charged == (["twnode1"] if said == "supervision_taken_over" else [])
    if said == "supervisor_replaced":
        (_, fields) = launcher._log.records[0]
        assert fields == {
            "node": HERE,
            "previous_pid": 4242,
            "previous_generation": 1,
            "lease": before.state,
            "generation": 2,
            "charged": None,
        }


SHOW_JOB = (
    "JobId=41 JobName=trainwarden-demo UserId=root(0) JobState=RUNNING Reason=None Requeue=1 TimeLimit=01:00:00 "
    "Partition=sim NodeList=twnode[1-3] NumNodes=3 WorkDir=/home/me/work StdOut=/dev/null"
)


@pytest.mark.parametrize(
    ("show_job", "exclude", "nodes", "args"),
    [
        (
            SHOW_JOB,
            ["twnode2", "twnode1"],
            (2, 3),
            [
                "--dependency=afterany:41",
                "--nodes=2-3",
                "--exclude=twnode1,twnode2",
                "--partition=sim",
                "--job-name=trainwarden-demo",
                "--chdir=/home/me/work",
                "--time=01:00:00",
            ],
        ),
        (
            "JobId=42 JobName=x Partition=(null) TimeLimit=UNLIMITED WorkDir=/w",
            [],
            (2, 2),
            ["--dependency=afterany:42", "--nodes=2", "--job-name=x", "--chdir=/w"],
        ),
    ],
)
def test_the_next_job_asks_for_the_node_range_and_only_the_ledgers_exclusions(show_job, exclude, nodes, args):
    """What sbatch gets for the job after a 75 whose batch script is gone: the range (min_nodes or nodes to nodes +
    spares), the ledger's exclusions, and what Slurm knows of the first job that its script may not say."""
    assert slurmctl.resubmit_args(show_job, exclude=exclude, nodes=nodes) == args
