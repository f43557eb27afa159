"""Test helpers for the simulated Slurm cluster of tests/slurm/sim (real slurmctld/slurmd/munge;
one network namespace, hostname and pid namespace per node `twnodeN` = 192.168.251.(10+N)).

Plain functions; every wait is bounded and raises TimeoutError (or RuntimeError) with what it saw.
Everything here needs root: see `available()`.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

SIM = Path(__file__).resolve().parent / "sim"
NODES = 4
NET = "192.168.251"
TERMINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED",
    "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}  # fmt: skip
T = TypeVar("T")


def node_name(i: int) -> str:
    return f"twnode{i}"


def node_addr(name: str) -> str:
    """The node's address on the cluster's bridge: twnode1 -> 192.168.251.11."""
    return f"{NET}.{10 + int(name.removeprefix('twnode'))}"


def _env() -> dict[str, str]:
    # the root conftest tags each test's processes and kills tagged leftovers: daemons started
    # from a test (restore_node) must not carry the tag
    return {k: v for k, v in os.environ.items() if k != "TRAINWARDEN_TEST_TAG"}


def _run(cmd: Sequence[str | Path], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=kw.pop("env", _env()), **kw
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def _sim(script: str, *args: str, timeout: float = 60) -> str:
    return _run(["bash", SIM / script, *args], timeout=timeout).stdout


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `predicate` until it returns something truthy; TimeoutError after `timeout` seconds
    (with snapshot() of the cluster in its message)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}\n{snapshot()}")
        time.sleep(interval)


def snapshot() -> str:
    """What the cluster looks like now, for failure messages: nodes (allocated CPUs), jobs, steps."""
    cmds = [
        ["sinfo", "-h", "-N", "-o", "%N %t alloc/idle/other/total=%C"],
        ["squeue", "-h", "-t", "all", "-o", "%i %T %N %j", "--sort=-i"],
        ["squeue", "-h", "-s", "-o", "%i %N"],
    ]
    out = []
    for cmd in cmds:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            out.append(f"$ {' '.join(cmd)}\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[:12]))
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"$ {' '.join(cmd)}: {e}")
    return "\n".join(out)


# --- the cluster as a whole ---


def available() -> str | None:
    """None if the simulated cluster can run here, else why not (for pytest.skip)."""
    if not sys.platform.startswith("linux"):
        return "the simulated Slurm cluster needs Linux namespaces"
    if os.geteuid() != 0:
        return "the simulated Slurm cluster needs root (network namespaces, slurmd)"
    missing = [t for t in ("ip", "unshare", "nsenter", "setsid", "runuser") if not shutil.which(t)]
    if missing:
        return f"the simulated Slurm cluster needs {', '.join(missing)} (iproute2, util-linux)"
    if not (shutil.which("slurmd") and shutil.which("munged")) and not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed and there is no apt-get to install them"
    probe = subprocess.run(["unshare", "--net", "--uts", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network/pid namespaces here: {probe.stderr.strip()}"
    return None


def _pidns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def lock_session(timeout: float = 180) -> IO[str]:
    """An exclusive lock on the cluster for one test session (released when the file is closed);
    TimeoutError naming the holder's pid if another session keeps it longer than `timeout`."""
    path = Path(os.environ.get("TW_SIM_DIR", "/tmp/tw-slurm-sim")) / "pytest.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("a+")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.seek(0)
                holder = f.read().strip()
                f.close()
                raise TimeoutError(f"the simulated Slurm cluster is in use by test session pid {holder}") from None
            time.sleep(0.5)
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def is_up(nodes: int = NODES) -> bool:
    """Exactly twnode1..`nodes`, each with a live slurmd that Slurm hears (in its own pid
    namespace unless TW_SIM_PIDNS=0), and nothing down."""
    try:
        listed = _run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10).stdout.split("\n")
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return False
    states = dict(line.split() for line in listed if line.strip())
    if sorted(states) != sorted(node_name(i) for i in range(1, nodes + 1)):
        return False
    try:  # started by our up.sh, not by the recipe it came from (no orphan reaper, slow DNS)
        if "tests/slurm/sim/up.sh" not in Path("/etc/slurm/slurm.conf").read_text().split("\n")[0]:
            return False
    except OSError:
        return False
    want_pidns = os.environ.get("TW_SIM_PIDNS", "1") == "1"
    for name, state in states.items():
        if "*" in state or state.startswith(("down", "drain", "fail")) or not Path(f"/var/run/netns/{name}").exists():
            return False
        slurmds = [p for p in netns_pids(name) if _comm(p) == "slurmd"]
        if not slurmds or (_pidns(slurmds[0]) != _pidns(os.getpid())) != want_pidns:
            return False
    return True


def ensure_up(nodes: int = NODES) -> bool:
    """Make sure `nodes` nodes are up and idle: reuse a healthy cluster (after reset()), else
    start one with up.sh (installs slurm-wlm + munge with apt-get if missing). True if it started one."""
    if is_up(nodes):
        try:
            reset(nodes)
            return False
        except (RuntimeError, TimeoutError):
            pass
    _sim("up.sh", str(nodes), timeout=600)  # apt-get install may take minutes
    return True


def down() -> None:
    _sim("down.sh", timeout=60)


# --- jobs ---


def sbatch(args: Sequence[str], script: str | Path, cwd: str | Path) -> int:
    """Submit `script` with `sbatch --parsable *args`; the job id."""
    out = _run(["sbatch", "--parsable", *args, str(script)], cwd=cwd).stdout
    return int(out.strip().split(";")[0])


def job_info(job_id: int | str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (finished jobs stay there MinJobAge=300 s); {} if unknown."""
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def job_state(job_id: int | str) -> str:
    return job_info(job_id).get("JobState", "UNKNOWN")


def wait_job(job_id: int | str, timeout: float) -> tuple[str, int]:
    """Wait until the job has finished: (JobState, exit code), the exit code of ExitCode=X:Y being
    X, or -Y when the batch script was killed by signal Y (as subprocess returncodes go)."""

    def finished() -> dict[str, str] | None:
        info = job_info(job_id)
        return info if info.get("JobState") in TERMINAL_STATES else None

    info = wait_for(finished, timeout, f"job {job_id} to finish (now {job_state(job_id)})")
    code, sig = (int(x) for x in info["ExitCode"].split(":"))
    return info["JobState"], -sig if sig else code


def job_nodes(job_id: int | str) -> list[str]:
    """The job's nodes now (a --no-kill job loses a node once Slurm declares it down)."""
    nodelist = job_info(job_id).get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        return []
    return _run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def cancel_all(timeout: float = 60) -> None:
    """scancel every job (anyone's) and wait until squeue lists none, COMPLETING ones included."""
    jobs = _run(["squeue", "-h", "-o", "%i"]).stdout.split()
    if jobs:
        _run(["scancel", *jobs], check=False)
    wait_for(lambda: not _run(["squeue", "-h", "-o", "%i"]).stdout.split(), timeout, "squeue to empty")


# --- nodes and faults ---


def node_states() -> dict[str, str]:
    """sinfo's short state of every node: idle, mix, alloc, comp, 'idle*' (not responding), 'down*', ...
    (`sinfo -N`: a single-node query, `sinfo -n NODE` alone, can show a stale 'mix' long after a job
    ended; only a query of every node makes slurmctld recount allocated CPUs)."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def node_state(name: str) -> str:
    return node_states().get(name, "")


def node_idle(name: str) -> bool:
    """Idle: free for a new job ('plnd' is an idle node backfill had planned for a job that has
    started meanwhile; the flag lingers up to bf_interval, 30 s)."""
    return node_state(name) in ("idle", "plnd")


def netns_pids(name: str) -> list[int]:
    """Host pids of the processes in the node's network namespace (its slurmd, steps, tasks)."""
    return [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def node_procs(name: str) -> list[str]:
    """Names (comm) of the processes running in the node, e.g. ['sh', 'slurmd', 'sleep']."""
    return [c for c in map(_comm, netns_pids(name)) if c]


def node_files(name: str, directory: str) -> list[str]:
    """Names in `directory` as the node sees it (its own mount namespace: each node has its own /dev/shm)."""
    slurmd = next(p for p in netns_pids(name) if _comm(p) == "slurmd")
    return sorted(_run(["nsenter", "-t", str(slurmd), "-m", "ls", "-A", directory]).stdout.split())


def slurmd_alive(name: str) -> bool:
    return any(_comm(p) == "slurmd" for p in netns_pids(name))


def link_up(name: str) -> bool:
    """Whether the host end of the node's link (vethN) is up, i.e. not partitioned."""
    out = _run(["ip", "-o", "link", "show", f"veth{name.removeprefix('twnode')}"], check=False).stdout
    return bool(re.search(r"<[^>]*\bUP\b", out))


def crash_node(name: str) -> None:
    """SIGKILL everything in the node (slurmd, slurmstepd, tasks), as a power cut; returns at once
    (Slurm itself declares the node down only after SlurmdTimeout, ~30-40 s)."""
    _sim("node.sh", "crash", name)


def restore_node(name: str, timeout: float = 60) -> None:
    """Boot a crashed node again: a fresh slurmd (and pid namespace) in its network namespace,
    resumed if Slurm had marked it down; returns once Slurm hears it. It may still be allocated
    to a job that held it (mix/alloc), and a step that had a task there stays listed until the job
    ends when the node came back before Slurm's verdict."""
    _sim("node.sh", "restore", name, timeout=timeout)


def partition(name: str) -> None:
    """Cut the node off the network (host end of its veth down): nothing reaches it, it reaches nothing."""
    _sim("node.sh", "partition", name)


def heal(name: str, timeout: float = 60) -> None:
    """Undo partition(): link up, slurmd re-registers, resumed if Slurm had marked it down."""
    _sim("node.sh", "heal", name, timeout=timeout)


def _controller_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(int(p.name)) == "slurmctld"]


def pause_controller() -> None:
    """An outage of the Slurm controller alone (SIGSTOP slurmctld): every scontrol, sinfo and srun that needs it
    times out, the nodes' links are untouched. resume_controller() ends it, and so does reset()."""
    for pid in _controller_pids():
        os.kill(pid, signal.SIGSTOP)


def resume_controller() -> None:
    for pid in _controller_pids():
        os.kill(pid, signal.SIGCONT)


def reset(nodes: int = NODES, timeout: float = 90) -> None:
    """Between tests: the controller resumed, heal and restore every node, cancel every job, resume, wait until
    all idle (cancelling again whatever someone else submits meanwhile)."""
    resume_controller()
    names = [node_name(i) for i in range(1, nodes + 1)]
    for name in names:
        if not link_up(name):
            heal(name)
        if not slurmd_alive(name):
            restore_node(name)

    def idle() -> bool:
        cancel_all(timeout)
        for name in names:
            if node_state(name).startswith(("down", "drain", "fail")):
                _run(["scontrol", "update", f"nodename={name}", "state=resume"], check=False)
        states = node_states()
        return all(states.get(n) in ("idle", "plnd") for n in names)

    wait_for(idle, timeout, "every node idle", interval=0.5)
