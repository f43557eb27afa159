"""Multi-node runs on the simulated Slurm cluster: the real supervisor in an sbatch job, node agents in srun
steps on 2 of 3 nodes (each node its own network and pid namespace), the real 2x2-rank gloo demo.

Every failure is real: a rank SIGKILLed on the second node, a rank hung across nodes, a node crashed (every
process in it SIGKILLed, slurmd included), a node cut off the network, a node whose ranks keep dying.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.rundir.rank_logs import last_step
from tests.checkpoint_files import assert_bitwise_equal, load_saved
from tests.e2e.conftest import REPO, journal, write_config
from worker.contract import RunLayout

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

STEPS = 40
# Every rank 0.1 s slower per step (the numbers stay the same): a wide window at the step a test acts at.
SLOWER = {"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": ",".join(f"{rank}:slow@1:0.1" for rank in range(4))}
NODE_TIMEOUT_S = 6.0
JOB_TIMEOUT_S = 180.0
TRAINWARDEN = Path(sys.executable).parent / "trainwarden"


def submit(
    slurm: Any,
    tmp_path: Path,
    *,
    sbatch: tuple[str, ...] = ("-N3",),
    name: str = "job",
    slurm_keys: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[int, Path]:
    """An sbatch job running the supervisor on a 2-node x 2-rank demo config (one spare of 3 nodes)."""
    run_dir = tmp_path / "run"
    config = {
        "nodes": 2,
        "nproc_per_node": 2,
        "spare_nodes": 1,
        "args": ["--steps", str(STEPS)],
        "slurm": {"node_timeout_s": NODE_TIMEOUT_S, **(slurm_keys or {})},
        **overrides,
    }
    job_yaml = write_config(tmp_path / f"{name}.yaml", **config)
    script = tmp_path / f"{name}.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --no-kill\n#SBATCH --output={tmp_path}/{name}-%j.out\n"
        f"exec {sys.executable} -m supervisor run {job_yaml} --run-dir {run_dir}\n"
    )
    return slurm.sbatch(list(sbatch), script, cwd=REPO), run_dir


def finished(slurm: Any, job: int, tmp_path: Path, name: str = "job") -> tuple[int, str]:
    """(the job's exit code, its output) once it ended."""
    _, code = slurm.wait_job(job, JOB_TIMEOUT_S)
    return code, (tmp_path / f"{name}-{job}.out").read_text()


def status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "supervisor" / "state.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def wait_for_step(slurm: Any, run_dir: Path, step: int, attempt: int = 0) -> None:
    """Until every rank of `attempt` reported `step` or later (the supervisor's status, once a second)."""

    def reached() -> bool:
        now = status(run_dir)
        return (
            now.get("attempt") == attempt
            and now.get("state") == "running"
            and all((rank.get("step") or 0) >= step for rank in now["ranks"])
        )

    slurm.wait_for(reached, 120, f"every rank of attempt {attempt} at step {step}")


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in journal(run_dir) if e["event"] == name]


def final_states(run_dir: Path) -> list[dict[str, Any]]:
    return [load_saved(run_dir / "checkpoint" / f"rank_{r}" / f"demo_rank_{r}-{STEPS}.ckpt") for r in range(4)]


def assert_same_training_state(run_dir: Path, reference: list[dict[str, Any]]) -> None:
    for rank, (got, want) in enumerate(zip(final_states(run_dir), reference, strict=True)):
        for part in ("model", "optimizer", "scheduler", "rng", "data_position"):
            assert_bitwise_equal(got[part], want[part], f"rank {rank} {part}")


def rank_pids(slurm: Any, node: str, attempt: int) -> dict[int, int]:
    """Host pids of the rank processes of `attempt` running in `node` (found through their environment)."""
    found = {}
    for pid in slurm.netns_pids(node):
        try:
            items = Path(f"/proc/{pid}/environ").read_text().split("\0")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in items if "=" in item)
        if env.get("TRAINWARDEN_ATTEMPT") == str(attempt) and "RANK" in env and "demo_train" in _cmdline(pid):
            found[int(env["RANK"])] = pid
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def journal_time(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def test_a_rank_crash_on_the_second_node_is_recovered_in_place_on_both_nodes_and_resumes_bitwise(
    slurm, tmp_path, reference
):
    """Rank 3 SIGKILLed on twnode2: the agents and their step stay; ranks 0-2 unwind and go on in their processes
    (on both nodes), twnode2's agent starts rank 3 anew beside rank 2, and the run ends as the uninterrupted one."""
    job, run_dir = submit(slurm, tmp_path, env={"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": "3:sigkill@15"})
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    (crash,) = events(run_dir, "rank_crashed")
    assert (crash["rank"], crash["node"], crash["returncode"]) == (3, "twnode2", -signal.SIGKILL)
    placed = [e["nodes"] for e in events(run_dir, "ranks_placed")]
    assert placed == [{"twnode1": [0, 1], "twnode2": [2, 3]}] * 2  # one failure is no reason to drop a node
    assert len(events(run_dir, "agents_starting")) == 1  # no second step: the agents outlived the attempt
    (recovered,) = events(run_dir, "recovered_in_place")
    first = events(run_dir, "ranks_launched")[0]["pids"]
    kept, replaced = recovered["kept"], recovered["replaced"]
    assert 3 in replaced and kept and sorted(kept + replaced) == [0, 1, 2, 3]
    assert [recovered["pids"][r] for r in kept] == [first[r] for r in kept]  # as each node sees them
    # A survivor may wait in gloo on a peer that unwound but keeps its connection open: it leaves after
    # worker.recovery.STUCK_S and is replaced too; no rank is replaced for any other reason.
    for rank in set(replaced) - {3}:
        said = (run_dir / "logs" / "attempt_0" / f"rank_{rank}.err").read_text()
        assert "training function 3 s after the word to unwind" in said, rank
    assert status(run_dir)["resumed_from"]["step"] == 10
    assert_same_training_state(run_dir, reference)


def test_a_hang_across_nodes_dumps_stacks_of_every_rank_on_every_node_before_the_kill(slurm, tmp_path, reference):
    job, run_dir = submit(
        slurm,
        tmp_path,
        env={"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": "2:hang@15"},
        hang={"phase_timeouts_s": {"train": 8}, "calibration": {"enabled": False}},
    )
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    (hang,) = events(run_dir, "hang_detected")
    (collected,) = events(run_dir, "stacks_collected")
    assert collected["culprit"] == 2  # it issued no more collectives (flight recorder), on the second node
    # The journal carries the final verdict, with its node; a host-side hang is the program's: no node is charged.
    assert (hang["rank"], hang["node"], hang["class"], hang["named_by"]) == (
        2,
        "twnode2",
        "host-side",
        "flight_recorder",
    )
    assert (
        not (run_dir / "supervisor" / "nodes.json").exists()
        or "hang" not in (run_dir / "supervisor" / "nodes.json").read_text()
    )
    for rank in range(4):
        dump = run_dir / "ranks" / f"rank_{rank}" / "stacks_attempt_0.txt"
        assert str(dump) in collected["paths"] and "File" in dump.read_text()
    assert journal_time(collected) < journal_time(events(run_dir, "ranks_signalled")[0])  # stacks, then kill
    assert_same_training_state(run_dir, reference)


def test_a_partitioned_node_is_declared_within_the_node_timeout_fenced_off_and_forgiven_after_its_cool_down(
    slurm, tmp_path, reference
):
    """twnode2 cut off at step 12: declared lost within the node timeout, its own agent has killed its ranks, the
    spare takes its place beside twnode1's ranks, which recover in place (one the cut caught inside a collective is
    replaced after STUCK_S); its link back before Slurm noticed, it is a spare again after its 4 s cool-down."""
    job, run_dir = submit(
        slurm,
        tmp_path,
        slurm_keys={"node_cooldown_s": 4},
        env=SLOWER,
    )
    wait_for_step(slurm, run_dir, 12)
    old_ranks = rank_pids(slurm, "twnode2", attempt=0)
    assert sorted(old_ranks) == [2, 3]
    cut_at = time.time()
    slurm.partition("twnode2")
    slurm.wait_for(lambda: events(run_dir, "node_lost"), NODE_TIMEOUT_S + 5, "twnode2 declared lost")
    (lost,) = events(run_dir, "node_lost")
    # Its agent's last word came up to one message interval and a poll (1.2 s) before the cut, more on a loaded host.
    assert lost["node"] == "twnode2" and NODE_TIMEOUT_S - 2 < journal_time(lost) - cut_at < NODE_TIMEOUT_S + 1
    # Cut off, its agent heard no ping for half the node timeout and killed its ranks: no split job.
    assert not rank_pids(slurm, "twnode2", attempt=0)
    slurm.heal("twnode2")
    slurm.wait_for(
        lambda: {"node": "twnode2", "state": "spare"} in status(run_dir)["nodes"],
        20,
        "twnode2 forgiven after its cool-down",
    )
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    assert [e["nodes"] for e in events(run_dir, "ranks_placed")][-1] == {"twnode1": [0, 1], "twnode3": [2, 3]}
    # twnode1's ranks unwind and go on in place beside the spare's, unless the cut caught one inside a collective with
    # the lost ones: gloo cannot be aborted and a cut closes no connection, so it leaves after worker.recovery.STUCK_S,
    # saying so, and is replaced (which of twnode1's ranks stay is a race with the cut; if none does, all relaunch).
    recovered = events(run_dir, "recovered_in_place")
    if recovered:
        kept, replaced = recovered[0]["kept"], recovered[0]["replaced"]
        assert set(kept) <= {0, 1} and sorted(kept + replaced) == [0, 1, 2, 3], recovered
    else:
        (relaunched,) = events(run_dir, "relaunched")
        assert relaunched["reason"] == "no rank survived the failure", relaunched
        kept = []
    for rank in {0, 1} - set(kept):
        log = (run_dir / "logs" / "attempt_0" / f"rank_{rank}.err").read_text()
        assert "still in attempt 0's training function" in log, (rank, log[-2000:])
    assert_same_training_state(run_dir, reference)


def test_a_node_crashed_while_the_controller_is_out_of_reach_waits_for_it_and_the_run_finishes(
    slurm, tmp_path, reference
):
    """slurmctld stopped, then twnode2 crashed at step 12: the node is lost at once (its agent's stream broke), but
    nobody is isolated: the controller is not the network. The relaunch's step waits for the controller
    (`controller_unreachable`), starts once it answers (`controller_back`) on twnode1 and the spare, and the run
    finishes, exit 0, bitwise as the uninterrupted one."""
    job, run_dir = submit(
        slurm,
        tmp_path,
        slurm_keys={"controller_wait_s": 120},
        env=SLOWER,
    )
    wait_for_step(slurm, run_dir, 12)
    slurm.pause_controller()
    try:
        slurm.crash_node("twnode2")
        slurm.wait_for(lambda: events(run_dir, "controller_unreachable"), 60, "the relaunch waiting for the controller")
    finally:
        slurm.resume_controller()
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    assert [e["node"] for e in events(run_dir, "node_lost")] == ["twnode2"]
    assert not events(run_dir, "supervisor_isolated")
    assert len(events(run_dir, "controller_unreachable")) == len(events(run_dir, "controller_back")) == 1
    assert [e["nodes"] for e in events(run_dir, "ranks_placed")][-1] == {"twnode1": [0, 1], "twnode3": [2, 3]}
    assert status(run_dir)["state"] == "finished"
    assert_same_training_state(run_dir, reference)


def test_a_crashed_node_s_ranks_resume_on_the_spare_from_their_partner_s_copy_in_memory(slurm, tmp_path, reference):
    """Snapshots every step in each node's memory (its own /dev/shm), disk saves every 20: twnode2 crashes after step
    25. Its ranks' newest snapshot died with it; twnode1's agent holds their partner copy. The relaunch on twnode1 and
    the spare resumes from it (`memory (peer twnode1)`), at most one snapshot and the copy under way behind rank 2's
    last step, never from disk's step 20, and ends bitwise as the uninterrupted run; every node's memory goes."""
    job, run_dir = submit(
        slurm,
        tmp_path,
        worker={"prefix": "demo", "save_checkpoint_steps": 20, "snapshot_steps": 1},
        env=SLOWER,
    )
    wait_for_step(slurm, run_dir, 25)
    slurm.crash_node("twnode2")
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    assert [e["node"] for e in events(run_dir, "node_lost")] == ["twnode2"]
    crashed_at = last_step(RunLayout(run_dir), 2, 0)
    launched = events(run_dir, "ranks_launched")[-1]
    assert launched["resume_source"] == "memory (peer twnode1)", launched
    assert crashed_at is not None and crashed_at - 2 <= launched["resume_step"] <= crashed_at
    assert [e["nodes"] for e in events(run_dir, "ranks_placed")][-1] == {"twnode1": [0, 1], "twnode3": [2, 3]}
    persisted = {(e["node"], e["step"]) for e in events(run_dir, "snapshot_persisted")}
    assert {("twnode1", 20), ("twnode2", 20), ("twnode1", 40), ("twnode3", 40)} <= persisted, persisted
    assert_same_training_state(run_dir, reference)
    for node in ("twnode1", "twnode3"):  # the run ended: its memory on every node went with it
        assert slurm.node_files(node, "/dev/shm") == [], node


def test_a_node_whose_ranks_keep_dying_is_excluded_and_replaced_by_the_spare(slurm, tmp_path):
    # Steps of 0.1 s at least: at full speed an attempt could end before it was seen at step 13 (or the first kill
    # came at step 25, and the resumed attempt trained its last 15 steps between two looks at the status).
    job, run_dir = submit(slurm, tmp_path, env=SLOWER)
    for attempt in (0, 1):
        wait_for_step(slurm, run_dir, 5 + 8 * attempt, attempt=attempt)
        os.kill(rank_pids(slurm, "twnode2", attempt)[3], signal.SIGSEGV)
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    placed = [e["nodes"] for e in events(run_dir, "ranks_placed")]
    assert [sorted(p) for p in placed] == [["twnode1", "twnode2"]] * 2 + [["twnode1", "twnode3"]]
    (excluded,) = events(run_dir, "node_excluded")
    assert excluded["node"] == "twnode2" and "failed 2 times" in excluded["why"] and "SIGSEGV" in excluded["why"]


def test_too_few_healthy_nodes_exit_75_naming_the_node_and_a_resubmission_without_it_resumes(slurm, tmp_path):
    job, run_dir = submit(slurm, tmp_path, sbatch=("-N2",), spare_nodes=0)
    wait_for_step(slurm, run_dir, 12)
    slurm.crash_node("twnode2")
    code, out = finished(slurm, job, tmp_path)
    assert code == 75, out[-3000:]
    assert "--exclude=twnode2" in out
    assert "run interrupted (resubmit): not launched: needs 2 nodes, 1 usable left" in out
    listed = subprocess.run(
        [TRAINWARDEN, "status", "--excluded-nodes", run_dir], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert listed == "twnode2\n"

    slurm.restore_node("twnode2")  # back in service, but this run's ledger remembers it
    again, _ = submit(slurm, tmp_path, sbatch=("-N2", "-w", "twnode1,twnode2"), name="again", spare_nodes=0)
    code, out = finished(slurm, again, tmp_path, "again")
    assert code == 75 and "twnode2 (lost" in out, out[-3000:]
    assert len(events(run_dir, "ranks_placed")) == 1  # refused before anything was launched

    elsewhere, _ = submit(
        slurm, tmp_path, sbatch=("-N2", f"--exclude={listed.strip()}"), name="elsewhere", spare_nodes=0
    )
    code, out = finished(slurm, elsewhere, tmp_path, "elsewhere")
    assert code == 0, out[-3000:]
    assert "twnode2" not in events(run_dir, "ranks_placed")[-1]["nodes"]
    assert status(run_dir)["resumed_from"]["step"] >= 10


def test_trainwarden_stop_saves_one_agreed_step_on_every_node_and_status_shows_the_nodes(slurm, tmp_path):
    job, run_dir = submit(slurm, tmp_path, args=["--steps", "400"])
    wait_for_step(slurm, run_dir, 8)
    shown = subprocess.run(
        [TRAINWARDEN, "status", run_dir], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "node twnode1: running, ranks 0-1" in shown and "node twnode2: running, ranks 2-3" in shown
    assert "node twnode3: spare" in shown and f"slurm job {job}" in shown
    subprocess.run([TRAINWARDEN, "stop", run_dir], capture_output=True, timeout=30, check=True)
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    (stopped,) = events(run_dir, "run_stopped")
    step = stopped["step"]
    for rank in range(4):
        assert (run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{step}.ckpt").is_file()


@pytest.mark.parametrize(
    ("scancel", "exit_code"),
    [
        (["--signal=TERM"], 0),  # to every process of the steps: the agents pass it on, ranks save and exit
        (["--batch", "--signal=TERM"], 0),  # to the batch script, which is the supervisor
        (["--batch", "--signal=USR1"], 75),  # the time-limit warning form (--signal=B:USR1@N): save, then requeue me
    ],
)
def test_slurm_signals_stop_every_node_at_one_saved_step(slurm, tmp_path, scancel, exit_code):
    job, run_dir = submit(slurm, tmp_path, args=["--steps", "400"])
    wait_for_step(slurm, run_dir, 8)
    subprocess.run(["scancel", *scancel, str(job)], check=True, timeout=30)
    code, out = finished(slurm, job, tmp_path)

    assert code == exit_code, out[-3000:]
    (stopped,) = events(run_dir, "run_stopped")
    step = stopped["step"]
    for rank in range(4):
        assert (run_dir / "checkpoint" / f"rank_{rank}" / f"demo_rank_{rank}-{step}.ckpt").is_file()
    assert not events(run_dir, "rank_crashed")


def test_the_readme_demo_sbatch_stops_on_the_time_limit_warning_and_resubmits_itself(slurm, tmp_path):
    """`sbatch -N3 examples/slurm/demo.sbatch` from a checkout, as docs/slurm.md says: the USR1 warning saves at
    an agreed step, the supervisor exits 75 and the script chains a new job on the same run dir."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env_path = f"{TRAINWARDEN.parent}:{os.environ['PATH']}"  # `trainwarden` on PATH, as the manual assumes
    job = int(
        subprocess.run(
            ["sbatch", "--parsable", "-N3", "examples/slurm/demo.sbatch"],
            cwd=tmp_path,
            env={**os.environ, "PATH": env_path},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split(";")[0]
    )
    run_dir = tmp_path / "runs" / "slurm-demo"
    wait_for_step(slurm, run_dir, 5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], check=True, timeout=30)
    code = slurm.wait_job(job, JOB_TIMEOUT_S)
    out = (run_dir / "logs" / f"slurm_job_{job}.out").read_text()  # the script's output, in the run dir's logs

    assert code == ("FAILED", 75), out[-3000:]
    (stopped,) = events(run_dir, "run_stopped")
    assert stopped["source"] == "SIGUSR1"
    chained = slurm.wait_for(lambda: [j for j in queued_jobs() if j != job], 30, "the resubmitted job")
    info = slurm.job_info(chained[0])
    assert info["JobName"] == "trainwarden-demo"  # it resumes runs/slurm-demo; reset ends it
    # nodes to nodes + spares, whatever Slurm has (once it runs, NumNodes says what it got, not what it asked)
    assert "chaining the next job: sbatch --nodes=2-3\n" in out
    assert not list(tmp_path.glob("slurm-*.out"))  # nothing lands beside the checkout


def queued_jobs() -> list[int]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [int(job) for job in out.split()]


@pytest.mark.skipif(not __import__("importlib").util.find_spec("numpy"), reason="DCP's collectives need NumPy")
def test_with_no_spare_and_min_nodes_1_a_lost_node_leaves_the_run_to_finish_shrunk_and_a_full_job_grows_back(
    slurm, tmp_path
):
    """The FSDP2 example with sharded checkpoints on 2 nodes x 2 ranks, no spare: twnode2 crashes, the run goes on
    with twnode1's 2 ranks from the newest checkpoint (resharded) and finishes; a later job on 2 nodes resumes it
    on 4 ranks again."""
    fsdp = {
        "script": str(REPO / "examples" / "fsdp_train.py"),
        "spare_nodes": 0,
        "slurm_keys": {"min_nodes": 1},
        "worker": {
            "checkpoint_format": "dcp",
            "prefix": "fsdp",
            "save_checkpoint_steps": 5,
            "feature_value_check": {"level": 0},
        },
        "args": ["--steps", str(STEPS), "--batch-size", "2", "--block", "32", "--n-embd", "32"],
    }
    job, run_dir = submit(slurm, tmp_path, sbatch=("-N2",), **fsdp)
    wait_for_step(slurm, run_dir, 12)
    slurm.crash_node("twnode2")
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    (shrunk,) = events(run_dir, "run_shrunk")
    assert (shrunk["nodes"], shrunk["of_nodes"], shrunk["world_size"]) == (1, 2, 2)
    assert events(run_dir, "ranks_placed")[-1]["nodes"] == {"twnode1": [0, 1]}
    assert status(run_dir)["world_size"] == 2 and status(run_dir)["last_checkpoint"] == {"step": STEPS}
    assert events(run_dir, "goodput")[-1]["shrunk_s"] > 0

    fsdp["args"][1] = str(STEPS + 10)
    again, _ = submit(slurm, tmp_path, sbatch=("-N2", "--exclude=twnode2"), name="again", **fsdp)
    code, out = finished(slurm, again, tmp_path, "again")
    assert code == 0, out[-3000:]
    assert status(run_dir)["world_size"] == 4 and status(run_dir)["last_checkpoint"] == {"step": STEPS + 10}
    grown = [json.loads(line) for line in (run_dir / "ranks" / "rank_3" / "events.jsonl").read_text().splitlines()]
    changed = [e for e in grown if e["event"] == "world_size_changed"]
    assert (changed[-1]["saved_world_size"], changed[-1]["world_size"]) == (2, 4)


def test_a_persistent_bit_flip_on_one_node_gets_it_excluded_and_the_run_finishes_on_the_spare(slurm, tmp_path):
    """twnode2's local rank 1 flips a gradient bit at every backward from step 10, re-runs included (the fault
    stays with twnode2, whatever rank runs there): a re-run names it persistent, every rank leaves with
    EXIT_BAD_DEVICE, the ledger excludes twnode2 for good at once, and the run finishes on twnode1 and the spare.
    Rank 0's batch 19 is poisoned: the data's, skipped, and no node is charged for it."""
    faults = "twnode2/1:bitflip_persistent@10,0:poison@20"
    job, run_dir = submit(slurm, tmp_path, env={"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": faults})
    code, out = finished(slurm, job, tmp_path)

    assert code == 0, out[-3000:]
    placed = [e["nodes"] for e in events(run_dir, "ranks_placed")]
    assert [sorted(p) for p in placed] == [["twnode1", "twnode2"], ["twnode1", "twnode3"]]
    flipped = placed[0]["twnode2"][1]
    (verdict,) = events(run_dir, "sdc_verdict")
    assert (verdict["rank"], verdict["node"], verdict["verdict"], verdict["step"]) == (
        flipped,
        "twnode2",
        "persistent",
        10,
    )
    (excluded,) = events(run_dir, "node_excluded")
    assert excluded["node"] == "twnode2" and excluded["why"].startswith("for good: persistent silent data corruption")
    ledger = json.loads((run_dir / "supervisor" / "nodes.json").read_text())
    assert [(f["node"], f["kind"]) for f in ledger["faults"]] == [("twnode2", "sdc")]  # the poison charged no one
    skipped = [e for e in map(json.loads, (run_dir / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines())]
    data = [e for e in skipped if e["event"] == "sdc_verdict" and e["verdict"] == "data"]
    assert [(e["attempt"], e["step"], e["suspect"]) for e in data] == [(1, 20, 0)]
    shown = subprocess.run([TRAINWARDEN, "status", str(run_dir)], capture_output=True, text=True).stdout
    assert "device verdict on twnode2 at " in shown
