"""Node-failover benchmark: a dead or cut-off node under trainwarden and under torchrun+srun, on the simulated
Slurm cluster (tests/slurm/sim: twnode1..3, real slurmctld/slurmd, one network and pid namespace per node,
one shared filesystem), in one invocation.

Each trial runs the demo job (examples/demo_train.py, 2 nodes x 2 ranks, gloo, CPU, --steps S, a checkpoint
every C steps) and, once every rank has passed step K, hits twnode2 at t0 (time.time()) with one fault:

- crash: `cluster.crash_node`: SIGKILL to everything in the node (slurmd, step daemons, ranks), a power cut;
- partition: `cluster.partition`: the node's link goes down; its processes live on, cut off.

Cases (each trial runs all four in turn, so drift on the machine hits every case alike):

- trainwarden: `sbatch -N3 --no-kill` of `python -m supervisor run CONFIG --run-dir DIR`, CONFIG being
  configs/demo.yaml plus `nodes: 2, nproc_per_node: 2, spare_nodes: 1, slurm.node_timeout_s: T` (restart and
  stop settings as in the demo). Every rank passed step K: the supervisor's state.json, attempt 0.
- torchrun: `sbatch -N2` (no --no-kill, as people submit it; Slurm places it on twnode1+twnode2, which the
  trial checks; Slurm may requeue it when a node fails, as batch jobs are by default) of a script running
  `srun -N2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d
  --rdzv-endpoint=<first node>:29400 --max-restarts=3 examples/demo_train.py`, with the worker library's
  environment set as bench/harness.py's torchrun_launch does (it resumes by itself from the newest complete
  checkpoint). Every rank passed step K: the ranks' own step events.

Measured from t0:

- declared: the journal's `node_lost` event for twnode2 (RUN_DIR/supervisor/events.jsonl; trainwarden only);
- first step after resume: the earliest `step` event in RUN_DIR/ranks/rank_*/events.jsonl written by a rank
  process started after t0 (its `rank_started` event): trainwarden's attempt >= 1, a torchrun restart, or the
  job run again after Slurm requeued it; the trial waits at most W s for it (else "never within W s", with what
  ended the run: Slurm requeueing or killing the job, a torchrun error, or nothing);
- Slurm's verdict: `sinfo -h -n twnode2 -o %t` polled every 0.5 s until it starts with "down", or until
  `scontrol show node` names DOWN in its State (sinfo keeps showing "mix*" for a down node whose CPUs a job
  still holds), at most V s; and what slurmctld's log (/tmp/tw-slurm-sim/log/slurmctld.log) says: when it set
  the node DOWN, and whether it removed the node from this job, killed the job or a step, or requeued the job;
- worked first time (trainwarden): attempt 1 was placed on twnode1 + twnode3 (the spare; journal
  `ranks_placed`), reached a step, no attempt 2 was placed, and `trainwarden stop` then ended the job with
  exit 0. For torchrun: it resumed training within W s.

A trial ends once both the verdict and the resume are in (or their limits passed); trainwarden runs are then
stopped with `trainwarden stop RUN_DIR`, torchrun jobs cancelled. After every trial `cluster.reset()` cancels
every job and restores, heals and resumes every node, and any process left from the trial is SIGKILLed.
The whole run holds the cluster's session lock. Targets: a crash declared within T + 1 s (under 1 s, the agent's
TCP stream breaks), a partition declared within T + 1 s, the relaunch on the spare worked first time in every
trial. Run from the repository root (root is needed for the cluster):
    .venv/bin/python bench/node_failover.py [--trials N] [--steps S] [--fault-step K] [--node-timeout-s T]
                                            [--resume-limit-s W] [--verdict-limit-s V] [--case NAME ...] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import yaml
from harness import (
    PREFIX,
    REPO,
    SCRIPT,
    demo_config,
    event_time,
    fmt,
    print_header,
    rank_events,
    ratio,
    read_events,
    scratch_dir,
    sigint_deferred,
    spread,
)

from worker.contract import RunLayout

sys.path.insert(0, str(REPO))  # tests.slurm.cluster: the simulated cluster's helpers
from tests.slurm import cluster  # noqa: E402

NODE = "twnode2"  # the node every fault hits
NODES_PER_RUN = 2
NPROC_PER_NODE = 2
WORLD = NODES_PER_RUN * NPROC_PER_NODE
SPARE_PLACEMENT = {"twnode1": [0, 1], "twnode3": [2, 3]}  # trainwarden's attempt 1: the spare takes twnode2's place
RDZV_PORT = 29400
POLL_S = 0.5
DETECTION_SLACK_S = 1.0  # the target: declared within node_timeout_s plus this
CRASH_TARGET_S = 1.0  # a crash breaks the agent's TCP stream: declared within this
SIM_DIR = Path(os.environ.get("TW_SIM_DIR", "/tmp/tw-slurm-sim"))
SLURMCTLD_LOG = SIM_DIR / "log" / "slurmctld.log"
SLURM_CONF = Path("/etc/slurm/slurm.conf")
TRAINWARDEN = Path(sys.executable).parent / "trainwarden"
TORCHRUN = Path(sys.executable).parent / "torchrun"
LOG_LINE = re.compile(r"^\[(?P<time>[^\]]+)\] (?:(?:error|fatal|debug\d?|info|verbose): )?(?P<text>.*)$")
# Errors torchrun and the ranks print, in the order they are worth naming as what ended a run.
TORCHRUN_ERRORS = (
    "RendezvousTimeoutError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "DistNetworkError",
    "DistStoreError",
    "ChildFailedError",
    "Connection reset by peer",
    "Timed out",
)
WIDTH = 26  # of a summary column: "63.70 [63.05–64.35], 1 n/a"


@dataclass(frozen=True)
class Case:
    launcher: str  # trainwarden | torchrun
    fault: str  # crash | partition

    @property
    def name(self) -> str:
        return f"{self.launcher}-{self.fault}"


CASES = tuple(Case(launcher, fault) for launcher in ("trainwarden", "torchrun") for fault in ("crash", "partition"))
FAULTS: dict[str, Callable[[str], None]] = {"crash": cluster.crash_node, "partition": cluster.partition}


@dataclass(frozen=True)
class Job:
    """What every trial runs, when the fault comes and how long each wait may take."""

    steps: int
    save_every: int
    fault_step: int
    node_timeout_s: float
    resume_limit_s: float
    verdict_limit_s: float
    start_timeout_s: float
    stop_timeout_s: float


@dataclass(frozen=True)
class Observed:
    """What polling the run after the fault saw; seconds from t0."""

    first_step: tuple[float, int] | None  # when (wall clock), in which attempt
    verdict_s: float | None  # sinfo (or scontrol) first said the node is down
    last_state: str  # the node's state at the verdict, or when polling gave up
    ended: tuple[str, float] | None  # the job's terminal state and when it was seen, if it ended
    left_running: tuple[str, float] | None  # the job's first state other than RUNNING (e.g. requeued: PENDING)


@dataclass(frozen=True)
class Trial:
    """What one trial of one case measured; None where it never happened."""

    case: Case
    job: int | None
    declared_s: float | None
    first_step_s: float | None
    resumed_attempt: int | None
    verdict_s: float | None
    verdict_state: str
    slurm: SlurmSaw
    worked: bool
    exit: str
    ended_by: str
    note: str
    wall_s: float


# ---- the cluster -------------------------------------------------------------------------------


def slurm_facts() -> str:
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    conf = SLURM_CONF.read_text(encoding="utf-8")
    timeout = re.search(r"^SlurmdTimeout=(\S+)", conf, re.MULTILINE)
    kill_wait = re.search(r"^KillWait=(\S+)", conf, re.MULTILINE)
    return (
        f"{version}; SlurmdTimeout={timeout[1] if timeout else '300 (default)'} s, "
        f"KillWait={kill_wait[1] if kill_wait else '30 (default)'} s ({SLURM_CONF}); "
        f"nodes twnode1..{cluster.NODES}; faults hit {NODE}"
    )


def log_size() -> int:
    try:
        return SLURMCTLD_LOG.stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class SlurmSaw:
    """What slurmctld's log says it did about the failed node from t0 on; seconds from t0."""

    down_s: float | None  # "Nodes twnode2 not responding, setting DOWN"
    actions: tuple[tuple[float, str], ...]  # what it did to this job or its steps for the failed node

    def summary(self) -> str:
        if not self.actions:
            return "none"
        kinds = dict.fromkeys(action_kind(text) for _, text in self.actions)
        return f"{', '.join(kinds)} @{self.actions[0][0]:.1f}s"


def action_kind(text: str) -> str:
    if "requeue" in text.lower():
        return "job requeued"
    if text.startswith("Removing failed node"):
        return "node removed from job"
    step = re.search(r"StepId=(\S+)", text)
    return f"step {step[1]} killed" if step else "job killed"


def read_slurm_log(offset: int, job: int, t0: float) -> SlurmSaw:
    """slurmctld's log since `offset`: when it set the node DOWN, and each line where it acted on `job` or one of
    its steps for the failed node ("Removing failed node twnode2 from JobId=7", "Killing JobId=7 StepId=0 on
    failed node twnode2", "requeue job JobId=8 due to failure of node twnode2")."""
    try:
        with SLURMCTLD_LOG.open("rb") as f:
            f.seek(offset if offset <= SLURMCTLD_LOG.stat().st_size else 0)
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return SlurmSaw(None, ())
    mentions_job = re.compile(rf"\bJobId={job}\b")
    for_node = re.compile(rf"(failed node|failure of node) {NODE}\b")
    down_s, actions = None, []
    for line in lines:
        match = LOG_LINE.match(line)
        if match is None:
            continue
        try:
            at = datetime.fromisoformat(match["time"]).timestamp() - t0
        except ValueError:
            continue
        text = match["text"].strip()
        if down_s is None and at > -1 and NODE in text and "not responding, setting DOWN" in text:
            down_s = at
        if mentions_job.search(text) and for_node.search(text):
            actions.append((at, text))
    return SlurmSaw(down_s, tuple(actions))


def node_verdict() -> tuple[bool, str]:
    """Whether Slurm says the node is down: sinfo's %t starts with "down", or else scontrol's State names DOWN
    (sinfo shows a down node whose CPUs a job still holds as "mix*"); and the state as shown."""
    short = cluster.node_state(NODE)
    if short.startswith("down"):
        return True, short
    out = subprocess.run(["scontrol", "show", "node", "-o", NODE], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"\bState=(\S+)", out)
    full = found[1] if found else "?"
    return re.search(r"(?<![A-Z_])DOWN", full) is not None, f"{short}, scontrol {full}"


def sweep(work: Path) -> list[str]:
    """SIGKILL every process still left from the trials in `work` (its path in the command line, or a run dir of
    `work` in TRAINWARDEN_RUN_DIR: e.g. torchrun's workers, which lead their own sessions); what they were."""
    found, described = [], []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            mine = str(work) in " ".join(proc.cmdline()) or proc.environ().get("TRAINWARDEN_RUN_DIR", "").startswith(
                str(work)
            )
        except psutil.Error:
            continue
        if mine:
            found.append(proc)
            with contextlib.suppress(psutil.Error):
                described.append(f"{proc.pid} {' '.join(Path(a).name for a in proc.cmdline()[:4])}")
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(found, timeout=10)
    if alive:
        print(f"WARNING: still alive after SIGKILL: {[p.pid for p in alive]}", flush=True)
    return described


# ---- submitting the two kinds of job ---------------------------------------------------------------


def submit_trainwarden(job: Job, work: Path) -> tuple[int, RunLayout]:
    run_dir = work / "run"
    config = demo_config()
    config.update(
        script=str(REPO / SCRIPT),
        args=["--steps", str(job.steps)],
        run_dir=str(run_dir),
        nodes=NODES_PER_RUN,
        nproc_per_node=NPROC_PER_NODE,
        spare_nodes=1,
    )
    config["worker"]["save_checkpoint_steps"] = job.save_every
    config["slurm"] = {**config.get("slurm", {}), "node_timeout_s": job.node_timeout_s}
    job_yaml = work / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(config), encoding="utf-8")
    script = work / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"exec {shlex.quote(sys.executable)} -m supervisor run {shlex.quote(str(job_yaml))} "
        f"--run-dir {shlex.quote(str(run_dir))}\n",
        encoding="utf-8",
    )
    args = ["-N3", "--no-kill", "-J", "bench-failover-tw", f"--output={work}/job-%j.out"]
    return cluster.sbatch(args, script, cwd=REPO), RunLayout(run_dir)


def submit_torchrun(job: Job, work: Path) -> tuple[int, RunLayout]:
    run_dir = work / "run"
    worker_config = json.dumps({"save_checkpoint_steps": job.save_every, "prefix": PREFIX})
    script = work / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"export OMP_NUM_THREADS=1 TRAINWARDEN_RUN_DIR={shlex.quote(str(run_dir))} "
        f"TRAINWARDEN_WORKER_CONFIG={shlex.quote(worker_config)}\n"
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        f"srun -N{NODES_PER_RUN} --ntasks-per-node=1 {shlex.quote(str(TORCHRUN))} --nnodes={NODES_PER_RUN} "
        f"--nproc-per-node={NPROC_PER_NODE} --rdzv-backend=c10d --rdzv-endpoint=$head_node:{RDZV_PORT} "
        f'--rdzv-id="$SLURM_JOB_ID" --max-restarts=3 {shlex.quote(str(REPO / SCRIPT))} --steps {job.steps}\n',
        encoding="utf-8",
    )
    args = [f"-N{NODES_PER_RUN}", "-J", "bench-failover-torchrun", f"--output={work}/job-%j.out"]
    return cluster.sbatch(args, script, cwd=REPO), RunLayout(run_dir)


SUBMIT: dict[str, Callable[[Job, Path], tuple[int, RunLayout]]] = {
    "trainwarden": submit_trainwarden,
    "torchrun": submit_torchrun,
}


# ---- observing a run ---------------------------------------------------------------------------


def supervisor_state(layout: RunLayout) -> dict[str, Any]:
    try:
        return json.loads(layout.state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def every_rank_past(launcher: str, layout: RunLayout, step: int) -> bool:
    """Every rank of attempt 0 has reported `step` or later: the supervisor's state.json, or the ranks' events."""
    if launcher == "trainwarden":
        now = supervisor_state(layout)
        ranks = now.get("ranks") or []
        return (
            now.get("attempt") == 0
            and now.get("state") == "running"
            and len(ranks) == WORLD
            and all((rank.get("step") or 0) >= step for rank in ranks)
        )
    for rank in range(WORLD):
        steps = [
            e.get("step", 0)
            for e in read_events(layout.rank_events(rank))
            if e.get("event") == "step" and e.get("attempt", 0) == 0
        ]
        if max(steps, default=0) < step:
            return False
    return True


def wait_for_training(launcher: str, job_id: int, layout: RunLayout, job: Job) -> None:
    """Until every rank passed the fault step; RuntimeError if the job ends first, TimeoutError past the limit."""

    def ready() -> bool:
        state = cluster.job_state(job_id)
        if state in cluster.TERMINAL_STATES:
            raise RuntimeError(f"job {job_id} ended ({state}) before every rank reached step {job.fault_step}")
        return every_rank_past(launcher, layout, job.fault_step)

    cluster.wait_for(ready, job.start_timeout_s, f"every rank of job {job_id} at step {job.fault_step}", POLL_S)


def observe(job_id: int, layout: RunLayout, t0: float, job: Job) -> Observed:
    """Poll every POLL_S until Slurm's verdict and the resumed training are in, or their limits have passed."""
    verdict_s: float | None = None
    last_state = ""
    first = None
    ended: tuple[str, float] | None = None
    left_running: tuple[str, float] | None = None
    while True:
        elapsed = time.time() - t0
        if verdict_s is None and elapsed <= job.verdict_limit_s:
            down, last_state = node_verdict()
            if down:
                verdict_s = time.time() - t0
        if first is None:
            first = first_step_after(layout, t0)
        if ended is None or left_running is None:
            state = cluster.job_state(job_id)
            if left_running is None and state != "RUNNING":
                left_running = state, time.time() - t0
            if ended is None and state in cluster.TERMINAL_STATES:
                ended = state, time.time() - t0
        verdict_done = verdict_s is not None or elapsed > job.verdict_limit_s
        resume_done = first is not None or ended is not None or elapsed > job.resume_limit_s
        if verdict_done and resume_done:
            return Observed(first, verdict_s, last_state, ended, left_running)
        time.sleep(POLL_S)


def first_step_after(layout: RunLayout, t0: float) -> tuple[float, int] | None:
    """Wall time and attempt of the earliest `step` event written by a rank process started after `t0`: a relaunch
    (trainwarden's attempt >= 1), a torchrun restart, or the job run again after Slurm requeued it (attempt 0)."""
    found = []
    for rank in range(WORLD):
        restarted = False
        for event in read_events(layout.rank_events(rank)):
            if event.get("event") == "rank_started" and event_time(event) > t0:
                restarted = True
            elif restarted and event.get("event") == "step":
                found.append((event_time(event), event.get("attempt", 0)))
                break
    return min(found, default=None)


def first_journal_event(journal: list[dict[str, Any]], name: str, **fields: Any) -> dict[str, Any] | None:
    return next((e for e in journal if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())), None)


def requeue_note(info: dict[str, str], t0: float) -> str | None:
    """'Slurm requeued the job ...' when it did (scontrol's Restarts), with when it may start again (BeginTime)."""
    if int(info.get("Restarts", "0") or 0) < 1:
        return None
    note = f"Slurm requeued the job (Restarts={info['Restarts']}, now {info.get('JobState')})"
    with contextlib.suppress(KeyError, ValueError):
        eligible = datetime.fromisoformat(info["EligibleTime"]).timestamp() - t0
        note += f", eligible to start again {eligible:.0f} s after the fault"
    return note


def output_tail(work: Path, job_id: int, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return (work / f"job-{job_id}.out").read_text(encoding="utf-8", errors="replace")[-chars:]
    return ""


def torchrun_error(work: Path, job_id: int) -> str | None:
    """The first line of the job's output naming one of TORCHRUN_ERRORS (the earliest-listed kind wins)."""
    try:
        lines = (work / f"job-{job_id}.out").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for kind in TORCHRUN_ERRORS:
        line = next((line for line in lines if kind in line), None)
        if line is not None:
            return re.sub(r"\s+", " ", line).strip()[:160]
    return None


# ---- one trial ---------------------------------------------------------------------------------


def run_trial(case: Case, job: Job, work: Path) -> Trial:
    """Submit, wait for training, inject the fault, measure, stop; the cluster is reset whatever happens."""
    work.mkdir(parents=True)
    started = time.monotonic()
    job_id: int | None = None
    try:
        offset = log_size()
        job_id, layout = SUBMIT[case.launcher](job, work)
        try:
            wait_for_training(case.launcher, job_id, layout, job)
        except (RuntimeError, TimeoutError) as exc:
            return failed_trial(case, job_id, f"{exc}; output: {output_tail(work, job_id, 600)!r}", started)
        if NODE not in cluster.job_nodes(job_id):
            return failed_trial(
                case, job_id, f"Slurm did not place the job on {NODE}: {cluster.job_nodes(job_id)}", started
            )
        t0 = time.time()
        FAULTS[case.fault](NODE)
        seen = observe(job_id, layout, t0, job)
        if case.launcher == "trainwarden":
            return trainwarden_result(case, job, work, job_id, layout, t0, seen, offset, started)
        return torchrun_result(case, job, work, job_id, t0, seen, offset, started)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:  # a Slurm command failed
        return failed_trial(case, job_id, f"trial failed: {type(exc).__name__}: {str(exc)[-400:]}", started)
    finally:
        with sigint_deferred():
            cluster.reset()
            left = sweep(work)
            if left:
                print(f"    note: still alive after cluster.reset(), killed: {'; '.join(left)}", flush=True)


def failed_trial(case: Case, job_id: int | None, why: str, started: float) -> Trial:
    return Trial(
        case,
        job_id,
        None,
        None,
        None,
        None,
        "",
        SlurmSaw(None, ()),
        False,
        "n/a",
        "n/a",
        why,
        time.monotonic() - started,
    )


def trainwarden_result(
    case: Case,
    job: Job,
    work: Path,
    job_id: int,
    layout: RunLayout,
    t0: float,
    seen: Observed,
    offset: int,
    started: float,
) -> Trial:
    note = ""
    if seen.ended is None:
        stop = subprocess.run([str(TRAINWARDEN), "stop", str(layout.root)], capture_output=True, text=True, timeout=30)
        if stop.returncode != 0:
            note = f"trainwarden stop exited {stop.returncode}: {stop.stderr.strip()[-200:]}; "
    try:
        state, code = cluster.wait_job(job_id, job.stop_timeout_s)
        exit_text = f"{state} {code}"
    except TimeoutError:
        state, code, exit_text = "", None, f"still running {job.stop_timeout_s:g} s after the stop"
    journal = read_events(layout.journal)
    lost = first_journal_event(journal, "node_lost", node=NODE)
    placed = {e.get("attempt"): e.get("nodes") for e in journal if e.get("event") == "ranks_placed"}
    first = seen.first_step
    worked = (
        lost is not None
        and placed.get(1) == SPARE_PLACEMENT
        and max(placed, default=0) == 1
        and first is not None
        and first[1] == 1
        and code == 0
    )
    nodes = "+".join(sorted(placed.get(1) or {})) or "none"
    note += f"attempt 1 on {nodes}; attempts placed {len(placed)}"
    if seen.ended is not None:
        note += f"; the job ended by itself ({seen.ended[0]}) {seen.ended[1]:.1f} s after the fault"
    if lost is not None:
        note += f"; why: {lost.get('why')}"
    if code != 0:
        note += f"; output: {output_tail(work, job_id, 600)!r}"
    return Trial(
        case,
        job_id,
        None if lost is None else event_time(lost) - t0,
        None if first is None else first[0] - t0,
        None if first is None else first[1],
        seen.verdict_s,
        seen.last_state,
        read_slurm_log(offset, job_id, t0),
        worked,
        exit_text,
        "n/a",
        note,
        time.monotonic() - started,
    )


def torchrun_result(
    case: Case, job: Job, work: Path, job_id: int, t0: float, seen: Observed, offset: int, started: float
) -> Trial:
    first = seen.first_step
    saw = read_slurm_log(offset, job_id, t0)
    error = torchrun_error(work, job_id)
    requeued = requeue_note(cluster.job_info(job_id), t0)
    if seen.ended is None:
        subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)
        with contextlib.suppress(TimeoutError):
            cluster.wait_job(job_id, job.stop_timeout_s)
    info = cluster.job_info(job_id)
    exit_text = f"{info.get('JobState', '?')} {info.get('ExitCode', '?')}"
    if first is not None:
        ended_by = f"resumed (torchrun restart {first[1]}{', ' + requeued if requeued else ''})"
    elif requeued:
        ended_by = f"{requeued}, not running again {job.resume_limit_s:g} s after the fault"
    elif seen.ended is not None and seen.ended[0] == "NODE_FAIL":
        ended_by = f"Slurm killed the job (NODE_FAIL), seen {seen.ended[1]:.1f} s after the fault"
    elif seen.ended is not None:
        ended_by = f"the job ended ({seen.ended[0]}) {seen.ended[1]:.1f} s after the fault: {error or 'no error seen'}"
    else:
        ended_by = f"nothing: still running without training {job.resume_limit_s:g} s after the fault" + (
            f" (last error: {error})" if error else ""
        )
    restarts = max((e.get("attempt", 0) for e in rank_events(RunLayout(work / "run"), range(WORLD))), default=0)
    note = f"highest restart count seen {restarts}" + (f"; error: {error}" if error and first is None else "")
    return Trial(
        case,
        job_id,
        None,
        None if first is None else first[0] - t0,
        None if first is None else first[1],
        seen.verdict_s,
        seen.last_state,
        saw,
        first is not None,
        exit_text,
        ended_by,
        note,
        time.monotonic() - started,
    )


# ---- report ------------------------------------------------------------------------------------


def trial_line(index: int, trials: int, t: Trial, job: Job) -> str:
    first = "never" if t.first_step_s is None else f"{t.first_step_s:.2f} s (attempt {t.resumed_attempt})"
    if t.first_step_s is None and t.exit != "n/a":
        first += f" within {job.resume_limit_s:g} s"
    verdict = (
        f"{fmt(t.verdict_s)} s ({t.verdict_state})"
        if t.verdict_s is not None
        else (f"none within {job.verdict_limit_s:g} s (last {t.verdict_state or '?'})")
    )
    line = (
        f"trial {index}/{trials}  {t.case.name:<21} job {t.job}  declared {fmt(t.declared_s)} s  "
        f"first step after resume {first}  Slurm down {verdict}  Slurm did: {t.slurm.summary()}  "
        f"worked first time: {'yes' if t.worked else 'no'}  exit {t.exit}  [{t.wall_s:.0f} s]"
    )
    details = [t.note]
    if t.case.launcher == "torchrun":
        details.insert(0, f"ended by: {t.ended_by}")
    details.append(
        f"slurmctld log: set DOWN {'never' if t.slurm.down_s is None else f'@{t.slurm.down_s:.1f}s'}"
        + "".join(f"; {text}" for _, text in t.slurm.actions[:3])
    )
    return line + "\n    " + "; ".join(d for d in details if d)


def within(t: Trial, limit_s: float) -> bool:
    return t.declared_s is not None and t.declared_s <= limit_s


def table_row(cells: list[str]) -> str:
    return (f"{cells[0]:<22} " + " ".join(f"{cell:<{WIDTH}}" for cell in cells[1:])).rstrip()


def summary(results: list[Trial], job: Job, cases: list[Case]) -> str:
    rows = [
        f"medians [min–max] in seconds from the fault over the trials; Slurm's verdict: sinfo or scontrol says "
        f"down (polled every {POLL_S:g} s, at most {job.verdict_limit_s:g} s); resume waited for at most "
        f"{job.resume_limit_s:g} s",
        table_row(
            [
                "case",
                "declared",
                "first step after resume",
                "Slurm's verdict (down)",
                "worked first time",
                "Slurm acted on the job",
            ]
        ),
    ]
    medians: dict[str, dict[str, float | None]] = {}
    for case in cases:
        mine = [t for t in results if t.case == case]
        if not mine:
            continue
        declared = spread([t.declared_s for t in mine]) if case.launcher == "trainwarden" else (None, "— (none)")
        first = spread([t.first_step_s for t in mine])
        verdict = spread([t.verdict_s for t in mine])
        acted = [t.slurm for t in mine if t.slurm.actions]
        kinds = dict.fromkeys(kind for saw in acted for kind in saw.summary().split(" @")[0].split(", "))
        kill_text = f"{len(acted)}/{len(mine)}" + (f": {', '.join(kinds)}" if kinds else "")
        first_text = first[1] if first[0] is not None else f"never within {job.resume_limit_s:g} s"
        medians[case.name] = {"declared": declared[0], "first": first[0], "verdict": verdict[0]}
        rows.append(
            table_row(
                [
                    case.name,
                    declared[1],
                    first_text,
                    verdict[1],
                    f"{sum(t.worked for t in mine)}/{len(mine)}",
                    kill_text,
                ]
            )
        )
    for case in cases:
        mine = [t for t in results if t.case == case]
        if case.launcher != "trainwarden" or not mine:
            continue
        limit_s = job.node_timeout_s + DETECTION_SLACK_S
        rows.append(
            f"target {case.name}: declared within node_timeout_s + {DETECTION_SLACK_S:g} s (≤ {limit_s:g} s): "
            f"{sum(within(t, limit_s) for t in mine)}/{len(mine)}"
            + (
                f"; under {CRASH_TARGET_S:g} s: {sum(within(t, CRASH_TARGET_S) for t in mine)}/{len(mine)}"
                if case.fault == "crash"
                else ""
            )
            + f"; relaunch on the spare worked first time: {sum(t.worked for t in mine)}/{len(mine)}"
        )
    for case in cases:
        mine = [t for t in results if t.case == case]
        if case.launcher == "torchrun" and mine:
            counts: dict[str, int] = {}
            for t in mine:
                key = t.ended_by.split(" (")[0].split(",")[0].split(":")[0]
                counts[key] = counts.get(key, 0) + 1
            rows.append(f"{case.name} outcome: " + ", ".join(f"{k} {v}/{len(mine)}" for k, v in counts.items()))
    for fault in ("crash", "partition"):
        tw, tr = medians.get(f"trainwarden-{fault}"), medians.get(f"torchrun-{fault}")
        if tw is not None:
            rows.append(
                f"ratio Slurm's verdict / trainwarden declared ({fault}, medians): "
                f"{ratio(tw['verdict'], tw['declared'])}"
            )
        if tw is not None and tr is not None:
            why = "" if tr["first"] else f" (torchrun never resumed within {job.resume_limit_s:g} s)"
            rows.append(
                f"ratio torchrun / trainwarden first step after resume ({fault}, medians): "
                f"{ratio(tr['first'], tw['first'])}{why}"
            )
    return "\n".join(rows)


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per case")
    parser.add_argument("--steps", type=int, default=3000, help="training steps of the demo job")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--fault-step", type=int, default=12, help="the fault comes once every rank passed this step")
    parser.add_argument("--node-timeout-s", type=float, default=10.0, help="trainwarden's slurm.node_timeout_s")
    parser.add_argument(
        "--resume-limit-s", type=float, default=120.0, help="how long after the fault a run may take to train again"
    )
    parser.add_argument(
        "--verdict-limit-s",
        type=float,
        default=90.0,
        help="how long after the fault sinfo is polled for Slurm's verdict",
    )
    parser.add_argument(
        "--start-timeout-s", type=float, default=240.0, help="submission to every rank past the fault step"
    )
    parser.add_argument("--stop-timeout-s", type=float, default=120.0, help="trainwarden stop / scancel to job end")
    parser.add_argument(
        "--lock-timeout-s", type=float, default=1800.0, help="how long to wait for the cluster's session lock"
    )
    parser.add_argument(
        "--case",
        action="append",
        choices=[c.name for c in CASES],
        help="run only this case (repeatable; default: all four)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and job outputs")
    args = parser.parse_args(argv)
    if not 0 < args.fault_step < args.steps:
        parser.error("--fault-step must be between 0 and --steps")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    reason = cluster.available()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    job = Job(
        args.steps,
        args.save_every,
        args.fault_step,
        args.node_timeout_s,
        args.resume_limit_s,
        args.verdict_limit_s,
        args.start_timeout_s,
        args.stop_timeout_s,
    )
    cases = [c for c in CASES if not args.case or c.name in args.case]
    demo = demo_config()
    print_header(
        f"{args.trials} trials per case, cases {', '.join(c.name for c in cases)}; demo job "
        f"{NODES_PER_RUN} nodes x {NPROC_PER_NODE} ranks (gloo, CPU), {job.steps} steps, checkpoint every "
        f"{job.save_every}; fault once every rank passed step {job.fault_step}; trainwarden: spare_nodes 1, "
        f"slurm.node_timeout_s {job.node_timeout_s:g}, stop.kill_grace_s {demo['stop']['kill_grace_s']:g}, "
        f"restart.max_restarts {demo['restart']['max_restarts']}; torchrun: --max-restarts=3, c10d rendezvous"
    )
    started = time.monotonic()
    print("waiting for the cluster's session lock ...", flush=True)
    lock = cluster.lock_session(timeout=args.lock_timeout_s)
    results: list[Trial] = []
    started_cluster = False
    try:
        started_cluster = cluster.ensure_up(cluster.NODES)
        print(f"cluster: {slurm_facts()}" + ("; started by this benchmark" if started_cluster else ""), flush=True)
        with scratch_dir(args.keep) as work:
            try:
                for index in range(1, args.trials + 1):
                    for case in cases:
                        trial = run_trial(case, job, work / f"trial_{index}_{case.name}")
                        results.append(trial)
                        print(trial_line(index, args.trials, trial, job), flush=True)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                return 130
    finally:
        with sigint_deferred():
            if started_cluster:
                cluster.down()
            lock.close()
    print(summary(results, job, cases))
    print(f"total wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
