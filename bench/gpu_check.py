"""The GPU benchmark that bench/gpu_check.sh runs: what a user on one GPU meets, in one table, in under 5 minutes.

On the FSDP2 example (examples/fsdp_train.py --device cuda: NCCL, bf16 parameters, sharded checkpoints), 1 rank:

1. Crash -> first step, ~150M parameters (12 layers x 1024), a sharded save every 20 steps in the background, rank 0
   SIGKILLed inside the write of step 40 (a torn checkpoint directory is left to clean up), for trainwarden with a
   warm standby (the default), trainwarden cold (`standby.keep_warm: false`: no process waits; the relaunch's is
   spawned at its decision) and torchrun (`--max-restarts 1`; the worker library resumes by itself). Each is split
   into the parts the events show: detecting the crash (the fault's event to the journal's `rank_crashed`),
   launching (to `ranks_launched`), starting the script (to the rank's `rank_started`: Python, imports, CUDA,
   NCCL, the model), loading (to `resumed`) and the first step; torchrun's detecting and launching are one part
   (the kill to its new process's start, polled). A fourth row has the memory tier on (a snapshot every 5 steps in
   /dev/shm, the scheduled saves copied from there by the supervisor) and rank 0 SIGKILLed after step 47: it resumes
   from the snapshot of step 45 in memory, and its "load" is the resume from memory. A fifth row recovers in place:
   the same memory tier, and after step 47 rank 0's collective fails as if a peer's connection were lost
   (`peer_gone`: NCCL's communicator aborted, the process alive); the process runs the training function again
   (no new Python, CUDA context or imports: "start the script" is NCCL's new communicator and the model), and its
   "detect" includes the tenth of a second the supervisor waits for an exit that does not come. Every final model is
   compared bit for bit with an uninterrupted run's.
2. The stall per save, ~330M parameters (6 layers x 2048, ~3.6 GB a save), a save every 20 steps, synchronous and in
   the background: the first save, the steady ones, and a save due while the previous one is still being written
   (`slow_async_write@40:SECONDS` stretches the write of step 40 past the save interval): `stall_s`, its `waited_s`,
   and the `save_slower_than_interval` warning. The run dirs of this part lie in /dev/shm where it has room, so that
   the figures are the loop's, not the disk's (the line says where).
3. The preflight: `device: cuda` with 2 ranks on a machine with one GPU: exit code, time and the line it prints.

Run:  bench/gpu_check.sh [OUT_DIR]   (or python bench/gpu_check.py --out DIR; --cpu: a dry run of the same report on
a CPU with a tiny model, which checks the script, not the figures). The table goes to stdout and OUT_DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from harness import REPO, event_time, kill_run, read_events

from worker.contract import RunLayout

RUN_TIMEOUT_S = 150.0
CRASH_STEPS, CRASH_AT, SAVE_EVERY = 60, 40, 20
MEMORY_EVERY, MEMORY_KILL_AT = 5, 47  # the memory row: snapshots every 5 steps, killed after 47: back to 45
STALL_STEPS, SLOW_WRITE_S = 100, 8  # saves at 20, 40 (its write stretched), 60 (due while 40's is written), 80, 100


@dataclass(frozen=True)
class Sizes:
    """The two models and the device, for the GPU or for a dry run on a CPU."""

    device: str
    crash_model: tuple[str, ...]
    stall_model: tuple[str, ...]


GPU = Sizes("cuda", ("--n-layer", "12", "--n-embd", "1024"), ("--n-layer", "6", "--n-embd", "2048"))
CPU = Sizes("cpu", ("--n-layer", "2", "--n-embd", "64"), ("--n-layer", "2", "--n-embd", "256"))


# ---- running a job --------------------------------------------------------------------------------------------


def args_of(sizes: Sizes, model: tuple[str, ...], steps: int) -> list[str]:
    return ["--steps", str(steps), "--device", sizes.device, *model]


def trainwarden(run_dir: Path, sizes: Sizes, model: tuple[str, ...], steps: int, *sets: str) -> list[str]:
    overrides = [
        "nproc_per_node=1",
        f"device={sizes.device}",
        f"args={json.dumps(args_of(sizes, model, steps))}",
        f"worker.save_checkpoint_steps={SAVE_EVERY}",
        "hang.calibration.enabled=false",
        'hang.phase_timeouts_s={"startup": 300, "train": 60, "save": 120}',
        *sets,
    ]
    argv = [sys.executable, "-m", "supervisor", "run", "examples/fsdp.yaml", "--run-dir", str(run_dir)]
    return argv + [arg for value in overrides for arg in ("--set", value)]


def torchrun(run_dir: Path, sizes: Sizes, model: tuple[str, ...], steps: int) -> tuple[list[str], dict[str, str]]:
    worker = {"save_checkpoint_steps": SAVE_EVERY, "prefix": "fsdp", "checkpoint_format": "dcp", "async_save": True}
    env = {"TRAINWARDEN_RUN_DIR": str(run_dir), "TRAINWARDEN_WORKER_CONFIG": json.dumps(worker)}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun, "--nproc-per-node", "1", "--max-restarts", "1", "examples/fsdp_train.py"]
    return argv + args_of(sizes, model, steps), env


def run(name: str, out: Path, argv: list[str], env: dict[str, str], run_dir: Path, watch: bool = False) -> Job:
    """Run one job to its end (bounded); `watch`: note when each process running the script started (torchrun)."""
    started: dict[int, float] = {}
    with open(out / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if watch:
                    started.update(script_processes(proc.pid))
                time.sleep(0.01 if watch else 0.2)
        finally:
            timed_out = proc.poll() is None
            kill_run(proc, run_dir)
    return Job(name, run_dir, None if timed_out else proc.returncode, sorted(started.values()))


def supervised(
    name: str, work: Path, out: Path, sizes: Sizes, model: tuple[str, ...], steps: int, env: dict[str, str], *sets: str
) -> Job:
    """A job under trainwarden in WORK/NAME."""
    return run(name, out, trainwarden(work / name, sizes, model, steps, *sets), env, work / name)


def script_processes(pid: int) -> Iterator[tuple[int, float]]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            if any("fsdp_train.py" in part for part in child.cmdline()):
                yield child.pid, started_at(child.pid)
        except (psutil.Error, OSError):
            continue


def started_at(pid: int) -> float:
    """When `pid` started, as time.time(), to a clock tick: its start in clock ticks since boot (/proc/PID/stat)
    against the boot clock (psutil's create_time adds a boot time in whole seconds: up to 1 s early)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime; fields[0] is field 3
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


@dataclass(frozen=True)
class Job:
    name: str
    run_dir: Path
    code: int | None  # None: killed at the timeout
    script_starts: list[float]  # torchrun's: when each process running the script started

    def ranks(self) -> list[dict[str, Any]]:
        return read_events(RunLayout(self.run_dir).rank_events(0))

    def journal(self) -> list[dict[str, Any]]:
        return read_events(RunLayout(self.run_dir).root / "supervisor" / "events.jsonl")

    @property
    def ended(self) -> str:
        return "timed out" if self.code is None else f"exit {self.code}"


def first(events: list[dict[str, Any]], name: str, after: float = 0.0, **fields: Any) -> float | None:
    """When the first event `name` (with `fields`) at or after `after` was written."""
    for event in events:
        if event.get("event") != name or any(event.get(k) != v for k, v in fields.items()):
            continue
        if (at := event_time(event)) >= after:
            return at
    return None


# ---- 1. crash -> first step -----------------------------------------------------------------------------------


def crash_parts(job: Job, kind: str = "sigkill_in_async_write") -> tuple[float | None, list[tuple[str, float | None]]]:
    """Crash -> first step and its parts, for a job whose rank 0 was SIGKILLed (`kind`: inside the write of step
    CRASH_AT, or after step MEMORY_KILL_AT)."""
    ranks, journal = job.ranks(), job.journal()
    kill = first(ranks, "fault_injected", kind=kind)
    if kill is None:
        return None, []
    marks: list[tuple[str, float | None]] = []
    if job.script_starts:  # torchrun: no journal; the new process's start, polled
        marks.append(("detect + launch", next((t for t in job.script_starts if t >= kill), None)))
    else:  # a crash is seen as its rank's exit; a recovery in place with every rank alive as the unwinding
        seen = first(journal, "rank_crashed", kill) or first(journal, "unwinding", kill)
        marks += [("detect", seen), ("launch", first(journal, "ranks_launched", kill))]
    marks += [
        ("start the script", first(ranks, "rank_started", kill)),
        ("load", first(ranks, "resumed", kill)),
        ("first step", first(ranks, "step", kill)),
    ]
    parts, before = [], kill
    for part, at in marks:
        parts.append((part, None if at is None or before is None else at - before))
        before = at
    end = marks[-1][1]
    return (None if end is None else end - kill), parts


def same_model(job: Job, reference: Job) -> str:
    """Whether the job's newest checkpoint equals the reference's, tensor by tensor (exported by the CLI)."""
    files = []
    for each in (job, reference):
        path = each.run_dir.parent / f"{each.name}.pt"
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "export", str(each.run_dir), "-o", str(path)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            return f"export failed: {done.stderr.strip().splitlines()[-1:]}"
        files.append(path)
    import torch

    a, b = (torch.load(path, weights_only=True) for path in files)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return "bitwise equal" if same else "DIFFERENT"


def crash_table(work: Path, out: Path, sizes: Sizes) -> list[str]:
    faults = {"TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": f"0:sigkill_in_async_write@{CRASH_AT}"}
    model = sizes.crash_model
    reference = supervised("reference", work, out, sizes, model, CRASH_STEPS, {})
    jobs = [
        supervised("warm", work, out, sizes, model, CRASH_STEPS, faults),
        supervised("cold", work, out, sizes, model, CRASH_STEPS, faults, "standby.keep_warm=false"),
    ]
    argv, env = torchrun(work / "torchrun", sizes, model, CRASH_STEPS)
    jobs.append(run("torchrun", out, argv, {**env, **faults}, work / "torchrun", watch=True))
    # The memory tier: a snapshot every MEMORY_EVERY steps in /dev/shm (the scheduled saves pinned there and copied
    # to disk by the supervisor, so no background write to kill): killed after step MEMORY_KILL_AT, it resumes from
    # the snapshot before it, in memory.
    killed = {"TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": f"0:sigkill@{MEMORY_KILL_AT}"}
    jobs.append(
        supervised("memory", work, out, sizes, model, CRASH_STEPS, killed, f"worker.snapshot_steps={MEMORY_EVERY}")
    )
    lost = {"TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": f"0:peer_gone@{MEMORY_KILL_AT}"}
    jobs.append(
        supervised("in_place", work, out, sizes, model, CRASH_STEPS, lost, f"worker.snapshot_steps={MEMORY_EVERY}")
    )
    labels = (
        "trainwarden, warm standby",
        "trainwarden, cold",
        "torchrun",
        "trainwarden, warm, from memory",
        "trainwarden, in place, from memory",
    )
    rows = [
        "| launcher | crash -> first step | detect | launch | start the script | load | first step | "
        "ended | final model |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = {"memory": "sigkill", "in_place": "peer_gone"}
    for job, label in zip(jobs, labels, strict=True):
        total, parts = crash_parts(job, kinds.get(job.name, "sigkill_in_async_write"))
        if job.name in kinds:
            source = next((e for e in job.journal() if e.get("event") == "ranks_launched" and e.get("resume_step")), {})
            label = f"{label} (step {source.get('resume_step')}, {source.get('resume_source') or 'disk'})"
        spans = dict(parts)
        if "detect + launch" in spans:
            detect, launch = f"{fmt(spans['detect + launch'])} (both)", "-"
        else:
            detect, launch = fmt(spans.get("detect")), fmt(spans.get("launch"))
        cells = [fmt(spans.get(p)) for p in ("start the script", "load", "first step")]
        verdict = same_model(job, reference) if job.code == 0 and reference.code == 0 else "-"
        rows.append(f"| {label} | {fmt(total)} | {detect} | {launch} | {' | '.join(cells)} | {job.ended} | {verdict} |")
    return rows


# ---- 2. the stall per save ------------------------------------------------------------------------------------


def stall_table(work: Path, out: Path, sizes: Sizes) -> list[str]:
    fast = Path("/dev/shm")
    room = shutil.disk_usage(fast).free if fast.is_dir() else 0
    base = fast / "trainwarden-gpu-check" if room > (24 << 30) or sizes.device == "cpu" else work
    for name in ("sync", "async"):
        shutil.rmtree(base / name, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    slow = {"TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": f"0:slow_async_write@{2 * SAVE_EVERY}:{SLOW_WRITE_S}"}
    model = sizes.stall_model
    jobs = {
        "synchronous": supervised("sync", base, out, sizes, model, STALL_STEPS, {}, "worker.async_save=false"),
        "background": supervised("async", base, out, sizes, model, STALL_STEPS, slow),
    }
    rows = [
        f"Run dirs in {base} (a save every {SAVE_EVERY} steps; the background write of step {2 * SAVE_EVERY} "
        f"stretched by {SLOW_WRITE_S} s):",
        "",
        "| saves | first save | steady (median) | due while the previous is written: stall (waited) | written in "
        "(median) | warning |",
        "|---|---|---|---|---|---|",
    ]
    for label, job in jobs.items():
        events = job.ranks()
        saved = {e["step"]: e for e in events if e.get("event") == "checkpoint_saved"}
        staged = {e["step"]: e for e in events if e.get("event") == "checkpoint_staged"}
        # The loop's stall: what staging cost it in the background, the whole save when synchronous.
        stalls = {step: (e["stall_s"], e.get("waited_s", 0.0)) for step, e in staged.items()} or {
            step: (e["duration_s"], 0.0) for step, e in saved.items()
        }
        due = 3 * SAVE_EVERY if label == "background" else None  # the save due while the stretched one is written
        steady = [stall for step, (stall, _) in sorted(stalls.items())[1:] if step != due]
        first_stall = stalls[min(stalls)][0] if stalls else None
        overlap = "-" if due not in stalls else f"{fmt(stalls[due][0])} ({fmt(stalls[due][1])})"
        written = [e["duration_s"] for e in saved.values()]
        warning = next((e for e in events if e.get("event") == "save_slower_than_interval"), None)
        rows.append(
            f"| {label} ({job.ended}) | {fmt(first_stall)} | {fmt(median(steady))} | {overlap} | "
            f"{fmt(median(written))} | {'-' if warning is None else 'said once'} |"
        )
    shutil.rmtree(base / "sync", ignore_errors=True)
    shutil.rmtree(base / "async", ignore_errors=True)
    if base.parent == fast:  # ours alone: nothing of it may stay in shared memory
        shutil.rmtree(base, ignore_errors=True)
    return rows


# ---- 3. the preflight -----------------------------------------------------------------------------------------


def preflight_row(work: Path) -> list[str]:
    argv = [sys.executable, "-m", "supervisor", "run", "examples/fsdp.yaml", "--run-dir", str(work / "preflight"),
            "--set", "nproc_per_node=2", "--set", "device=cuda"]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    line = (done.stderr.strip().splitlines() or [""])[-1]
    return [f"2 ranks, `device: cuda`, on this machine: exit {done.returncode} after {took:.2f} s: `{line}`"]


# ---- the report -----------------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def machine(sizes: Sizes) -> str:
    import torch

    if sizes.device == "cpu":
        return f"CPU dry run (not GPU figures), torch {torch.__version__}"
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible to torch"
    return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu_check"))
    parser.add_argument("--cpu", action="store_true", help="a dry run on a CPU with a tiny model (checks the script)")
    args = parser.parse_args()
    sizes = CPU if args.cpu else GPU
    out, work = args.out.resolve(), Path("/tmp/gpu_check_runs")
    shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True)
    began = time.monotonic()
    report = [f"On {machine(sizes)}; `bench/gpu_check.sh`, {time.strftime('%Y-%m-%d')}", ""]
    sections = [
        ("Crash -> first step, 1 rank, ~150M parameters", crash_table),
        ("Stall per save, 1 rank, ~330M parameters", stall_table),
    ]
    print(report[0], flush=True)
    for title, table in sections:
        report += [f"{title}:", "", *table(work, out, sizes), ""]
        print(f"{title}: done after {time.monotonic() - began:.0f} s", flush=True)
    report += ["Preflight:", "", *preflight_row(work), ""]
    report.append(f"(the whole check took {time.monotonic() - began:.0f} s)")
    text = "\n".join(report)
    print(text)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
