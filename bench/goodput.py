"""Goodput benchmark: the demo job through a seeded stream of faults under trainwarden and torchrun, in one invocation.

The demo job (2 ranks, gloo, CPU, `--steps` steps, a checkpoint every `--save-every`) runs five times, one after
another, each with the same faults (`TRAINWARDEN_FAULTS` plus `TRAINWARDEN_FAULTS_ONCE=1`: a fault fires the first
time its step is reached in any attempt, so the relaunched ranks pass it):

- reference: trainwarden with the spike alone (a skipped batch is part of the result, not an outage) and no warm
  standbys (nothing beside training on the cores): the final state the others must end in, and the productive time;
- trainwarden in place: the faulty job as trainwarden runs it by default: a killed rank's peer recovers in place
  (the same process runs the demo's training function again), the killed rank is replaced by a warm standby;
- trainwarden warm: the same with `restart: {in_place: false}`: every rank relaunched, from warm standby ranks;
- trainwarden cold: also with `standby: {enabled: false}`;
- torchrun: `torchrun --nproc-per-node 2 --max-restarts 50`, its default rendezvous;
- torchrun no-share: the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store at each restart).

The schedule, drawn from `--seed`: `--kills` SIGKILLs of a rank (the first halfway through writing a checkpoint,
the others right after a step), one hang (the rank sleeps forever after its step; its peer blocks in the next
all-reduce) and one gradient spike (x1000 on one rank; the worker library's adaptive guard skips the batch on every
rank). Each strikes a random rank, at least 2 x save_every steps after the one before, none in the first or last
30 steps. For each run:

- wall: from launch until the launcher exits;
- goodput (measured, by a stopwatch outside the supervisor, with the supervisor's definition): the steps the run's
  newest complete checkpoint holds, at the run's own ideal step time, over the wall time. The ideal step time: the
  run's steady state, from its rank 0's `step` event times (one sample per WINDOW consecutive steps of an attempt:
  their time over their number, saves included), the step-weighted mean of the samples within median +- 3 MAD of
  them (saves, stalls and the slow steps after a relaunch fall outside): the supervisor's rule, on the rank's own
  clock instead of heartbeats. Windows, not single steps: a step's own time has a tail (the allocator, the garbage
  collector, the OS) that is part of the steady state; a band around single steps cuts it off (on a fault-free run:
  1.7 % below its first-to-last step time, saves taken out; 10-step windows: 0.25 % above);
- supervisor's goodput: trainwarden's own ratio, the journal's final `goodput` event, and its difference from the
  measured one; the last line gives the largest difference over the trainwarden runs (reference included);
- at reference rate: the same with the reference's ideal step time, for launchers compared with each other (a
  launcher that slows every step is charged for it here, not in its own steady state);
- relaunches: the highest attempt number in the ranks' events (torchrun's restart count);
- faults survived: of the faults that fired (`fault_injected` events), those after which training went on past their
  step by itself, no person involved;
- finished: the launcher exits 0 and every rank's final checkpoint is on disk;
- bitwise = reference: every rank's final model and optimizer state equal the reference's, bit for bit;
- median step: of the `step` events' step times. The goodput above assumes the machine ran every run's steps as
  fast as the reference's; this shows where it did not (other work on the cores, warm standbys importing torch).

trainwarden's config is configs/demo.yaml that never gives up (`restart: {max_restarts: 50, crash_loop_attempts:
0, backoff_initial_s: 0}`) and declares a hang after 10 s of training silence (no calibration). torchrun has no hang
detection: the demo's 60 s gloo timeout is what ends the hang there. A run is limited to `--timeout-s` (default:
3 x the reference's wall time + 180 s); past it every process of the run is SIGKILLed and it counts as not finished.
`--quick` runs the reference and the three trainwarden variants only, of a shorter job (600 steps, 2 kills): about
4 minutes on 2 cores. Run from the repository root:
    .venv/bin/python bench/goodput.py [--quick] [--steps N] [--save-every N] [--kills N] [--seed N] [--timeout-s S]
                                      [--keep]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from harness import (
    NPROC,
    PREFIX,
    Launch,
    demo_config,
    event_time,
    fmt,
    launched_to_end,
    print_header,
    rank_events,
    ratio,
    read_events,
    scratch_dir,
    torchrun_launch,
    trainwarden_launch,
)

from supervisor.observe.goodput import ideal_step_time
from worker.checkpoint import read_checkpoint_file
from worker.contract import RunLayout

EDGE_STEPS = 30  # no fault this close to the start or the end of the job
SPIKE_MIN_STEP = 70  # the adaptive guard judges a step only once it has 64 healthy ones behind it
MAX_DRAWS = 10_000
MAX_RESTARTS = 50  # both launchers: never give up for want of restarts
GAP_SAVES = 2  # faults at least this many checkpoint intervals apart
REFERENCE_S_PER_STEP = 1.0  # the reference's limit without --timeout-s: ten times a demo step here, and then some
WINDOW = 10  # steps per sample of the measured ideal step time (a single step's tail is part of the steady state)
TRAINWARDEN_POLICY: dict[str, Any] = {
    "restart": {"max_restarts": MAX_RESTARTS, "crash_loop_attempts": 0, "backoff_initial_s": 0.0},
    "hang": {
        "phase_timeouts_s": {"startup": 120, "train": 10, "save": 120, "eval": 60},
        "calibration": {"enabled": False},
    },
}
COMPARED = ("model", "optimizer")  # the parts of a final checkpoint that must match the reference's


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule, as TRAINWARDEN_FAULTS names it."""

    rank: int
    kind: str
    step: int

    @property
    def spec(self) -> str:
        return f"{self.rank}:{self.kind}@{self.step}"


@dataclass(frozen=True)
class Job:
    """What every run trains and which faults strike it."""

    steps: int
    save_every: int
    faults: tuple[Fault, ...]

    def chosen(self, kinds: tuple[str, ...] | None) -> list[Fault]:
        """Every fault, or those of `kinds`."""
        return [f for f in self.faults if kinds is None or f.kind in kinds]

    def env(self, kinds: tuple[str, ...] | None) -> dict[str, str]:
        """The fault variables for the ranks."""
        return {"TRAINWARDEN_FAULTS": ",".join(f.spec for f in self.chosen(kinds)), "TRAINWARDEN_FAULTS_ONCE": "1"}


@dataclass(frozen=True)
class Variant:
    """One launcher setup: its name, how it launches the job (in a folder, with the fault variables), whether it is
    trainwarden, and which kinds of the schedule's faults it gets (None: all)."""

    name: str
    launch: Callable[[Job, Path, dict[str, str]], Launch]
    supervised: bool
    kinds: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Run:
    """What one run measured; None where it never happened."""

    variant: str
    wall_s: float
    exit_code: int | None
    finished: bool
    kept_step: int  # the newest checkpoint complete on every rank
    relaunches: int
    scheduled: int
    fired: int
    survived: int
    train_s: float | None  # first step event to last
    ideal_s: float | None  # steady-state step time, from rank 0's step events
    step_s: float | None  # median step time
    supervisor_goodput: float | None
    bitwise: str
    run_dir: Path


def warden(job: Job, work: Path, env: dict[str, str], *, standby: bool, in_place: bool = False) -> Launch:
    restart = {**TRAINWARDEN_POLICY["restart"], "in_place": in_place}
    extra = {**TRAINWARDEN_POLICY, "restart": restart, "standby": {"enabled": standby}}
    return trainwarden_launch(work, job.steps, job.save_every, env=env, extra_config=extra)


def torchrun(job: Job, work: Path, env: dict[str, str], *, share: bool) -> Launch:
    extra = {} if share else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # The demo's worker section for torchrun too: both launchers run the same worker library checks.
    return torchrun_launch(
        work, job.steps, job.save_every, env={**env, **extra}, max_restarts=MAX_RESTARTS, worker=demo_config()["worker"]
    )


REFERENCE = Variant("reference", lambda job, work, env: warden(job, work, env, standby=False), True, ("spike",))
FAULTY = (
    Variant("trainwarden in place", lambda job, work, env: warden(job, work, env, standby=True, in_place=True), True),
    Variant("trainwarden warm", lambda job, work, env: warden(job, work, env, standby=True), True),
    Variant("trainwarden cold", lambda job, work, env: warden(job, work, env, standby=False), True),
    Variant("torchrun", lambda job, work, env: torchrun(job, work, env, share=True), False),
    Variant("torchrun no-share", lambda job, work, env: torchrun(job, work, env, share=False), False),
)
QUICK = FAULTY[:3]


# ---- the fault schedule ----------------------------------------------------------------------


def draw_schedule(seed: int, steps: int, save_every: int, kills: int) -> tuple[Fault, ...]:
    """Faults drawn until they are far enough apart; ValueError when the job is too short for them."""
    rng = random.Random(seed)
    kinds = ["sigkill_in_save"] * min(kills, 1) + ["sigkill"] * max(kills - 1, 0) + ["hang", "spike"]
    low, high = EDGE_STEPS + 1, steps - EDGE_STEPS - 1
    for _ in range(MAX_DRAWS):
        faults = sorted((draw_fault(rng, kind, low, high, save_every) for kind in kinds), key=lambda f: f.step)
        if faults[0].step >= low and all(
            b.step - a.step >= GAP_SAVES * save_every for a, b in zip(faults, faults[1:], strict=False)
        ):
            return tuple(faults)
    raise ValueError(
        f"cannot place {len(kinds)} faults {GAP_SAVES * save_every} steps apart between steps {low} and "
        f"{high}: give more --steps, a smaller --save-every or fewer --kills"
    )


def draw_fault(rng: random.Random, kind: str, low: int, high: int, save_every: int) -> Fault:
    rank = rng.randrange(NPROC)
    if kind == "sigkill_in_save":  # only a save step writes a checkpoint
        first = math.ceil(low / save_every) * save_every
        return Fault(rank, kind, rng.randrange(first, high + 1, save_every) if first <= high else -1)  # -1: rejected
    return Fault(rank, kind, rng.randint(max(low, SPIKE_MIN_STEP) if kind == "spike" else low, high))


# ---- one run -----------------------------------------------------------------------------------


def run_variant(variant: Variant, job: Job, work: Path, timeout_s: float, reference: Run | None) -> Run:
    """Launch, wait for the launcher within the limit, then read what the run left; never leaves a process behind."""
    work.mkdir(parents=True)
    launch = variant.launch(job, work, job.env(variant.kinds))
    wall_s, exit_code = launched_to_end(launch, work, timeout_s)
    return read_run(variant, job, launch.run_dir, wall_s, exit_code, reference)


def read_run(
    variant: Variant, job: Job, run_dir: Path, wall_s: float, exit_code: int | None, reference: Run | None
) -> Run:
    """What a run left in its run dir: events, journal, checkpoints."""
    layout = RunLayout(run_dir)
    events = rank_events(layout)
    fired = fired_faults(events)
    finished, compared = final_state(layout, exit_code, job.steps, None if reference is None else reference.run_dir)
    return Run(
        variant=variant.name,
        wall_s=wall_s,
        exit_code=exit_code,
        finished=finished,
        kept_step=max(layout.checkpoints.complete_steps(NPROC, PREFIX), default=0),
        relaunches=max((e.get("attempt", 0) for e in events), default=0),
        scheduled=len(job.chosen(variant.kinds)),
        fired=len(fired),
        survived=sum(passed(fault, at, events) for fault, at in fired.items()),
        train_s=training_time(events),
        ideal_s=ideal_step_time(step_samples(events)),
        step_s=median_step_time(events),
        supervisor_goodput=journal_goodput(layout) if variant.supervised else None,
        bitwise=compared,
        run_dir=run_dir,
    )


def final_state(layout: RunLayout, exit_code: int | None, steps: int, reference_dir: Path | None) -> tuple[bool, str]:
    """Whether the run finished (exit 0, every rank's final checkpoint on disk), and whether its final state equals
    the reference's ('reference': it is the reference; 'n/a': no final checkpoint to compare)."""
    finished = exit_code == 0 and all(layout.checkpoints.file(r, steps, PREFIX).exists() for r in range(NPROC))
    if reference_dir is None:
        return finished, "reference"
    return finished, same_as(layout, reference_dir, steps) if finished else "n/a"


def fired_faults(events: list[dict[str, Any]]) -> dict[tuple[int, str, int], float]:
    """Each fault that fired, as (rank, kind, step), with when it first did."""
    fired: dict[tuple[int, str, int], float] = {}
    for e in events:
        if e.get("event") == "fault_injected":
            fired.setdefault((e["rank"], e["kind"], e["step"]), event_time(e))
    return fired


def passed(fault: tuple[int, str, int], fired_at: float, events: list[dict[str, Any]]) -> bool:
    """Whether training got past the fault's step after it fired."""
    step = fault[2]
    return any(e.get("event") == "step" and e["step"] > step and event_time(e) > fired_at for e in events)


def training_time(events: list[dict[str, Any]]) -> float | None:
    """Seconds from the first `step` event of any rank to the last."""
    times = [event_time(e) for e in events if e.get("event") == "step"]
    return max(times) - min(times) if times else None


def step_samples(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(seconds per step, WINDOW) for each run of WINDOW consecutive steps of rank 0 within one attempt."""
    steps = sorted(
        (e["attempt"], e["step"], event_time(e)) for e in events if e.get("event") == "step" and e.get("rank") == 0
    )
    samples, start = [], 0
    for end in range(1, len(steps)):
        if steps[end][0] != steps[start][0] or steps[end][1] != steps[start][1] + (end - start):
            start = end  # a new attempt, or a gap: windows start afresh
        elif end - start == WINDOW:
            samples.append(((steps[end][2] - steps[start][2]) / WINDOW, WINDOW))
            start = end
    return samples


def median_step_time(events: list[dict[str, Any]]) -> float | None:
    """The median `step_time_s`: shows whether the machine ran this run's steps as fast as the reference's."""
    times = [e["step_time_s"] for e in events if e.get("event") == "step" and "step_time_s" in e]
    return statistics.median(times) if times else None


def journal_goodput(layout: RunLayout) -> float | None:
    """The supervisor's own goodput ratio: the last `goodput` event of its journal."""
    found = [e for e in read_events(layout.journal) if e.get("event") == "goodput"]
    return found[-1].get("ratio") if found else None


# ---- bitwise comparison ----------------------------------------------------------------------


def same_as(layout: RunLayout, reference_dir: Path, steps: int) -> str:
    """'yes' when every rank's final model and optimizer state equal the reference's bit for bit, else where not."""
    theirs = RunLayout(reference_dir)
    for rank in range(NPROC):
        got = load(layout.checkpoints.file(rank, steps, PREFIX))
        want = load(theirs.checkpoints.file(rank, steps, PREFIX))
        for part in COMPARED:
            difference = bitwise_difference(got.get(part), want.get(part), f"rank {rank} {part}")
            if difference:
                return f"no: {difference}"
    return "yes"


def load(path: Path) -> dict[str, Any]:
    return read_checkpoint_file(path)  # either layout: a memory snapshot's copy is in worker.flat's


def bitwise_difference(a: Any, b: Any, where: str) -> str | None:
    """Where two nested values differ (None: nowhere): tensors by bytes, floats by bits, containers by contents."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))
        return None if same else f"{where} differs"
    if isinstance(a, float):  # a learning rate: bit for bit, NaN included
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{where}: {a!r} != {b!r}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys differ"
        return next((d for k in a if (d := bitwise_difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        pairs = enumerate(zip(a, b, strict=True))
        return next((d for i, (x, y) in pairs if (d := bitwise_difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"{where}: {a!r} != {b!r}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ---- report ------------------------------------------------------------------------------------


def goodput(run: Run, reference: Run, steps: int) -> float | None:
    """The steps this run kept at the reference's ideal step time, over this run's wall time."""
    if reference.ideal_s is None or run.wall_s <= 0:
        return None
    return reference.ideal_s * min(run.kept_step, steps) / run.wall_s


def measured(run: Run, steps: int) -> float | None:
    """The steps this run kept at its own ideal step time, over its wall time: the supervisor's definition."""
    return goodput(run, run, steps)


def gap(run: Run, steps: int) -> float | None:
    """The supervisor's goodput less the measured one."""
    stopwatch = measured(run, steps)
    return None if stopwatch is None or run.supervisor_goodput is None else run.supervisor_goodput - stopwatch


def fmt3(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f}"


def outcome(run: Run) -> str:
    if run.finished:
        return "yes"
    return "no (timed out)" if run.exit_code is None else f"no (exit {run.exit_code})"


def run_line(run: Run, reference: Run, job: Job) -> str:
    difference = gap(run, job.steps)
    own = (
        f", supervisor's goodput {fmt(run.supervisor_goodput)} (difference {difference:+.3f})"
        if difference is not None
        else ""
    )
    return (
        f"{run.variant:<18} wall {run.wall_s:7.1f} s  goodput {fmt(measured(run, job.steps))}{own}  "
        f"at reference rate {fmt(goodput(run, reference, job.steps))}  "
        f"relaunches {run.relaunches}  faults survived {survived(run)}  finished {outcome(run)}  "
        f"(newest checkpoint {run.kept_step})  bitwise = reference: {run.bitwise}  "
        f"median step {fmt3(run.step_s)} s"
    )


def survived(run: Run) -> str:
    """'K/N' of the faults that fired, and of how many were scheduled when fewer fired."""
    return f"{run.survived}/{run.fired}" + (f" of {run.scheduled}" if run.fired < run.scheduled else "")


def summary(runs: list[Run], job: Job) -> str:
    reference = runs[0]
    head = (
        "variant",
        "wall s",
        "goodput",
        "supervisor's goodput",
        "difference",
        "at reference rate",
        "relaunches",
        "faults survived",
        "finished",
        "bitwise = reference",
        "median step s",
    )
    rows = [
        [
            r.variant,
            f"{r.wall_s:.1f}",
            fmt(measured(r, job.steps)),
            fmt(r.supervisor_goodput),
            "n/a" if (d := gap(r, job.steps)) is None else f"{d:+.3f}",
            fmt(goodput(r, reference, job.steps)),
            str(r.relaunches),
            survived(r),
            outcome(r),
            r.bitwise,
            fmt3(r.step_s),
        ]
        for r in runs
    ]
    lines = table([list(head), *rows])
    lines.append(
        "goodput = steps kept x the run's own ideal step time / wall time; at reference rate: x the reference's, "
        f"{fmt3(reference.ideal_s)} s"
    )
    if any(r.variant.startswith("torchrun") for r in runs):
        lines += ratio_lines(runs[1:], reference, job)
    gaps = [abs(d) for r in runs if (d := gap(r, job.steps)) is not None]
    lines.append(f"goodput gap, supervisor vs measured: {max(gaps):.3f}" if gaps else "goodput gap: n/a")
    return "\n".join(lines)


def table(rows: list[list[str]]) -> list[str]:
    """The rows as lines of left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def ratio_lines(runs: list[Run], reference: Run, job: Job) -> list[str]:
    """Wall time and goodput of each trainwarden run against each torchrun run; >1 means trainwarden is better."""
    lines = ["ratios (>1: trainwarden is better; where a run did not finish, its wall time is its limit):"]
    wardens = [r for r in runs if r.variant.startswith("trainwarden")]
    for theirs in (r for r in runs if r.variant.startswith("torchrun")):
        for ours in wardens:
            mark = "" if theirs.finished and ours.finished else " (not both finished)"
            lines.append(
                f"  {theirs.variant}/{ours.variant}: wall {ratio(theirs.wall_s, ours.wall_s)}, "
                f"goodput {ours.variant}/{theirs.variant} "
                f"{ratio(goodput(ours, reference, job.steps), goodput(theirs, reference, job.steps))}{mark}"
            )
    return lines


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the reference and trainwarden only, a shorter job")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the demo job (1200; quick: 600)")
    parser.add_argument("--save-every", type=int, default=50, help="worker.save_checkpoint_steps")
    parser.add_argument("--kills", type=int, default=None, help="rank SIGKILLs, the first during a save (4; quick: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="limit for one run (default: 3 x the reference's wall time + 180 s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else 600 if args.quick else 1200
    args.kills = args.kills if args.kills is not None else 2 if args.quick else 4
    if args.save_every < 1 or args.kills < 0:
        parser.error("--save-every must be at least 1 and --kills at least 0")
    return args


def main() -> int:
    args = parse_args()
    try:
        faults = draw_schedule(args.seed, args.steps, args.save_every, args.kills)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    job = Job(args.steps, args.save_every, faults)
    print_header(
        f"{job.steps} steps, checkpoint every {job.save_every}; seed {args.seed}: "
        f"TRAINWARDEN_FAULTS={job.env(None)['TRAINWARDEN_FAULTS']} with TRAINWARDEN_FAULTS_ONCE=1"
    )
    with scratch_dir(args.keep) as work:
        try:
            runs = run_all(job, work, args.timeout_s, QUICK if args.quick else FAULTY)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    if runs is None:
        return 1
    print(summary(runs, job))
    return 0


def run_all(job: Job, work: Path, timeout_s: float | None, variants: tuple[Variant, ...]) -> list[Run] | None:
    """The reference, then each faulty variant in turn, printing a line as each ends; None if the reference failed."""
    reference = run_variant(
        REFERENCE, job, work / "reference", timeout_s or REFERENCE_S_PER_STEP * job.steps + 120, None
    )
    print(run_line(reference, reference, job), flush=True)
    if not reference.finished:
        print("the reference did not finish: nothing to compare with", flush=True)
        return None
    limit_s = timeout_s or 3 * reference.wall_s + 180
    print(f"limit per run: {limit_s:.0f} s", flush=True)
    runs = [reference]
    for variant in variants:
        runs.append(run_variant(variant, job, work / variant.name.replace(" ", "_"), limit_s, reference))
        print(run_line(runs[-1], reference, job), flush=True)
    return runs


if __name__ == "__main__":
    sys.exit(main())
