"""The batch host is no single point of failure: on the simulated Slurm cluster, the node that runs the job's batch
script and the supervisor crashes or is cut off, and the run goes on inside the same allocation, without a person.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, json_lines
from tests.slurm.test_multinode import (
    JOB_TIMEOUT_S,
    NODE_TIMEOUT_S,
    SLOWER,
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
    logged = json_lines(run_dir / "ranks" / "rank_0" / "events.jsonl")
    return min(t for e in logged if e.get("event") == "step" and (t := journal_time(e)) > since)


def test_a_crashed_batch_host_hands_the_run_to_a_successor_that_finishes_it(slurm, tmp_path, reference):
    """The batch host (twnode1: the supervisor and ranks 0-1) is powered off at step 12: the agents on twnode2 and
    twnode3 fence, twnode2's agent takes the lease and becomes the supervisor, which resumes from step 10 on the
    surviving node and the spare, finishes bitwise as an uninterrupted run, and ends the job (squeue empty)."""
    job, run_dir = submit(slurm, tmp_path, env=SLOWER)  # at full speed the 40 steps could end before the crash
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
    # The training past the checkpoint resumed counts as lost from the last step the ranks beat (not from the dead
    # supervisor's last state file: a crash just after a save was booked as lost 0 s, the steps past it as restart).
    # Beats are throttled (0.5 s): the successor hears of every step logged a second before the last one.
    logged = json_lines(run_dir / "ranks" / "rank_2" / "events.jsonl")
    stepped = [(journal_time(e), e["step"]) for e in logged if e["event"] == "step" and e["attempt"] == 0]
    (started,) = [e for e in events(run_dir, "supervisor_started") if e.get("predecessor_heard_step") is not None]
    heard = started["predecessor_heard_step"]
    assert heard >= max(step for at, step in stepped if at <= stepped[-1][0] - 1.0), (heard, stepped[-12:])
    if heard > final_resume(run_dir):
        (lost,) = events(run_dir, "work_lost")
        assert lost["last_step"] >= heard > lost["resume_step"] and lost["lost_s"] > 0
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode2": [0, 1], "twnode3": [2, 3]}
    final = status(run_dir)
    assert [n["state"] for n in final["nodes"] if n["node"] != "twnode1"] == ["ended", "ended"]
    assert final["resumed_from"]["step"] >= 10 and final["supervisor_host"] == "twnode2"
    took = first_step_after(run_dir, crashed_at) - crashed_at
    assert took < NODE_TIMEOUT_S + 30, f"first step {took:.1f} s after the crash"
    assert slurm.job_state(job) == "CANCELLED"  # the successor ended it: its batch script died with twnode1
    assert_same_training_state(run_dir, reference)
    assert not rank_pids(slurm, "twnode2", attempt=0)


def test_a_batch_host_crashed_while_the_controller_is_out_waits_for_it_then_the_successor_finishes(
    slurm, tmp_path, reference
):
    """slurmctld stopped, then the batch host crashes: twnode2's agent fences, finds the lease lapsed and the
    controller silent, and keeps its claim open for it (slurm.controller_wait_s) instead of leaving the run to
    nobody; once the controller is back it takes over, resumes on the nodes left, finishes bitwise as an
    uninterrupted run and ends the job."""
    job, run_dir = submit(slurm, tmp_path, slurm_keys={"controller_wait_s": 120}, env=SLOWER)
    wait_for_step(slurm, run_dir, 12)
    slurm.pause_controller()
    try:
        slurm.crash_node("twnode1")
        waiting = slurm.wait_for(
            lambda: events(run_dir, "successor_waiting_for_controller"), 60, "the candidate to wait for the controller"
        )
    finally:
        slurm.resume_controller()
    slurm.wait_for(lambda: status(run_dir).get("state") == "finished", JOB_TIMEOUT_S, "the successor to finish")
    slurm.wait_for(lambda: job not in queued_jobs(), 60, "the job to end")

    assert waiting[0]["node"] == "twnode2" and "waiting up to 120 s" in waiting[0]["why"]
    (claimed,) = events(run_dir, "successor_claimed")
    assert claimed["node"] == "twnode2" and journal_time(claimed) > journal_time(waiting[0])
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode2": [0, 1], "twnode3": [2, 3]}
    assert status(run_dir)["supervisor_host"] == "twnode2"
    assert_same_training_state(run_dir, reference)


def final_resume(run_dir: Path) -> int:
    return int(status(run_dir)["resumed_from"]["step"])


def test_a_stop_during_a_takeover_says_no_rank_runs_and_the_successor_ends_the_run_stopped_there(slurm, tmp_path):
    """The batch host crashes at step 12; once twnode2's agent has fenced its ranks (no rank runs anywhere, the dead
    supervisor's lease has not lapsed yet), `trainwarden stop` says so and names the step the run ends at, its newest
    complete state; the successor launches nothing, ends the run `stopped` there (exit 0) and the job, submits
    nothing, and goodput counts the steps trained past that state as lost work."""
    job, run_dir = submit(slurm, tmp_path, args=["--steps", str(STEPS_LONG)])
    wait_for_step(slurm, run_dir, 12)
    slurm.crash_node("twnode1")
    slurm.wait_for(lambda: no_rank_left(run_dir), 40, "twnode2's ranks fenced", interval=0.1)
    said = trainwarden("stop", run_dir)
    slurm.wait_for(lambda: status(run_dir).get("state") == "stopped", 60, "the successor to end the run stopped")
    slurm.wait_for(lambda: job not in queued_jobs(), 60, "the job to end")

    assert "no rank is running (the agents on twnode2 fenced their ranks" in said and "none can save now" in said, said
    newest = int(re.search(r"the run ends stopped at its newest complete state, step (\d+);", said).group(1))
    assert newest >= 10 and all(
        (run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{newest}.ckpt").is_file() for rank in range(4)
    )
    final = status(run_dir)
    assert final["stopped_at"]["step"] == newest and f"newest complete state, step {newest}" in final["reason"]
    assert final["supervisor_host"] == "twnode2" and not events(run_dir, "ranks_launched")[1:]  # it launched none
    # the stop file was there at the successor's start (stop_file_present) or came while it prepared (run_stopped)
    ended = events(run_dir, "stop_file_present") or events(run_dir, "run_stopped")
    assert [e["step"] for e in ended] == [newest]
    assert events(run_dir, "supervisor_exiting")[-1]["exit_code"] == 0
    assert slurm.job_state(job) == "CANCELLED" and not queued_jobs()  # ended by the successor; nothing resubmitted
    assert "the run ended with exit 0" in (run_dir / "supervisor" / "successor_2.log").read_text()
    heard = re.search(r"up to step (\d+) \(the last heard\)", said)
    if heard:  # trained past the newest complete state (a crash just after a save may leave nothing past it)
        (lost,) = [e for e in events(run_dir, "work_lost") if "stopped_at" in e]
        assert lost["stopped_at"] == newest and lost["last_step"] >= int(heard.group(1)) and lost["lost_s"] > 0


def no_rank_left(run_dir: Path) -> bool:
    """twnode2's agent fenced its ranks (twnode1's died with it): from here until a successor launches ranks, no rank
    runs, and `stop` can tell, though the dead supervisor's lease has not lapsed yet."""
    return any(e["node"] == "twnode2" for e in events(run_dir, "agent_fenced"))


def test_a_cut_off_batch_host_blames_itself_hands_over_and_adopts_the_successors_exit(slurm, tmp_path, reference):
    """The batch host's link goes down at step 12: its supervisor hears no other node, finds the Slurm controller
    out of reach, fences its own ranks, charges no node and abdicates; twnode2's agent takes over on twnode2 and the
    spare. The link comes back: the old supervisor waits as the job's keeper and exits with the successor's code, so
    the job ends COMPLETED as its batch script says; no healthy node is excluded for good."""
    job, run_dir = submit(slurm, tmp_path, env=SLOWER)
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
    assert "ended the run with exit code 0; the job's keeper exits with 0" in out  # the keeper says what it passes on
    assert_same_training_state(run_dir, reference)
    ledger = trainwarden("nodes", run_dir)
    assert "twnode1  cooling down" in ledger and "for good" not in ledger
    assert "forgot every fault of twnode1" in trainwarden("nodes", run_dir, "--forget", "twnode1")
    assert "twnode1  usable" in trainwarden("nodes", run_dir)


def trainwarden(*args: object) -> str:
    return subprocess.run([TRAINWARDEN, *map(str, args)], capture_output=True, text=True, timeout=30, check=True).stdout


def submit_demo(tmp_path: Path) -> tuple[int, Path]:
    """`sbatch -N3 examples/slurm/demo.sbatch` from `tmp_path`, as an operator submits it, shortened through
    TRAINWARDEN_SET: (the job, the run dir)."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    overrides = (
        f'args=["--steps","{STEPS_LONG // 4}"] slurm.node_timeout_s={NODE_TIMEOUT_S:g} '
        "worker.save_checkpoint_steps=10 stop.kill_grace_s=1"
    )
    env = {**os.environ, "PATH": f"{TRAINWARDEN.parent}:{os.environ['PATH']}", "TRAINWARDEN_SET": overrides}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-N3", "examples/slurm/demo.sbatch"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(submitted.stdout.split(";")[0]), tmp_path / "runs" / "slurm-demo"


def test_two_lost_nodes_end_the_job_75_and_the_examples_resubmission_finishes_the_run(slurm, tmp_path):
    """`sbatch -N3 examples/slurm/demo.sbatch`, config overrides through TRAINWARDEN_SET: twnode2 crashes (declared
    at once: its agent's stream breaks; the spare takes its place), then twnode3 (no spare left): exit 75, and the
    script resubmits itself with a node range and the lost nodes excluded, which Slurm can meet (twnode1 and
    twnode4). In that job the supervisor process alone is SIGKILLed on its healthy batch host (the OOM killer, an
    admin): the script starts a fresh one there, which takes the run over at once, charges no node, and finishes the
    run; the job ends COMPLETED 0 and the queue is empty. (The test marks the crashed nodes down in Slurm itself
    rather than wait the ~40 s of SlurmdTimeout for the first job to complete.)"""
    first, run_dir = submit_demo(tmp_path)
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
    slurm.wait_for(lambda: training_on(run_dir, {"twnode1", "twnode4"}, 30), 120, "the second job at step 30")
    (killed,) = supervisors(slurm, "twnode1")
    os.kill(killed, signal.SIGKILL)  # the supervisor alone: its host, its agents and the batch script live on
    assert slurm.wait_job(second, JOB_TIMEOUT_S) == ("COMPLETED", 0)
    assert not queued_jobs()

    (replaced,) = events(run_dir, "supervisor_replaced")
    assert (replaced["node"], replaced["lease"], replaced["charged"]) == ("twnode1", "held", None)
    assert not [e for e in events(run_dir, "node_lost") if e["node"] in ("twnode1", "twnode4")]
    second_log = (run_dir / "logs" / f"slurm_job_{second}.out").read_text()
    assert "the supervisor exited 137; if it died before the run ended, a fresh one takes over" in second_log
    assert "the run's exit code: 0" in second_log and not supervisors(slurm, "twnode1")

    log = (run_dir / "logs" / f"slurm_job_{first}.out").read_text()
    assert "needs 2 nodes, 1 usable left" in log and not list(tmp_path.glob("slurm-*.out"))
    resubmitted = slurm.job_info(second)
    assert resubmitted["ExcNodeList"] == "twnode[2-3]" and resubmitted["NumNodes"] == "2"
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode1": [0, 1], "twnode4": [2, 3]}
    assert status(run_dir)["state"] == "finished" and status(run_dir)["resumed_from"]["step"] >= 20
    ledger = trainwarden("nodes", run_dir)  # Slurm marked both down meanwhile: excluded for good
    assert "twnode2  excluded for good" in ledger and "twnode3  excluded for good" in ledger


def test_two_batch_host_crashes_with_one_spare_end_in_a_next_job_that_slurm_can_run_and_that_finishes(slurm, tmp_path):
    """`sbatch -N3 examples/slurm/demo.sbatch` on 4 nodes: the batch host crashes (twnode2's agent takes over, on
    twnode2 and the spare twnode3), then the successor's host: twnode3's agent takes over with one node left, exits
    75, and, the batch script being gone, submits the job's script again for `--nodes=2-3` away from the two lost
    nodes and ends this job; the next job runs on twnode3 and the free twnode4 and finishes the run, and no job is
    left pending (a requeue would keep NumNodes=3 with two of four nodes excluded: pending for ever)."""
    first, run_dir = submit_demo(tmp_path)
    slurm.wait_for(lambda: training_on(run_dir, {"twnode1", "twnode2"}, 12), 120, "step 12")
    slurm.crash_node("twnode1")
    slurm.wait_for(lambda: training_on(run_dir, {"twnode2", "twnode3"}, 24), 120, "the successor at step 24")
    slurm.crash_node("twnode2")
    mark_down("twnode1", "twnode2")  # Slurm drops them from the job: the last successor has one node
    second = slurm.wait_for(lambda: [j for j in queued_jobs() if j != first], 60, "the next job")[0]
    assert slurm.wait_job(first, JOB_TIMEOUT_S)[0] == "CANCELLED"  # ended by the last successor
    assert slurm.wait_job(second, JOB_TIMEOUT_S) == ("COMPLETED", 0)
    assert not queued_jobs()

    nextjob = slurm.job_info(second)
    assert (nextjob["ExcNodeList"], nextjob["NumNodes"], nextjob["JobName"]) == ("twnode[1-2]", "2", "trainwarden-demo")
    assert [e["node"] for e in events(run_dir, "successor_claimed")] == ["twnode2", "twnode3"]
    said = (run_dir / "supervisor" / "successor_3.log").read_text()
    assert f"exit 75, requeue me: job {second} carries on once job {first} ended" in said
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode3": [0, 1], "twnode4": [2, 3]}
    assert status(run_dir)["state"] == "finished" and status(run_dir)["resumed_from"]["step"] >= 20


def training_on(run_dir: Path, nodes: set[str], step: int) -> bool:
    """Whether the run trains on `nodes` with every rank at `step` or later."""
    now = status(run_dir)
    placed = events(run_dir, "ranks_placed") if (run_dir / "supervisor" / "events.jsonl").is_file() else []
    return (
        bool(placed)
        and set(placed[-1]["nodes"]) == nodes
        and now.get("state") == "running"
        and all((rank.get("step") or 0) >= step for rank in now.get("ranks", []))
    )


def supervisors(slurm: Any, node: str) -> list[int]:
    """Host pids of the `trainwarden run` processes on `node`."""
    found = []
    for pid in slurm.netns_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"trainwarden") for arg in argv[:2]) and b"run" in argv:
            found.append(pid)
    return found


def mark_down(*nodes: str) -> None:
    """What Slurm does to a dead node after SlurmdTimeout, at once; again while a reply the crashed slurmd sent just
    before it died returns the node to service behind our back (seen: 0.3 s after the update)."""
    deadline = time.monotonic() + 30
    while True:
        subprocess.run(
            ["scontrol", "update", f"nodename={','.join(nodes)}", "state=down", "reason=test"], check=True, timeout=30
        )
        time.sleep(1.0)
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True, text=True, timeout=30
        ).stdout
        if all(state.startswith("down") for _, state in (line.split() for line in out.splitlines())):
            return
        assert time.monotonic() < deadline, f"Slurm keeps {' '.join(nodes)} up: {out}"


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


TIME_LIMIT_MARGIN_S = 45.0  # slurm.time_limit_margin_s of the time-limit test (its batch script has no --signal)


def test_a_time_limit_after_a_takeover_saves_at_an_agreed_step_and_the_next_job_resumes_there(slurm, tmp_path):
    """The batch host crashes, and with it the batch shell that Slurm's time-limit warning would reach: the
    successor reads the job's end time from Slurm itself. Once it trains, the limit is cut to a minute or two
    (`scontrol update TimeLimit=`, read again within 30 s): the margin before the end, every rank saves at one agreed
    step (`time_limit_near`), the successor exits 75 and has the job carried on, and the next job resumes there."""
    job, run_dir = submit(
        slurm,
        tmp_path,
        args=["--steps", str(10 * STEPS_LONG)],  # the time limit ends it, long before its last step
        slurm_keys={"time_limit_margin_s": TIME_LIMIT_MARGIN_S},
    )
    wait_for_step(slurm, run_dir, 12)
    slurm.crash_node("twnode1")
    wait_for_step(slurm, run_dir, 14, attempt=1)
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job)],
        env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    started = int(re.search(r"StartTime=(\d+)", shown).group(1))
    # Whole minutes (Slurm's unit): the end comes 50-110 s from now, the margin 5-65 s from now.
    minutes = math.ceil((time.time() - started + TIME_LIMIT_MARGIN_S + 5) / 60)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], check=True, timeout=30)
    slurm.wait_for(lambda: events(run_dir, "run_stopped"), 120, "the successor to stop before the time limit")

    (near,) = events(run_dir, "time_limit_near")
    assert (near["margin_s"], near["phase"]) == (TIME_LIMIT_MARGIN_S, "running") and near["left_s"] > 0
    (stopped,) = events(run_dir, "run_stopped")
    assert stopped["source"] == f"ends {near['end_time']}, margin {TIME_LIMIT_MARGIN_S:g} s"
    step = stopped["step"]
    for rank in range(4):
        assert (run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{step}.ckpt").is_file()
    exiting = slurm.wait_for(lambda: events(run_dir, "supervisor_exiting"), 30, "the successor to exit")
    assert exiting[-1]["exit_code"] == 75
    assert not events(run_dir, "time_limit_reached")  # it ended before Slurm's SIGTERM
    slurm.wait_for(  # the job the successor leaves to carry the run on (its batch script is gone)
        lambda: [e for e in events(run_dir, "ranks_launched") if e.get("resume_step") == step],
        150,
        f"the next job to resume from step {step}",
    )
