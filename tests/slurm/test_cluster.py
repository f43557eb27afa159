"""The simulated Slurm cluster itself: placement, a node crash, a partition, pid namespaces."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def srun(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", *args], capture_output=True, text=True, timeout=timeout, check=True)


def test_srun_places_tasks_on_two_nodes(slurm):
    out = srun("-N2", "--ntasks-per-node=1", "hostname").stdout.split()
    assert len(out) == 2 and len(set(out)) == 2 and all(h.startswith("twnode") for h in out), out


def test_no_kill_job_survives_a_node_crash_and_the_node_comes_back(slurm, tmp_path: Path):
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nsrun -N2 --ntasks-per-node=1 sleep 300 &\nwhile :; do echo . >> beats; sleep 0.1; done\n"
    )
    job = slurm.sbatch(["--no-kill", "-N2", "-w", "twnode1,twnode2", "-o", "slurm.out"], script, cwd=tmp_path)
    slurm.wait_for(lambda: "sleep" in slurm.node_procs("twnode2"), 30, "task on twnode2")
    assert slurm.job_info(job)["BatchHost"] == "twnode1"
    slurm.wait_for(lambda: (tmp_path / "beats").exists(), 10, "the batch script's first beat")

    slurm.crash_node("twnode2")
    assert slurm.netns_pids("twnode2") == []
    beats = len((tmp_path / "beats").read_text().splitlines())
    slurm.wait_for(lambda: len((tmp_path / "beats").read_text().splitlines()) >= beats + 5, 10, "more beats")
    assert slurm.job_state(job) == "RUNNING"

    slurm.restore_node("twnode2", timeout=30)  # before Slurm's verdict: the job still holds the node
    assert slurm.node_state("twnode2") in ("mix", "alloc"), slurm.node_state("twnode2")
    assert srun(f"--jobid={job}", "--overlap", "-N1", "-w", "twnode2", "hostname").stdout.split() == ["twnode2"]
    subprocess.run(["scancel", str(job)], check=True)
    assert slurm.wait_job(job, 30)[0] == "CANCELLED"
    slurm.wait_for(lambda: slurm.node_idle("twnode2"), 15, "twnode2 idle")


def test_partition_cuts_the_node_off_and_heal_reconnects_it(slurm):
    slurm.partition("twnode2")
    cut = subprocess.Popen(["srun", "-N1", "-w", "twnode2", "hostname"], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # srun takes ~0.05 s when the node is reachable
            cut.wait(timeout=3)
    finally:
        cut.kill()
        cut.communicate()
    slurm.heal("twnode2")
    assert srun("-N1", "-w", "twnode2", "hostname", timeout=20).stdout.split() == ["twnode2"]


def test_each_node_has_its_own_pid_namespace(slurm):
    held = subprocess.Popen(["srun", "-N1", "-w", "twnode1", "sleep", "61.5"])  # only on twnode1
    try:
        slurm.wait_for(lambda: "sleep" in slurm.node_procs("twnode1"), 20, "sleep on twnode1")
        ps = "echo $(hostname) $(readlink /proc/self/ns/pid); ps -eo args="
        out = srun("-N2", "--ntasks-per-node=1", "-w", "twnode1,twnode2", "--label", "sh", "-c", ps).stdout
    finally:
        held.kill()
        held.wait()
    seen = {0: [], 1: []}
    for line in out.splitlines():
        task, _, text = line.partition(": ")
        seen[int(task)].append(text.strip())
    (host1, ns1), (host2, ns2) = (seen[0][0].split(), seen[1][0].split())
    assert (host1, host2) == ("twnode1", "twnode2") and ns1 != ns2
    assert "/usr/bin/sleep 61.5" in seen[0] and "/usr/bin/sleep 61.5" not in seen[1]
    # each node sees its own slurmd only, under a small pid of its own
    assert [a for a in seen[0] if a.startswith("/usr/sbin/slurmd")] == ["/usr/sbin/slurmd -D -N twnode1"]
    assert [a for a in seen[1] if a.startswith("/usr/sbin/slurmd")] == ["/usr/sbin/slurmd -D -N twnode2"]
    assert not set(slurm.netns_pids("twnode1")) & set(slurm.netns_pids("twnode2"))
