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
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.launch.nodes import parse_sinfo, partition_shortfall

__all__ = [
    "JobEnd",
    "SlurmError",
    "allocation",
    "cancel_job",
    "controller_reachable",
    "job_end",
    "job_id",
    "job_running",
    "node_states",
    "partition_states",
    "resubmit_job",
    "shortfall",
]

CALL_TIMEOUT_S = 15.0  # a controller answers in milliseconds; MessageTimeout (10 s by default) bounds a lost one
PING_TIMEOUT_S = 5.0
_FIELD = re.compile(r"(\w+)=(\S*)")
_DURATION = re.compile(r"(?:(\d{1,5})-)?(\d{1,6}(?::\d{1,2}){0,2})")  # Slurm's [D-]HH:MM:SS, MM:SS, MM


class SlurmError(Exception):
    """Slurm could not be asked, or refused; the message says which command and why."""


def job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _call(*argv: str, timeout: float = CALL_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """stdout of a Slurm command (`env`: variables set for it); SlurmError with its stderr when it fails or times
    out."""
    command = [shutil.which(argv[0]) or argv[0], *argv[1:]]
    environ = None if env is None else {**os.environ, **env}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=environ
        )
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


NO_VALUE = ("", "(null)", "N/A", "None")  # a field of `scontrol show job` that says nothing


def resubmit_args(show_job: str, *, exclude: Iterable[str], nodes: tuple[int, int]) -> list[str]:
    """sbatch's options for the job after the one `scontrol show job -o` describes: it starts once that one ended,
    asks for `nodes` (min, max) away from `exclude`, in the same partition, with the same time limit, name and
    working directory (the batch script's own #SBATCH lines apply again)."""
    fields = dict(_FIELD.findall(show_job))
    job = fields.get("JobId", "")
    low, high = nodes
    args = [f"--dependency=afterany:{job}", f"--nodes={low}" + (f"-{high}" if high > low else "")]
    if excluded := ",".join(sorted(exclude)):
        args.append(f"--exclude={excluded}")
    for key, option in (("Partition", "--partition"), ("JobName", "--job-name"), ("WorkDir", "--chdir")):
        if fields.get(key, "") not in NO_VALUE:
            args.append(f"{option}={fields[key]}")
    if fields.get("TimeLimit", "") not in (*NO_VALUE, "UNLIMITED", "INFINITE"):
        args.append(f"--time={fields['TimeLimit']}")
    return args


def resubmit_job(job: str, *, exclude: Iterable[str], nodes: tuple[int, int]) -> str:
    """Submit `job`'s batch script again (as Slurm stored it) as a new job that starts once `job` ended, asking for
    `nodes` (min, max) away from `exclude`; the new job's id. Not a requeue: Slurm (22.05) keeps a requeued job's
    node count whatever `scontrol update NumNodes` says while it completes, so a job that lost nodes for good could
    stay pending for ever ("Requested node configuration is not available")."""
    args = resubmit_args(_call("scontrol", "show", "job", "-o", job), exclude=exclude, nodes=nodes)
    script = _call("scontrol", "write", "batch_script", job, "-")
    with tempfile.NamedTemporaryFile("w", prefix=f"trainwarden-{job}-", suffix=".sbatch") as f:
        f.write(script)
        f.flush()
        return _call("sbatch", "--parsable", *args, f.name).strip().split(";")[0]


def partition_states(partition: str | None = None, timeout: float = CALL_TIMEOUT_S) -> dict[str, str]:
    """Slurm's state of every node of `partition` (a comma list, as sbatch -p takes; None: every partition)."""
    where = ("-p", partition) if partition else ()
    return parse_sinfo(_call("sinfo", "-h", "-N", *where, "-o", "%N %T", timeout=timeout))


def shortfall(exclude: Iterable[str], minimum: int, timeout: float = CALL_TIMEOUT_S) -> str | None:
    """Why a job of at least `minimum` nodes away from `exclude` can never start in this job's partition
    (`SLURM_JOB_PARTITION`; every partition outside a job), in one line, or None when it can (`sinfo`)."""
    partition = os.environ.get("SLURM_JOB_PARTITION") or None
    return partition_shortfall(partition_states(partition, timeout), exclude, minimum, name=partition)


def describe_states(states: Mapping[str, str]) -> str:
    return ", ".join(f"{node} {state}" for node, state in sorted(states.items()))


# ---- the job's end time ----

NO_LIMIT = ("UNLIMITED", "INFINITE")  # Slurm then shows an EndTime a year ahead, which is no limit
NO_TIME = ("", "Unknown", "None", "N/A", "(null)")
DEFAULT_SIGNAL_LEAD_S = 60.0  # `--signal=USR1` without `@N`
# `#SBATCH --signal=[B:]USR1@N` in the header of the batch script (`R:`, a reservation's end, is not the job's)
_SIGNAL_OPTION = re.compile(r"--signal[= ](?:B:)?(?:SIG)?(?:USR1|10)(?:@(\d+))?(?:\s|$)")


@dataclass(frozen=True)
class JobEnd:
    """When the job ends, as Slurm says now: `end` in seconds since the epoch (None: no limit, or not known yet),
    `text` as Slurm wrote it, `signal_lead_s` the lead of the batch script's `#SBATCH --signal=B:USR1@N` (None:
    it has none)."""

    end: float | None
    text: str
    signal_lead_s: float | None = None
    limit_s: float | None = None  # the job's whole time limit (TimeLimit), None when it has none or Slurm won't say


def parse_end_time(show_job: str) -> tuple[float | None, str]:
    """(EndTime in seconds since the epoch, as written) from `scontrol show job -o`; None for a job without a limit
    (TimeLimit=UNLIMITED) or one not started (EndTime=Unknown). Slurm prints times as SLURM_TIME_FORMAT says: `%s`
    (seconds, as job_end asks for) or, from a Slurm that ignores it, the standard local ISO form."""
    fields = dict(_FIELD.findall(show_job))
    text = fields.get("EndTime", "")
    if fields.get("TimeLimit", "") in NO_LIMIT or text in NO_TIME:
        return None, text
    if text.isdigit():
        return float(text), text
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")), text
    except ValueError:
        raise SlurmError(f"scontrol show job: EndTime={text[:60]!r} is not a time") from None


def parse_time_limit(show_job: str) -> float | None:
    """The job's TimeLimit from `scontrol show job -o` in seconds (`[D-]HH:MM:SS`, `MM:SS`, `MM`); None for none."""
    text = dict(_FIELD.findall(show_job)).get("TimeLimit", "")
    found = _DURATION.fullmatch(text)
    if found is None:
        return None
    parts = [int(p) for p in found.group(2).split(":")]
    if found.group(1) is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        hours += 24 * int(found.group(1))
    else:  # MM, MM:SS, HH:MM:SS
        hours, minutes, seconds = ([0, 0] + parts)[-3:] if len(parts) > 1 else (0, parts[0], 0)
    return float((hours * 60 + minutes) * 60 + seconds)


def parse_signal_lead(script: str) -> float | None:
    """The lead time of `#SBATCH --signal=[B:]USR1[@N]` in a batch script's header (sbatch reads options only up to
    the first command), or None."""
    lead = None
    for line in script.splitlines()[1:]:  # after the #! line
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH") and (found := _SIGNAL_OPTION.search(stripped)):
            lead = float(found.group(1)) if found.group(1) else DEFAULT_SIGNAL_LEAD_S  # the last one counts
    return lead


def job_end(job: str | None = None, *, with_signal_lead: bool = False) -> JobEnd:
    """The job's end time now (`scontrol show job`, times in seconds), and with `with_signal_lead` the lead of its
    batch script's time-limit warning (`scontrol write batch_script`: unknown, None, when Slurm cannot say)."""
    job = job or job_id()
    if job is None:
        raise SlurmError("SLURM_JOB_ID is not set: not inside an sbatch/salloc allocation")
    shown = _call("scontrol", "show", "job", "-o", job, env={"SLURM_TIME_FORMAT": "%s"})
    end, text = parse_end_time(shown)
    lead = None
    if with_signal_lead:
        try:
            lead = parse_signal_lead(_call("scontrol", "write", "batch_script", job, "-"))
        except SlurmError:
            lead = None  # an salloc job has no batch script; an old Slurm cannot write it to stdout
    return JobEnd(end, text, lead, parse_time_limit(shown))
