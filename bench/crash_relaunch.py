"""Crash→relaunch benchmark: trainwarden (in place, warm standbys, cold) against torchrun on the demo job, in one
invocation.

Each trial runs the demo job (2 ranks, gloo, CPU) under each launcher in turn: `in place` (trainwarden's default:
the surviving rank stays and runs the demo's training function again, the killed one is replaced by a warm standby),
`tw warm` (`--set restart.in_place=false`: every rank is relaunched, from warm standbys), `tw cold` (also
`--set standby.enabled=false`), `torchrun` (`--max-restarts 3`, its default rendezvous) and `torchrun ns` (the same
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store for every round, the variant whose restarts work).
We measure start→first step: from the launcher's start until the first attempt's earliest `step` event
(trainwarden forks its first ranks from the fork server's one import, by default; `tw cold` and torchrun start each
rank's own Python). Once rank 1's heartbeat reports step K, rank 1 is SIGKILLed and:

- crash→relaunch: from the kill until the new attempt's ranks start: for torchrun the earliest psutil
  `create_time()` of a new descendant running demo_train.py (polled every 10 ms); for trainwarden its journal's
  `ranks_launched` of the new attempt (a warm rank's process existed before the kill);
- crash→first step: from the kill until the earliest `step` event of a later attempt in the ranks'
  events.jsonl (attempt 1, or a later one when the first relaunch failed; the trial line says which); the last line
  is in place's median over torchrun's, the issue's figure (target ≤ 0.04);
- worked first time: the launcher exits 0 within the trial timeout, the final checkpoint exists, and
  attempt 2 never appears (no second relaunch).

The kill comes at step 100 by default: standbys are spawned when the ranks start training and need a few seconds of
a busy 2-core machine to import torch; the trial line says how many were ready.
A trial past its timeout has every process of the run SIGKILLed and counts as not worked.
Run from the repository root:  .venv/bin/python bench/crash_relaunch.py [--trials N] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from harness import (
    NPROC,
    POLL_S,
    PREFIX,
    Launch,
    event_time,
    first_resumed_step,
    fmt,
    launched,
    poll,
    print_header,
    rank_events,
    ratio,
    read_events,
    read_heartbeat,
    run_trials,
    scratch_dir,
    spread,
    torchrun_launch,
    trainwarden_launch,
)

from worker.contract import RunLayout

KILLED_RANK = 1
RELAUNCH_POLL_S = 0.01


@dataclass(frozen=True)
class Job:
    """What every trial runs and when it kills rank 1."""

    steps: int
    kill_step: int
    save_every: int
    timeout_s: float


@dataclass(frozen=True)
class Trial:
    """What one trial of one launcher measured; None where it never happened."""

    launcher: str
    start_s: float | None
    relaunch_s: float | None
    first_step_s: float | None
    resumed_attempt: int | None
    worked: bool
    note: str
    wall_s: float


def setting(launch: Launch, *settings: str) -> Launch:
    """trainwarden with `--set` settings."""
    return Launch([*launch.argv, *(arg for each in settings for arg in ("--set", each))], launch.env, launch.run_dir)


OFF = "restart.in_place=false"  # every rank is relaunched
LAUNCH: dict[str, Callable[[Job, Path], Launch]] = {
    "in place": lambda job, work: trainwarden_launch(work, job.steps, job.save_every),
    "tw warm": lambda job, work: setting(trainwarden_launch(work, job.steps, job.save_every), OFF),
    # without warm standby ranks: every relaunched rank starts Python and imports torch anew
    "tw cold": lambda job, work: setting(
        trainwarden_launch(work, job.steps, job.save_every), OFF, "standby.enabled=false"
    ),
    "torchrun": lambda job, work: torchrun_launch(work, job.steps, job.save_every),
    # the variant whose restarts work (research: pytorch#135712): a new TCPStore for every rendezvous round
    "torchrun ns": lambda job, work: torchrun_launch(
        work, job.steps, job.save_every, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    ),
}


# ---- observing a run -------------------------------------------------------------------------


def beat_at(layout: RunLayout, step: int) -> dict[str, Any] | None:
    """Rank 1's heartbeat once the first attempt has reached `step`."""
    beat = read_heartbeat(layout, KILLED_RANK)
    return beat if beat and beat.get("attempt") == 0 and beat.get("step", -1) >= step else None


def relaunched_at(layout: RunLayout) -> float | None:
    """When trainwarden started the second attempt's ranks (its journal): a warm standby existed before the crash,
    so the process's own start time would not say it."""
    launches = [e for e in read_events(layout.journal) if e.get("event") == "ranks_launched" and e.get("attempt")]
    return min((event_time(e) for e in launches), default=None)


def rank_procs(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """Descendants of the launcher that run the training script."""
    found = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any(arg.endswith("demo_train.py") for arg in proc.cmdline()):
                    found[proc.pid] = proc
    return found


def started_at(proc: psutil.Process) -> float:
    """A process's creation time on the time.time() clock, to 10 ms."""
    # psutil adds /proc/stat's whole-second btime to the since-boot start time; correct to the real boot instant.
    boot_error_s = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) - psutil.boot_time()
    return proc.create_time() + boot_error_s


class NewRanks:
    """A check for `poll`: the rank processes that appeared since `before`, once every rank exists."""

    def __init__(self, launcher: subprocess.Popen, before: set[int]) -> None:
        self.launcher, self.before = launcher, before
        self.seen: dict[int, psutil.Process] = {}

    def __call__(self) -> list[psutil.Process] | None:
        fresh = rank_procs(self.launcher)
        self.seen.update({pid: p for pid, p in fresh.items() if pid not in self.before})
        return list(self.seen.values()) if len(self.seen) >= NPROC else None


# ---- one trial ---------------------------------------------------------------------------------


def run_trial(name: str, job: Job, work: Path) -> Trial:
    """Launch, kill rank 1 at the kill step, measure; never leaves a process of the run behind."""
    work.mkdir(parents=True)
    launch = LAUNCH[name](job, work)
    started, started_wall = time.monotonic(), time.time()
    with launched(launch, work) as launcher:
        measured = measure(launcher, RunLayout(launch.run_dir), job, deadline=started + job.timeout_s)
    first = min((event_time(e) for e in rank_events(RunLayout(launch.run_dir)) if is_step(e, attempt=0)), default=None)
    return Trial(name, None if first is None else first - started_wall, *measured, wall_s=time.monotonic() - started)


def is_step(event: dict[str, Any], attempt: int) -> bool:
    return event.get("event") == "step" and event.get("attempt", 0) == attempt


def measure(
    launcher: subprocess.Popen, layout: RunLayout, job: Job, deadline: float
) -> tuple[float | None, float | None, int | None, bool, str]:
    beat = poll(lambda: beat_at(layout, job.kill_step), deadline, POLL_S, launcher)
    if beat is None:
        return None, None, None, False, f"rank {KILLED_RANK} never reached step {job.kill_step}"
    before = set(rank_procs(launcher))
    ready = standbys_ready(layout)
    killed_at = time.time()
    os.kill(beat["pid"], signal.SIGKILL)
    new = NewRanks(launcher, before)
    if not layout.journal.parent.exists():  # torchrun: its new rank processes are the relaunch
        poll(new, deadline, RELAUNCH_POLL_S, launcher)
    with contextlib.suppress(subprocess.TimeoutExpired):
        launcher.wait(timeout=max(0.0, deadline - time.monotonic()))
    relaunched = (
        relaunched_at(layout)
        if layout.journal.parent.exists()
        else min((started_at(p) for p in new.seen.values()), default=None)
    )
    relaunch_s = None if relaunched is None else relaunched - killed_at
    events = rank_events(layout)
    first = first_resumed_step(events)
    first_step_s, resumed_attempt = (None, None) if first is None else (first[0] - killed_at, first[1])
    worked, note = verdict(launcher.returncode, events, layout, job)
    if ready is not None:
        note += f"; standbys ready at the kill: {ready}/{NPROC}"
    return relaunch_s, first_step_s, resumed_attempt, worked, note


def standbys_ready(layout: RunLayout) -> int | None:
    """How many warm standbys were done importing (trainwarden's status file); None without any."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(layout.state_file.read_text()).get("standbys_ready")
    return None


def verdict(returncode: int | None, events: list[dict[str, Any]], layout: RunLayout, job: Job) -> tuple[bool, str]:
    """Whether the one relaunch took the run to its end, and if not, why."""
    if returncode is None:
        return False, f"timed out after {job.timeout_s:g} s"
    if returncode != 0:
        return False, f"launcher exited {returncode}"
    if max((e.get("attempt", 0) for e in events), default=0) >= 2:
        return False, "relaunched more than once"
    if not layout.checkpoints.file(0, job.steps, PREFIX).exists():
        return False, "no final checkpoint"
    return True, "ok"


# ---- report ------------------------------------------------------------------------------------


def trial_line(index: int, trials: int, t: Trial) -> str:
    resumed = f" (attempt {t.resumed_attempt})" if t.resumed_attempt else ""
    return (
        f"trial {index}/{trials}  {t.launcher:<11}  start→first step {fmt(t.start_s):>5} s  "
        f"crash→relaunch {fmt(t.relaunch_s):>5} s  "
        f"crash→first step {fmt(t.first_step_s):>5} s{resumed}  {'worked' if t.worked else 'FAILED'} "
        f"({t.note}), trial took {t.wall_s:.1f} s"
    )


def summary(results: list[Trial]) -> str:
    rows = [
        f"{'launcher':<12} {'start→first step s, median [min–max]':<38} {'crash→relaunch s, median [min–max]':<36} "
        f"{'crash→first step s, median [min–max]':<38} worked first time"
    ]
    medians: dict[str, tuple[float | None, float | None]] = {}
    starts: dict[str, float | None] = {}
    for name in LAUNCH:
        mine = [t for t in results if t.launcher == name]
        starts[name], start_text = spread([t.start_s for t in mine])
        relaunch, relaunch_text = spread([t.relaunch_s for t in mine])
        first, first_text = spread([t.first_step_s for t in mine])
        medians[name] = (relaunch, first)
        rows.append(
            f"{name:<12} {start_text:<38} {relaunch_text:<36} {first_text:<38} "
            f"{sum(t.worked for t in mine)}/{len(mine)}"
        )
    rows.append(
        "start→first step, trainwarden / baseline of medians: "
        + ", ".join(f"/ {name} {ratio(starts['in place'], starts[name])}" for name in ("tw cold", *TORCHRUN))
    )
    rows.append(
        "crash→relaunch, baseline / trainwarden (warm) of medians: "
        + ", ".join(f"{name} {ratio(medians[name][0], medians['tw warm'][0])}" for name in ("tw cold", *TORCHRUN))
    )
    rows.append(
        "crash→first step, trainwarden (warm) / baseline of medians: "
        + ", ".join(f"/ {name} {ratio(medians['tw warm'][1], medians[name][1])}" for name in ("tw cold", *TORCHRUN))
    )
    rows.append(
        "crash→first step, in place / baseline of medians: "
        + ", ".join(f"/ {name} {ratio(medians['in place'][1], medians[name][1])}" for name in ("tw warm", "tw cold"))
    )
    rows.append(last_line(medians["in place"][1], {name: medians[name][1] for name in TORCHRUN}, results))
    return "\n".join(rows)


def last_line(in_place: float | None, torchruns: dict[str, float | None], results: list[Trial]) -> str:
    """The issue's figure (target ≤ 0.04): against plain torchrun, or against `torchrun ns` where no restart of
    plain torchrun resumed (its shared rendezvous store wedges restarts: pytorch#135712), saying so."""
    name = "torchrun" if torchruns["torchrun"] else "torchrun ns"
    baseline = torchruns[name]
    if not in_place or not baseline:
        return "crash→first step, in place / torchrun: n/a (no trial of either resumed)"
    why = ""
    if name != "torchrun":
        tried = [t for t in results if t.launcher == "torchrun"]
        why = f" (against torchrun ns: plain torchrun resumed in 0/{len(tried)} trials)"
    return f"crash→first step, in place / torchrun: {in_place / baseline:.3f}{why}"


TORCHRUN = ("torchrun", "torchrun ns")


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150, help="training steps of the demo job")
    # Late enough for standbys spawned at the first step to have imported torch on 2 busy cores, as in a long run.
    parser.add_argument("--kill-step", type=int, default=100, help="SIGKILL rank 1 once its heartbeat shows this step")
    parser.add_argument("--save-every", type=int, default=10, help="worker.save_checkpoint_steps")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit for one trial of one launcher")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    args = parser.parse_args(argv)
    if not 0 < args.kill_step < args.steps:
        parser.error("--kill-step must be between 0 and --steps")
    return args


def main() -> int:
    args = parse_args()
    job = Job(args.steps, args.kill_step, args.save_every, args.timeout_s)
    print_header(
        f"{args.trials} trials, {job.steps} steps, SIGKILL rank {KILLED_RANK} at step {job.kill_step}, "
        f"checkpoint every {job.save_every} steps"
    )
    with scratch_dir(args.keep) as work:
        try:
            results = run_trials(
                args.trials, work, lambda name, where: run_trial(name, job, where), trial_line, names=LAUNCH
            )
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
