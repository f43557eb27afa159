"""What the supervisor asks Slurm's controller, and the few things it asks it to do: every call is a bounded
`scontrol`/`sinfo` subprocess (Slurm has no stable Python API), run off the main loop by its callers.

The answers are the controller's, never the environment's: `SLURM_JOB_NODELIST` is fixed at the job's start, while
a `--no-kill` job loses a node once Slurm declares it down, and a node's state (DOWN, DRAINED) is news to us.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping

from supervisor.launch.nodes import parse_sinfo

__all__ = [
    "SlurmError",
    "allocation",
    "cancel_job",
    "controller_reachable",
    "job_id",
    "job_running",
    "node_states",
    "requeue_job",
]

CALL_TIMEOUT_S = 15.0  # a controller answers in milliseconds; MessageTimeout (10 s by default) bounds a lost one
PING_TIMEOUT_S = 5.0
_FIELD = re.compile(r"(\w+)=(\S*)")


class SlurmError(Exception):
    """Slurm could not be asked, or refused; the message says which command and why."""


def job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _call(*argv: str, timeout: float = CALL_TIMEOUT_S) -> str:
    """stdout of a Slurm command; SlurmError with its stderr when it fails or times out."""
    command = [shutil.which(argv[0]) or argv[0], *argv[1:]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmError(f"{' '.join(argv[:3])}: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(argv[:3])}: {said[-1] if said else f'exit {done.returncode}'}"[:300])
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """`node[1-3],gpu7` as Slurm expands it."""
    return _call("scontrol", "show", "hostnames", nodelist).split()


def allocation(job: str | None = None) -> list[str]:
    """The job's nodes now, in Slurm's order (fewer than at its start once Slurm dropped a failed node)."""
    job = job or job_id()
    if job is None:
        raise SlurmError("SLURM_JOB_ID is not set: not inside an sbatch/salloc allocation")
    fields = dict(_FIELD.findall(_call("scontrol", "show", "job", "-o", job)))
    nodelist = fields.get("NodeList", "")
    if nodelist in ("", "(null)"):
        raise SlurmError(f"job {job} holds no nodes (state {fields.get('JobState', 'unknown')})")
    return hostnames(nodelist)


def job_running(job: str) -> bool:
    """Whether Slurm still runs (or is about to run) `job`; False for an ended or unknown one."""
    try:
        out = _call("squeue", "-h", "-j", job, "-o", "%T")
    except SlurmError:
        return False  # "Invalid job id": purged since it ended
    return any(state in ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED") for state in out.split())


def node_states(nodes: Iterable[str]) -> dict[str, str]:
    """Slurm's state of each node (`sinfo %T`, lower case: idle, mixed, down*, drained, mixed+drain, ...)."""
    names = sorted(set(nodes))
    if not names:
        return {}
    return parse_sinfo(_call("sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %T"))


def controller_reachable(timeout: float = PING_TIMEOUT_S) -> bool:
    """`scontrol ping` from here: can this host reach slurmctld (the test of our own link)."""
    try:
        return " is UP" in _call("scontrol", "ping", timeout=timeout)
    except SlurmError:
        return False


def cancel_job(job: str) -> None:
    _call("scancel", job)


def requeue_job(job: str, *, exclude: Iterable[str], nodes: tuple[int, int]) -> None:
    """Requeue a running job away from `exclude`, asking for `nodes` (min, max): held first, so that the
    exclusions and the node range are in place before Slurm schedules it again, then released."""
    _call("scontrol", "requeuehold", job)
    update = [f"NumNodes={nodes[0]}-{nodes[1]}"]
    excluded = ",".join(sorted(exclude))
    if excluded:
        update.append(f"ExcNodeList={excluded}")
    try:
        _call("scontrol", "update", f"JobId={job}", *update)
    finally:
        _call("scontrol", "release", job)


def describe_states(states: Mapping[str, str]) -> str:
    return ", ".join(f"{node} {state}" for node, state in sorted(states.items()))
