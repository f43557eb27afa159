"""The batch host is no single point of failure: on the simulated Slurm cluster, the node that runs the job's batch
script and the supervisor crashes or is cut off, and the run goes on inside the same allocation, without a person.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO
from tests.slurm.test_multinode import (
    JOB_TIMEOUT_S,
    NODE_TIMEOUT_S,
    TRAINWARDEN,
    assert_same_training_state,
    events,
    finished,
    journal_time,
    queued_jobs,
    rank_pids,
    status,
    submit,
    wait_for_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

STEPS_LONG = 400  # long enough to be still training when the batch host goes


def first_step_after(run_dir: Path, since: float) -> float:
    """When rank 0 first logged a training step after `since` (wall clock)."""
    logged = (json.loads(line) for line in (run_dir / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines())
    return min(t for e in logged if e.get("event") == "step" and (t := journal_time(e)) > since)


def test_a_crashed_batch_host_hands_the_run_to_a_successor_that_finishes_it(slurm, tmp_path, reference):
    """The batch host (twnode1: the supervisor and ranks 0-1) is powered off at step 12: the agents on twnode2 and
    twnode3 fence, twnode2's agent takes the lease and becomes the supervisor, which resumes from step 10 on the
    surviving node and the spare, finishes bitwise as an uninterrupted run, and ends the job (squeue empty)."""
    job, run_dir = submit(slurm, tmp_path)
    wait_for_step(slurm, run_dir, 12)
    crashed_at = time.time()
    slurm.crash_node("twnode1")
    slurm.wait_for(lambda: status(run_dir).get("state") == "finished", JOB_TIMEOUT_S, "the successor to finish")
    slurm.wait_for(lambda: job not in queued_jobs(), 60, "the job to end")

    fenced = {e["node"]: e["ranks_killed"] for e in events(run_dir, "agent_fenced")}
    assert fenced["twnode2"] == [2, 3] and "twnode3" not in fenced  # the spare ran no agent
    (claimed,) = events(run_dir, "successor_claimed")
    assert (claimed["node"], claimed["generation"]) == ("twnode2", 2)
    (taken,) = events(run_dir, "supervision_taken_over")
    assert (taken["previous_host"], taken["lease"]) == ("twnode1", "held")  # it lapsed: nobody renewed it
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode2": [0, 1], "twnode3": [2, 3]}
    final = status(run_dir)
    assert [n["state"] for n in final["nodes"] if n["node"] != "twnode1"] == ["ended", "ended"]
    assert final["resumed_from"]["step"] >= 10 and final["supervisor_host"] == "twnode2"
    took = first_step_after(run_dir, crashed_at) - crashed_at
    assert took < NODE_TIMEOUT_S + 30, f"first step {took:.1f} s after the crash"
    assert slurm.job_state(job) == "CANCELLED"  # the successor ended it: its batch script died with twnode1
    assert_same_training_state(run_dir, reference)
    assert not rank_pids(slurm, "twnode2", attempt=0)


def test_a_cut_off_batch_host_blames_itself_hands_over_and_adopts_the_successors_exit(slurm, tmp_path, reference):
    """The batch host's link goes down at step 12: its supervisor hears no other node, finds the Slurm controller
    out of reach, fences its own ranks, charges no node and abdicates; twnode2's agent takes over on twnode2 and the
    spare. The link comes back: the old supervisor waits as the job's keeper and exits with the successor's code, so
    the job ends COMPLETED as its batch script says; no healthy node is excluded for good."""
    job, run_dir = submit(slurm, tmp_path)
    wait_for_step(slurm, run_dir, 12)
    slurm.partition("twnode1")
    slurm.wait_for(lambda: events(run_dir, "successor_claimed"), 40, "a successor")
    slurm.heal("twnode1")
    code, out = slurm.wait_job(job, JOB_TIMEOUT_S), (tmp_path / f"job-{job}.out").read_text()

    assert code == ("COMPLETED", 0), out[-3000:]
    (isolated,) = events(run_dir, "supervisor_isolated")
    assert "Slurm controller is out of reach from twnode1" in isolated["why"]
    assert not [e for e in events(run_dir, "node_lost") if e["node"] != "twnode1"]  # it blamed nobody else
    fenced = {e["node"]: e for e in events(run_dir, "agent_fenced")}
    assert fenced["twnode1"]["ranks_killed"] == [0, 1] and fenced["twnode2"]["ranks_killed"] == [2, 3]
    (taken,) = events(run_dir, "supervision_taken_over")
    assert (taken["previous_host"], taken["lease"]) == ("twnode1", "abdicated")
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode2": [0, 1], "twnode3": [2, 3]}
    assert "supervision handed over to twnode2" in out and status(run_dir)["state"] == "finished"
    assert_same_training_state(run_dir, reference)
    ledger = trainwarden("nodes", run_dir)
    assert "twnode1  cooling down" in ledger and "for good" not in ledger
    assert "forgot every fault of twnode1" in trainwarden("nodes", run_dir, "--forget", "twnode1")
    assert "twnode1  usable" in trainwarden("nodes", run_dir)


def trainwarden(*args: object) -> str:
    return subprocess.run([TRAINWARDEN, *map(str, args)], capture_output=True, text=True, timeout=30, check=True).stdout


def test_two_lost_nodes_end_the_job_75_and_the_examples_resubmission_finishes_the_run(slurm, tmp_path):
    """`sbatch -N3 examples/slurm/demo.sbatch`, config overrides through TRAINWARDEN_SET: twnode2 crashes (declared
    at once: its agent's stream breaks; the spare takes its place), then twnode3 (no spare left): exit 75, and the
    script resubmits itself with a node range and the lost nodes excluded, which Slurm can meet (twnode1 and
    twnode4); that job finishes the run. (The test marks the crashed nodes down in Slurm itself rather than wait
    the ~40 s of SlurmdTimeout for the first job to complete.)"""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    overrides = (
        f'args=["--steps","{STEPS_LONG // 4}"] slurm.node_timeout_s={NODE_TIMEOUT_S:g} '
        "worker.save_checkpoint_steps=10 stop.kill_grace_s=1"
    )
    env = {**os.environ, "PATH": f"{TRAINWARDEN.parent}:{os.environ['PATH']}", "TRAINWARDEN_SET": overrides}
    first = int(
        subprocess.run(
            ["sbatch", "--parsable", "-N3", "examples/slurm/demo.sbatch"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split(";")[0]
    )
    run_dir = tmp_path / "runs" / "slurm-demo"
    wait_for_step(slurm, run_dir, 12)
    crashed_at = time.time()
    slurm.crash_node("twnode2")
    slurm.wait_for(
        lambda: (placed := events(run_dir, "ranks_placed")) and placed[-1]["nodes"].get("twnode3"),
        60,
        "the spare to take twnode2's place",
    )
    (lost,) = events(run_dir, "node_lost")
    assert lost["node"] == "twnode2" and journal_time(lost) - crashed_at < 2.0
    assert status(run_dir)["failures"][-1]["node"] == "twnode2"
    wait_for_step(slurm, run_dir, 24, attempt=1)
    slurm.crash_node("twnode3")
    mark_down("twnode2", "twnode3")
    assert slurm.wait_job(first, JOB_TIMEOUT_S) == ("FAILED", 75)
    gone = {n["node"]: n for n in status(run_dir)["nodes"]}
    assert gone["twnode2"]["state"] == gone["twnode3"]["state"] == "excluded" and "lost" in gone["twnode2"]["why"]
    second = slurm.wait_for(lambda: [j for j in queued_jobs() if j != first], 30, "the resubmitted job")[0]
    assert slurm.wait_job(second, JOB_TIMEOUT_S) == ("COMPLETED", 0)

    log = (run_dir / "logs" / f"slurm_job_{first}.out").read_text()
    assert "needs 2 nodes, 1 usable left" in log and not list(tmp_path.glob("slurm-*.out"))
    resubmitted = slurm.job_info(second)
    assert resubmitted["ExcNodeList"] == "twnode[2-3]" and resubmitted["NumNodes"] == "2"
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode1": [0, 1], "twnode4": [2, 3]}
    assert status(run_dir)["state"] == "finished" and status(run_dir)["resumed_from"]["step"] >= 20
    ledger = trainwarden("nodes", run_dir)  # Slurm marked both down meanwhile: excluded for good
    assert "twnode2  excluded for good" in ledger and "twnode3  excluded for good" in ledger


def mark_down(*nodes: str) -> None:
    """What Slurm does to a dead node after SlurmdTimeout, at once."""
    subprocess.run(
        ["scontrol", "update", f"nodename={','.join(nodes)}", "state=down", "reason=test"], check=True, timeout=30
    )


def test_an_srun_that_fails_at_once_ends_the_attempt_at_once_and_charges_no_node(slurm, tmp_path):
    """srun refuses the step (here a GPU request on a cluster without GPUs): the launch fails within seconds, not
    after the 60 s agent timeout, says srun's own words, and no node is charged for it."""
    job, run_dir = submit(slurm, tmp_path, slurm_keys={"srun_args": ["--gres=gpu:1"]})
    code, out = finished(slurm, job, tmp_path)

    assert code == 1, out[-3000:]
    (failed,) = events(run_dir, "srun_failed")
    assert failed["said"] == "srun: error: Invalid generic resource (gres) specification"
    (started,) = events(run_dir, "agents_starting")
    assert journal_time(failed) - journal_time(started) < 10
    assert "could not launch ranks: srun exited with code 1 before every agent connected" in out
    assert not events(run_dir, "node_lost") and "no node has been charged" in trainwarden("nodes", run_dir)
