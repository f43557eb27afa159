"""Memory-snapshot benchmark: the demo job through seeded rank kills, with and without the memory tier, in one run.

The demo job (2 ranks, gloo, CPU, `--steps` steps, a disk checkpoint every 100: `worker.save_checkpoint_steps: 100`)
runs under trainwarden, one run after another:

- fault-free: no faults, the memory tier off (`worker.snapshot_steps: 0`): the final state the others must end in,
  and the productive time;
- memory off: `--kills` SIGKILLs of a rank, the memory tier off: each kill goes back to the newest disk checkpoint;
- memory auto: the same kills, `snapshot_steps: auto` (the ranks choose the interval, `cadence_chosen`);
- memory every step: the same with `snapshot_steps: 1` (what the tier can do when the cadence is short);
- without `--quick`, also a fault-free run with `auto` (what the tier costs without faults).

The kills, drawn from `--seed`: each strikes a random rank right after a random step (`TRAINWARDEN_FAULTS` with
`TRAINWARDEN_FAULTS_ONCE=1`: a fault fires the first time its step is reached in any attempt, so the relaunched
ranks pass it), at least GAP_STEPS apart, none in the first or last 30 steps. trainwarden's config is
configs/demo.yaml that never gives up, as in bench/goodput.py (`max_restarts: 50`, no crash-loop breaker, no
backoff, a 10 s train timeout), warm standbys as by default. For each run:

- wall: from launch until the supervisor exits;
- per kill (from the ranks' `fault_injected` events and the journal): the step it struck after, the relaunch's
  resume step and `resume_source` (`ranks_launched`), the work lost (the journal's `work_lost`: `last_step`,
  `lost_s`), and the time from the kill to the relaunched ranks' first step ("back after");
- goodput, measured as bench/goodput.py measures it (the steps the newest complete checkpoint holds, at the run's
  own ideal step time from rank 0's step events, over the wall time), at the fault-free run's ideal step time ("at
  reference rate": a run that slows every step, with snapshots say, is charged for it; meaningful only when the
  machine ran every run alike, see "median step"), and the supervisor's own (the journal's last `goodput` event);
- snapshots: how many and their stall (`snapshot_saved`, `snapshot_pinned`: `stall_s`), the intervals chosen
  (`cadence_chosen`), and the supervisor's copies of pins to disk (`snapshot_persisted`, `persist_failed`);
- the supervisor's split of the wall time (the journal's last `goodput` event: productive, startup, restart, lost,
  save and slow seconds): where the time went;
- finished (exit 0, every rank's final checkpoint on disk) and bitwise = reference (every rank's final model and
  optimizer state equal the fault-free run's, bit for bit).

The last line: the memory-auto run's goodput over the fault-free run's, each measured at its own ideal step time
(as bench/goodput.py measures it: robust to the machine running one run's steps faster than another's, which
shared cores do); the line before it gives the same ratio at the reference rate and the supervisor's.
`--quick`: 800 steps, the first four runs: about 3.5 minutes on an idle 2-core machine (0.040 s steps), 5.5 to 9
with other work on the cores.
Run from the repository root:
    .venv/bin/python bench/memory_snapshots.py [--quick] [--steps N] [--kills N] [--seed N] [--timeout-s S] [--keep]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput import (
    EDGE_STEPS,
    MAX_DRAWS,
    REFERENCE_S_PER_STEP,
    TRAINWARDEN_POLICY,
    Fault,
    final_state,
    fmt3,
    journal_goodput,
    median_step_time,
    outcome,
    step_samples,
    table,
)
from harness import (
    NPROC,
    PREFIX,
    event_time,
    fmt,
    launched_to_end,
    print_header,
    rank_events,
    read_events,
    scratch_dir,
    trainwarden_launch,
)

from supervisor.observe.goodput import ideal_step_time
from worker.contract import RunLayout

SAVE_EVERY = 100  # disk checkpoints, as the issue sets them
GAP_STEPS = 50  # kills at least this many steps apart
BREAKDOWN = ("productive_s", "startup_s", "restart_s", "lost_s", "save_s", "slow_s", "hang_s", "stopped_s")
SUMMARY_LINE = "goodput under {kills} kills, memory snapshots / fault-free: {ratio}"


@dataclass(frozen=True)
class Variant:
    """One run's setup: its name, the memory tier's cadence (0: off) and whether the kills strike it."""

    name: str
    snapshot_steps: int | str
    faulty: bool


REFERENCE = Variant("fault-free", 0, False)
MEMORY_OFF = Variant("memory off", 0, True)
MEMORY_AUTO = Variant("memory auto", "auto", True)
QUICK = (MEMORY_OFF, MEMORY_AUTO, Variant("memory every step", 1, True))
FULL = (*QUICK, Variant("fault-free, auto", "auto", False))


@dataclass(frozen=True)
class Kill:
    """What became of one kill that fired."""

    fault: str
    resume_step: int | None
    source: str
    last_step: int | None
    lost_s: float | None
    back_after_s: float | None


@dataclass(frozen=True)
class Run:
    """What one run measured; None where it never happened."""

    variant: str
    wall_s: float
    exit_code: int | None
    finished: bool
    kept_step: int
    kills: list[Kill]
    relaunches: int
    ideal_s: float | None
    step_s: float | None
    supervisor_goodput: float | None
    snapshots: str
    breakdown: str  # the supervisor's split of the wall time
    bitwise: str
    run_dir: Path


# ---- the kills -------------------------------------------------------------------------------


def draw_kills(seed: int, steps: int, kills: int) -> tuple[Fault, ...]:
    """`kills` SIGKILLs right after random steps, GAP_STEPS apart; ValueError when the job is too short for them."""
    rng = random.Random(seed)
    low, high = EDGE_STEPS + 1, steps - EDGE_STEPS - 1
    for _ in range(MAX_DRAWS):
        picked = sorted(rng.sample(range(low, high + 1), kills)) if high - low + 1 >= kills else []
        if len(picked) == kills and all(b - a >= GAP_STEPS for a, b in zip(picked, picked[1:], strict=False)):
            return tuple(Fault(rng.randrange(NPROC), "sigkill", step) for step in picked)
    raise ValueError(
        f"cannot place {kills} kills {GAP_STEPS} steps apart between steps {low} and {high}: "
        "give more --steps or fewer --kills"
    )


def fault_env(faults: tuple[Fault, ...]) -> dict[str, str]:
    return {"TRAINWARDEN_FAULTS": ",".join(f.spec for f in faults), "TRAINWARDEN_FAULTS_ONCE": "1"}


# ---- one run -----------------------------------------------------------------------------------


def run_variant(
    variant: Variant, steps: int, faults: tuple[Fault, ...], work: Path, timeout_s: float, reference: Run | None
) -> Run:
    """Launch, wait for the supervisor within the limit, then read what the run left; never leaves a process."""
    work.mkdir(parents=True)
    extra = {**TRAINWARDEN_POLICY, "worker": {"snapshot_steps": variant.snapshot_steps}}
    env = fault_env(faults) if variant.faulty else {}
    launch = trainwarden_launch(work, steps, SAVE_EVERY, env=env, extra_config=extra)
    wall_s, exit_code = launched_to_end(launch, work, timeout_s)
    return read_run(variant, steps, launch.run_dir, wall_s, exit_code, reference)


def read_run(
    variant: Variant, steps: int, run_dir: Path, wall_s: float, exit_code: int | None, reference: Run | None
) -> Run:
    """What a run left in its run dir: the ranks' events, the journal, the checkpoints."""
    layout = RunLayout(run_dir)
    events = rank_events(layout)
    journal = read_events(layout.journal)
    finished, compared = final_state(layout, exit_code, steps, None if reference is None else reference.run_dir)
    return Run(
        variant=variant.name,
        wall_s=wall_s,
        exit_code=exit_code,
        finished=finished,
        kept_step=max(layout.checkpoints.complete_steps(NPROC, PREFIX), default=0),
        kills=kills_of(events, journal),
        relaunches=max((e.get("attempt", 0) for e in events), default=0),
        ideal_s=ideal_step_time(step_samples(events)),
        step_s=median_step_time(events),
        supervisor_goodput=journal_goodput(layout),
        snapshots=snapshot_summary(events, journal),
        breakdown=breakdown(journal),
        bitwise=compared,
        run_dir=run_dir,
    )


def kills_of(events: list[dict[str, Any]], journal: list[dict[str, Any]]) -> list[Kill]:
    """Each kill that fired, with the relaunch that followed it: the first launch after it."""
    fired = sorted((event_time(e), e) for e in events if e.get("event") == "fault_injected")
    launches = sorted((event_time(e), e) for e in journal if e.get("event") == "ranks_launched")
    lost = {e.get("attempt"): e for e in journal if e.get("event") == "work_lost"}
    kills = []
    for at, fault in fired:
        launch = next((e for t, e in launches if t > at), None)
        attempt = None if launch is None else launch.get("attempt")
        work = lost.get(attempt, {}) if attempt is not None else {}
        kills.append(
            Kill(
                fault=f"rank {fault['rank']} after step {fault['step']}",
                resume_step=None if launch is None else launch.get("resume_step"),
                source="none" if launch is None else launch.get("resume_source") or "disk",
                last_step=work.get("last_step"),
                lost_s=work.get("lost_s", 0.0 if launch is not None else None),
                back_after_s=first_step_after(events, attempt, at),
            )
        )
    return kills


def first_step_after(events: list[dict[str, Any]], attempt: int | None, since: float) -> float | None:
    """Seconds from `since` to the first step event of `attempt`."""
    times = [event_time(e) for e in events if e.get("event") == "step" and e.get("attempt") == attempt]
    return min(times) - since if attempt is not None and times else None


def snapshot_summary(events: list[dict[str, Any]], journal: list[dict[str, Any]]) -> str:
    """Snapshots and pins with their stalls, the intervals chosen, and the supervisor's copies to disk."""
    parts = [stalls(events, "snapshot_saved", "snapshots"), stalls(events, "snapshot_pinned", "pins")]
    chosen = [
        f"{e['interval_steps']} ({e.get('rule')})"
        for e in events
        if e.get("event") == "cadence_chosen" and not e["rank"]
    ]
    if chosen:
        parts.append(f"rank 0 chose every {', then '.join(dict.fromkeys(chosen))} steps")
    persisted = [e.get("seconds", 0.0) for e in journal if e.get("event") == "snapshot_persisted"]
    if persisted:
        parts.append(f"{len(persisted)} persisted (median {statistics.median(persisted):.3f} s)")
    for name in ("persist_failed", "snapshot_pin_superseded", "snapshot_passed_over", "memory_tier_off"):
        found = [e for e in [*journal, *events] if e.get("event") == name]
        if found:
            reason = found[0].get("reason")
            parts.append(f"{len(found)} {name}" + (f" (first: {reason})" if reason else ""))
    return "; ".join(p for p in parts if p) or "none"


def breakdown(journal: list[dict[str, Any]]) -> str:
    """The supervisor's split of the wall time (the journal's last `goodput` event), seconds by category."""
    found = [e for e in journal if e.get("event") == "goodput"]
    if not found:
        return "n/a"
    parts = [(key.removesuffix("_s"), value) for key, value in found[-1].items() if key in BREAKDOWN]
    return ", ".join(f"{name} {value:.1f}" for name, value in parts if value) + " s"


def stalls(events: list[dict[str, Any]], name: str, label: str) -> str:
    """'N label, stall total T s (median M ms)' over both ranks, or '' when there were none."""
    stall = [float(e.get("stall_s") or 0.0) for e in events if e.get("event") == name]
    if not stall:
        return ""
    return f"{len(stall)} {label}, stall {sum(stall):.2f} s in all (median {1000 * statistics.median(stall):.1f} ms)"


# ---- report ------------------------------------------------------------------------------------


def goodput(run: Run, ideal_s: float | None, steps: int) -> float | None:
    """The steps this run kept at the ideal step time given, over its wall time."""
    return None if ideal_s is None or run.wall_s <= 0 else ideal_s * min(run.kept_step, steps) / run.wall_s


def run_lines(run: Run, reference: Run, steps: int) -> list[str]:
    """The run's line, then a line per kill and one for the snapshots."""
    lines = [
        f"{run.variant:<18} wall {run.wall_s:6.1f} s  goodput {fmt(goodput(run, run.ideal_s, steps))}  "
        f"at reference rate {fmt(goodput(run, reference.ideal_s, steps))}  "
        f"supervisor's {fmt(run.supervisor_goodput)}  relaunches {run.relaunches}  finished {outcome(run)}  "
        f"(newest checkpoint {run.kept_step})  bitwise = reference: {run.bitwise}  median step {fmt3(run.step_s)} s"
    ]
    lines += [f"    kill: {kill_text(kill)}" for kill in run.kills]
    lines.append(f"    snapshots: {run.snapshots}")
    lines.append(f"    the supervisor's split of the wall time: {run.breakdown}")
    return lines


def kill_text(kill: Kill) -> str:
    back = "n/a" if kill.back_after_s is None else f"{kill.back_after_s:.2f} s"
    if kill.lost_s is None:
        lost = "lost n/a"
    elif kill.last_step is None or kill.resume_step is None:
        lost = f"lost {kill.lost_s:.2f} s"  # no work_lost event: the supervisor counted nothing lost
    else:
        lost = f"last step {kill.last_step}, lost {kill.lost_s:.2f} s ({kill.last_step - kill.resume_step} steps)"
    return f"{kill.fault}: resumed at step {kill.resume_step} from {kill.source}, {lost}, training again {back} after"


def summary(runs: list[Run], steps: int, kills: int) -> str:
    reference = runs[0]
    head = ["run", "wall s", "goodput", "at reference rate", "supervisor's", "lost s", "back after s", "resumed from"]
    head += ["finished", "bitwise = reference"]
    rows = [head] + [summary_row(r, reference, steps) for r in runs]
    lines = table(rows)
    lines.append(
        "goodput = steps kept x the run's own ideal step time / wall time; at reference rate: x the fault-free "
        f"run's, {fmt3(reference.ideal_s)} s; lost s, back after s: sums over the kills"
    )
    memory = next((r for r in runs if r.variant == MEMORY_AUTO.name), None)
    base = goodput(reference, reference.ideal_s, steps)
    at_reference = None if memory is None else goodput(memory, reference.ideal_s, steps)
    lines.append(
        f"memory auto / fault-free: at reference rate {ratio_text(at_reference, base)}, supervisor's "
        f"{ratio_text(memory and memory.supervisor_goodput, reference.supervisor_goodput)}"
    )
    own = None if memory is None else goodput(memory, memory.ideal_s, steps)
    lines.append(SUMMARY_LINE.format(kills=kills, ratio=ratio_text(own, base)))
    return "\n".join(lines)


def summary_row(run: Run, reference: Run, steps: int) -> list[str]:
    lost = [k.lost_s for k in run.kills if k.lost_s is not None]
    back = [k.back_after_s for k in run.kills if k.back_after_s is not None]
    sources = sorted({k.source for k in run.kills})
    return [
        run.variant,
        f"{run.wall_s:.1f}",
        fmt(goodput(run, run.ideal_s, steps)),
        fmt(goodput(run, reference.ideal_s, steps)),
        fmt(run.supervisor_goodput),
        f"{sum(lost):.2f}" if run.kills else "-",
        f"{sum(back):.2f}" if run.kills else "-",
        ", ".join(f"{sum(k.source == s for k in run.kills)} {s}" for s in sources) or "-",
        outcome(run),
        run.bitwise,
    ]


def ratio_text(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "n/a"


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first four runs only, a shorter job")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the demo job (2000; quick: 800)")
    parser.add_argument("--kills", type=int, default=5, help="rank SIGKILLs (5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kills' schedule")
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="limit for one run (default: 3 x the fault-free wall + 180 s)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else 800 if args.quick else 2000
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    try:
        faults = draw_kills(args.seed, args.steps, args.kills)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_header(
        f"{args.steps} steps, disk checkpoint every {SAVE_EVERY}; seed {args.seed}: "
        f"TRAINWARDEN_FAULTS={fault_env(faults)['TRAINWARDEN_FAULTS']} with TRAINWARDEN_FAULTS_ONCE=1"
    )
    with scratch_dir(args.keep) as work:
        try:
            runs = run_all(args.steps, faults, work, args.timeout_s, QUICK if args.quick else FULL)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    if runs is None:
        return 1
    print(summary(runs, args.steps, len(faults)))
    return 0


def run_all(
    steps: int, faults: tuple[Fault, ...], work: Path, timeout_s: float | None, variants: tuple[Variant, ...]
) -> list[Run] | None:
    """The fault-free run, then each variant in turn, printing as each ends; None if the fault-free run failed."""
    limit_s = timeout_s or REFERENCE_S_PER_STEP * steps + 120
    reference = run_variant(REFERENCE, steps, faults, work / "fault-free", limit_s, None)
    print("\n".join(run_lines(reference, reference, steps)), flush=True)
    if not reference.finished:
        print("the fault-free run did not finish: nothing to compare with", flush=True)
        return None
    limit_s = timeout_s or 3 * reference.wall_s + 180
    print(f"limit per run: {limit_s:.0f} s", flush=True)
    runs = [reference]
    for variant in variants:
        folder = work / variant.name.replace(" ", "_").replace(",", "")
        runs.append(run_variant(variant, steps, faults, folder, limit_s, reference))
        print("\n".join(run_lines(runs[-1], reference, steps)), flush=True)
    return runs


if __name__ == "__main__":
    sys.exit(main())
