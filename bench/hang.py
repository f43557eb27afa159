"""Hang benchmark: trainwarden's hang detection against plain torchrun on the demo job, in one invocation.

Each trial runs the demo job (2 ranks, gloo, CPU) under each launcher in turn (trainwarden, then torchrun)
with `TRAINWARDEN_FAULTS=1:hang@K`: after step K rank 1 sleeps forever and rank 0 blocks in the next
all-reduce. Hang start is the time of rank 1's `fault_injected` event (its events.jsonl); from there:

- hang→declared: the supervisor journal's `hang_suspected` event (trainwarden only; torchrun has no detector);
- hang→stacks: the journal's `stacks_collected` event (trainwarden only), with the verdict (`hang_detected`);
- hang→ranks stopped: until the first rank process of the hung attempt is gone (pids from the ranks'
  `rank_started` events, polled every 50 ms); for torchrun this is whatever broke the hang;
- hang→first step: until the earliest `step` event of a later attempt in any rank's events.jsonl;
- finished: the launcher exits 0 within the trial timeout;
- culprit: whether the hang names rank 1 in the end (`hang_detected`'s rank, the final verdict).

trainwarden runs a config derived from configs/demo.yaml with `hang: {heartbeat: required, phase_timeouts_s:
{train: T}, calibration: {enabled: false}}`; its target is a hang declared within T + 1 s. torchrun
(`--nproc-per-node 2 --max-restarts 3`) gets W seconds from hang start to resume training, else the trial
reports "not recovered" and every process of the run is SIGKILLed. Which mechanism ended the hang is read
from the journal and the ranks' stderr (e.g. a gloo timeout raised in rank 0).
Run from the repository root:
    .venv/bin/python bench/hang.py [--trials N] [--steps S] [--hang-step K] [--train-timeout-s T]
                                   [--torchrun-wait-s W] [--timeout-s LIMIT] [--keep]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from harness import (
    LAUNCHERS,
    POLL_S,
    Launch,
    demo_config,
    event_time,
    first_resumed_step,
    fmt,
    launched,
    poll,
    print_header,
    rank_events,
    ratio,
    read_events,
    run_trials,
    scratch_dir,
    spread,
    torchrun_launch,
    trainwarden_launch,
)

from worker.contract import RunLayout

HUNG_RANK = 1
GLOO_TIMEOUT_S = 60  # examples/demo_train.py's init_process_group timeout: torchrun's only way out of a hang
DETECTION_SLACK_S = 1.0  # the target: a hang is declared within its phase timeout plus this
# An uncaught exception as torch.distributed prints it: "[rank0]: RuntimeError: [.../x.cc:78] Timed out ...".
RANK_ERROR = re.compile(r"^\[rank(?P<rank>\d+)\]: (?P<error>\w+(?:Error|Exception)\b.*)$", re.MULTILINE)
SOURCE_LOCATION = re.compile(r"\[[^\]]*:\d+\] ")
WIDTH = 27  # of a summary column: "63.70 [63.05–64.35], 1 n/a"


@dataclass(frozen=True)
class Job:
    """What every trial runs, where rank 1 hangs, and how long each launcher is given."""

    steps: int
    hang_step: int
    save_every: int
    train_timeout_s: float
    torchrun_wait_s: float
    timeout_s: float

    @property
    def faults(self) -> dict[str, str]:
        return {"TRAINWARDEN_FAULTS": f"{HUNG_RANK}:hang@{self.hang_step}"}

    @property
    def hang_policy(self) -> dict[str, Any]:
        return {
            "heartbeat": "required",
            "phase_timeouts_s": {"train": self.train_timeout_s},
            "calibration": {"enabled": False},
        }

    def recovery_window_s(self, launcher: str) -> float:
        """Seconds from hang start the launcher gets to resume training."""
        return self.torchrun_wait_s if launcher == "torchrun" else self.timeout_s


@dataclass(frozen=True)
class Observed:
    """What polling a live run saw; wall-clock times (time.time())."""

    hang_at: float | None = None
    stopped: tuple[float, int] | None = None  # when, and which rank of the hung attempt was gone first
    first_step: tuple[float, int] | None = None  # when, and in which attempt
    exit_code: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Trial:
    """What one trial of one launcher measured; None where it never happened."""

    launcher: str
    declared_s: float | None
    stacks_s: float | None
    stopped_s: float | None
    first_step_s: float | None
    resumed_attempt: int | None
    exit_code: int | None
    named_rank: int | None  # the rank finally blamed: by the stacks, else by heartbeat silence
    ended_by: str
    note: str
    wall_s: float

    @property
    def finished(self) -> bool:
        return self.exit_code == 0


LAUNCH: dict[str, Callable[[Job, Path], Launch]] = {
    "trainwarden": lambda job, work: trainwarden_launch(
        work, job.steps, job.save_every, env=job.faults, hang=job.hang_policy
    ),
    "torchrun": lambda job, work: torchrun_launch(work, job.steps, job.save_every, env=job.faults),
}


# ---- observing a run -------------------------------------------------------------------------


def fault_event(layout: RunLayout) -> dict[str, Any] | None:
    """Rank 1's `fault_injected` event of the first attempt, once it is written."""
    events = rank_events(layout, [HUNG_RANK])
    return next((e for e in events if e.get("event") == "fault_injected" and e.get("attempt") == 0), None)


def attempt_pids(layout: RunLayout, attempt: int) -> dict[int, int]:
    """Rank -> pid of every rank that has started in `attempt`."""
    return {
        e["rank"]: e["pid"]
        for e in rank_events(layout)
        if e.get("event") == "rank_started" and e.get("attempt") == attempt
    }


def gone_rank(pids: dict[int, int]) -> int | None:
    """A rank whose process has exited (or is a zombie), if any."""
    for rank, pid in sorted(pids.items()):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return rank
        except psutil.NoSuchProcess:
            return rank
    return None


def monotonic_at(wall_at: float) -> float:
    """The monotonic time of the wall-clock instant `wall_at`."""
    return time.monotonic() + (wall_at - time.time())


def observe(launcher: subprocess.Popen, layout: RunLayout, job: Job, name: str, deadline: float) -> Observed:
    """Wait for the hang, then for the hung ranks to go and training to resume; every wait bounded."""
    fault = poll(lambda: fault_event(layout), deadline, POLL_S, launcher)
    if fault is None:
        return Observed(note=f"rank {HUNG_RANK} never reached the hang at step {job.hang_step}")
    hang_at = event_time(fault)
    window_s = job.recovery_window_s(name)
    recover_by = min(deadline, monotonic_at(hang_at + window_s))
    pids = attempt_pids(layout, 0)
    gone = poll(lambda: gone_rank(pids), recover_by, POLL_S, launcher)
    stopped = None if gone is None else (time.time(), gone)
    first = poll(lambda: first_resumed_step(rank_events(layout)), recover_by, POLL_S, launcher)
    if first is None and launcher.poll() is None:
        return Observed(hang_at, stopped, note=f"not recovered after {window_s:g} s")
    try:
        launcher.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return Observed(hang_at, stopped, first, note=f"timed out after {job.timeout_s:g} s")
    return Observed(hang_at, stopped, first, launcher.returncode)


# ---- after the run: journal and logs ------------------------------------------------------------


def journal_event(journal: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in journal if e.get("event") == name), None)


def journal_time(journal: list[dict[str, Any]], name: str) -> float | None:
    """Wall time of the first `name` event in the supervisor's journal."""
    event = journal_event(journal, name)
    return None if event is None else event_time(event)


def since(hang_at: float | None, at: float | None) -> float | None:
    """Seconds from hang start to `at`, both wall-clock."""
    return None if hang_at is None or at is None else at - hang_at


def first_rank_error(work: Path, layout: RunLayout) -> tuple[int, str] | None:
    """The first uncaught exception a rank printed: in torchrun's stderr or trainwarden's rank logs of attempt 0."""
    logs = [work / "launcher.err", *sorted(layout.attempt_log(0, 0, "err").parent.glob("*.err"))]
    for path in logs:
        try:
            match = RANK_ERROR.search(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if match:
            return int(match["rank"]), SOURCE_LOCATION.sub("", match["error"]).strip()
    return None


def ended_by(journal: list[dict[str, Any]], error: tuple[int, str] | None, stopped: tuple[float, int] | None) -> str:
    """Which mechanism broke the hang."""
    hang = journal_event(journal, "hang_detected")
    if hang is not None:
        return (
            f"trainwarden hang detection (named rank {hang.get('rank')} in phase {hang.get('phase')}, "
            f"silent {hang.get('silent_s')} s, timeout {hang.get('timeout_s')} s)"
        )
    if error is not None:
        kind = "gloo timeout" if "Timed out" in error[1] else "exception"
        return f"{kind} in rank {error[0]}: {error[1]}"
    if stopped is not None:
        return f"rank {stopped[1]} exited"
    return "nothing: still hung"


def named_rank(journal: list[dict[str, Any]]) -> int | None:
    """The rank the hang names in the end (by its flight recorder, its stacks, or else as the first silent one)."""
    return (journal_event(journal, "hang_detected") or {}).get("rank")


def stack_note(journal: list[dict[str, Any]]) -> str:
    collected = journal_event(journal, "stacks_collected")
    if collected is None:
        return ""
    names = sorted(f"{Path(p).parent.name}/{Path(p).name}" for p in collected.get("paths", []))
    return f"; {len(names)} stack files ({', '.join(names) or 'none'})"


# ---- one trial ---------------------------------------------------------------------------------


def run_trial(name: str, job: Job, work: Path) -> Trial:
    """Launch with rank 1 set to hang, measure; never leaves a process of the run behind."""
    work.mkdir(parents=True)
    launch = LAUNCH[name](job, work)
    layout = RunLayout(launch.run_dir)
    started = time.monotonic()
    with launched(launch, work) as launcher:
        seen = observe(launcher, layout, job, name, deadline=started + job.timeout_s)
    wall_s = time.monotonic() - started
    journal = read_events(layout.journal)
    hang_at, stopped, first = seen.hang_at, seen.stopped, seen.first_step
    return Trial(
        launcher=name,
        declared_s=since(hang_at, journal_time(journal, "hang_suspected")),
        stacks_s=since(hang_at, journal_time(journal, "stacks_collected")),
        stopped_s=since(hang_at, None if stopped is None else stopped[0]),
        first_step_s=since(hang_at, None if first is None else first[0]),
        resumed_attempt=None if first is None else first[1],
        exit_code=seen.exit_code,
        named_rank=named_rank(journal),
        ended_by="n/a" if hang_at is None else ended_by(journal, first_rank_error(work, layout), stopped),
        note=(seen.note or f"exit {seen.exit_code}") + stack_note(journal),
        wall_s=wall_s,
    )


# ---- report ------------------------------------------------------------------------------------


def within_target(trial: Trial, job: Job) -> bool:
    return trial.declared_s is not None and trial.declared_s <= job.train_timeout_s + DETECTION_SLACK_S


def trial_line(index: int, trials: int, t: Trial) -> str:
    resumed = f" (attempt {t.resumed_attempt})" if t.resumed_attempt else ""
    return (
        f"trial {index}/{trials}  {t.launcher:<11}  hang→declared {fmt(t.declared_s):>5} s  "
        f"hang→stacks {fmt(t.stacks_s):>5} s  hang→ranks stopped {fmt(t.stopped_s):>5} s  "
        f"hang→first step {fmt(t.first_step_s):>5} s{resumed}  {t.note}\n"
        f"    ended by: {t.ended_by}; trial took {t.wall_s:.1f} s"
    )


def configured_timeout(name: str, job: Job) -> str:
    if name == "trainwarden":
        return f"train phase {job.train_timeout_s:g} s"
    return f"none (gloo {GLOO_TIMEOUT_S} s)"


def table_row(name: str, timeout: str, cells: list[str], finished: str) -> str:
    return f"{name:<12} {timeout:<18} " + " ".join(f"{cell:<{WIDTH}}" for cell in cells) + f" {finished}"


def summary(results: list[Trial], job: Job) -> str:
    columns = ["hang→declared", "hang→stacks", "hang→ranks stopped", "hang→first step"]
    rows = [
        "medians [min–max] in seconds over the trials",
        table_row("launcher", "hang timeout", columns, "finished (exit 0)"),
    ]
    first_steps: dict[str, float | None] = {}
    for name in LAUNCHERS:
        mine = [t for t in results if t.launcher == name]
        measures = [
            [t.declared_s for t in mine],
            [t.stacks_s for t in mine],
            [t.stopped_s for t in mine],
            [t.first_step_s for t in mine],
        ]
        first_steps[name] = spread(measures[3])[0]
        rows.append(
            table_row(
                name,
                configured_timeout(name, job),
                [spread(values)[1] for values in measures],
                f"{sum(t.finished for t in mine)}/{len(mine)}",
            )
        )
    mine = [t for t in results if t.launcher == "trainwarden"]
    limit_s = job.train_timeout_s + DETECTION_SLACK_S
    rows.append(
        f"trainwarden detection within timeout + {DETECTION_SLACK_S:g} s (≤ {limit_s:g} s): "
        f"{sum(within_target(t, job) for t in mine)}/{len(mine)}"
    )
    rows.append(
        f"trainwarden named the hung rank {HUNG_RANK} (from stacks or silence): "
        f"{sum(t.named_rank == HUNG_RANK for t in mine)}/{len(mine)}"
    )
    for name in LAUNCHERS:
        counts = Counter(mechanism(t.ended_by) for t in results if t.launcher == name)
        rows.append(f"{name} hang ended by: " + ", ".join(f"{k} {v}/{sum(counts.values())}" for k, v in counts.items()))
    rows.append(
        f"ratio torchrun/trainwarden of median hang→first step (>1 means trainwarden is faster): "
        f"{ratio(first_steps['torchrun'], first_steps['trainwarden'])}"
    )
    return "\n".join(rows)


def mechanism(ended_by: str) -> str:
    """The short name of an `ended_by` text, for counting."""
    return ended_by.split(" (")[0].split(":")[0]


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80, help="training steps of the demo job")
    parser.add_argument("--hang-step", type=int, default=35, help="rank 1 hangs after this step")
    parser.add_argument("--train-timeout-s", type=float, default=5.0, help="trainwarden's hang.phase_timeouts_s.train")
    parser.add_argument(
        "--torchrun-wait-s",
        type=float,
        default=90.0,
        help="how long after hang start torchrun may take to resume training",
    )
    parser.add_argument("--timeout-s", type=float, default=240.0, help="limit for one trial of one launcher")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    args = parser.parse_args(argv)
    if not 0 < args.hang_step < args.steps:
        parser.error("--hang-step must be between 0 and --steps")
    return args


def main() -> int:
    args = parse_args()
    save_every = demo_config()["worker"]["save_checkpoint_steps"]
    job = Job(args.steps, args.hang_step, save_every, args.train_timeout_s, args.torchrun_wait_s, args.timeout_s)
    print_header(
        f"{args.trials} trials, {job.steps} steps, {job.faults['TRAINWARDEN_FAULTS']} "
        f"(rank {HUNG_RANK} hangs after step {job.hang_step}), checkpoint every {save_every} steps; "
        f"trainwarden train timeout {job.train_timeout_s:g} s, torchrun gets {job.torchrun_wait_s:g} s "
        f"to resume; trial limit {job.timeout_s:g} s"
    )
    with scratch_dir(args.keep) as work:
        try:
            results = run_trials(args.trials, work, lambda name, where: run_trial(name, job, where), trial_line)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    print(summary(results, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
