"""Bad GPU or bad batch: seeded trials of the three fault kinds on the demo job, each judged by re-running the step.

Each trial runs the demo's ranks (gloo, CPU; 2 or 4 of them, started directly with the variables torchrun would
set) with one fault on one rank at one step, drawn from a seeded generator:

- `bitflip@STEP` (bit 30 of one gradient value, once): the right verdict is `transient`, that rank's;
- `bitflip_persistent@STEP` (the same at every backward from STEP on): `persistent`, that rank's;
- `poison@STEP` (that rank's batch spikes the loss wherever it is trained): `data`, that rank's.

A trial is right when every rank's first `sdc_verdict` at the fault's step names the faulty rank with the right
verdict, and the ranks end as that verdict says (a persistent one: every rank leaves with exit 69, the others: 0).
Then the cost of fingerprints, in interleaved pairs of runs with and without them (`worker.fingerprints: false`),
each rank pinned to a core: the median step of one against the other (whose run-to-run spread, a few %
here, is larger than the cost), and `fingerprint cost per step: P %`, the time the fingerprinting code took in the
runs with it (the ranks' `fingerprint_cost` events, measured around that code) over their median step. The last
line: `verdicts right: K/N`.
The cost of a re-run: the step time at the fault against the median step before it (rank 0's step events).
Run from the repository root:  .venv/bin/python bench/sdc.py --quick   [--trials N] [--keep]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REPO, SCRIPT, print_header, read_events, scratch_dir

from supervisor.launch.ranks import free_port
from worker.contract import EXIT_BAD_DEVICE, RunLayout

KINDS = {"bitflip": "transient", "bitflip_persistent": "persistent", "poison": "data"}
CORES = sorted(os.sched_getaffinity(0))
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Trial:
    """One fault on one rank at one step of a demo run of `world` ranks."""

    kind: str
    world: int
    rank: int
    step: int

    @property
    def spec(self) -> str:
        return f"{self.rank}:{self.kind}@{self.step}"


def draw(trials: int, seed: int) -> list[Trial]:
    """`trials` faults: every kind in turn, 2 and 4 ranks in turn, the rank and step drawn."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    drawn = []
    for i in range(trials):
        world = (2, 4)[i // len(kinds) % 2]
        drawn.append(Trial(kinds[i % len(kinds)], world, rng.randrange(world), rng.randrange(4, 12)))
    return drawn


def run_demo(
    run_dir: Path, world: int, steps: int, *, faults: str = "", worker: dict[str, Any] | None = None, pin: bool = False
) -> int:
    """The demo's ranks, started directly (no supervisor: the verdicts are the worker library's); the worst exit.
    `pin`: rank r on core r (the cost runs: a run's placement on the cores moves its step time more than the cost)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_RUN_DIR": str(run_dir),
        "TRAINWARDEN_FAULTS": faults,
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"prefix": "demo", **(worker or {})}),
    }
    argv = [sys.executable, str(REPO / SCRIPT), "--steps", str(steps), "--eval-every", "0"]
    procs = [
        subprocess.Popen(
            argv,
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=open(run_dir.parent / f"{run_dir.name}_rank_{rank}.err", "wb"),  # noqa: SIM115 - closed by exit
            preexec_fn=functools.partial(os.sched_setaffinity, 0, {CORES[rank % len(CORES)]}) if pin else None,
        )
        for rank in range(world)
    ]
    try:
        return max(abs(proc.wait(timeout=TIMEOUT_S)) for proc in procs)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def judge_trial(index: int, trial: Trial, work: Path) -> tuple[bool, str, float | None]:
    """Whether every rank gave the right verdict at the fault's step; what they said; the re-run step's time over
    the median step's before the fault."""
    run_dir = work / f"{index}_{trial.kind}_{trial.world}r_rank{trial.rank}_step{trial.step}"
    run_dir.mkdir(parents=True)
    code = run_demo(run_dir, trial.world, trial.step + 4, faults=trial.spec)
    layout = RunLayout(run_dir)
    said, right = [], code == (EXIT_BAD_DEVICE if trial.kind == "bitflip_persistent" else 0)  # a bad device: all leave
    for rank in range(trial.world):
        events = read_events(layout.rank_events(rank))
        verdicts = [e for e in events if e.get("event") == "sdc_verdict" and e.get("step") == trial.step]
        first = verdicts[0] if verdicts else {}
        said.append(f"{first.get('verdict')}:{first.get('suspect')}")
        right = right and first.get("verdict") == KINDS[trial.kind] and first.get("suspect") == trial.rank
    steps = [e for e in read_events(layout.rank_events(0)) if e.get("event") == "step" and e.get("batch", 0) > 1]
    times = {e["batch"]: e["step_time_s"] for e in steps}
    before = [t for batch, t in times.items() if batch < trial.step - 1]
    rerun = times.get(trial.step - 1)
    cost = rerun / statistics.median(before) if rerun and before else None
    return right, f"exit {code}, ranks said {' '.join(said)}", cost


def fingerprint_cost(work: Path, pairs: int, steps: int) -> tuple[float | None, float | None, str]:
    """The demo's fingerprint cost per step, as % of its median step (2 ranks, each pinned to a core), two ways:
    the time the fingerprinting code itself took in the runs with it (their `fingerprint_cost` events), and the
    median step with fingerprints over the same without (`worker.fingerprints: false`), in interleaved pairs."""
    medians: dict[bool, list[float]] = {True: [], False: []}
    spent: list[float] = []
    for i in range(pairs):
        for on in (False, True):
            run_dir = work / f"cost_{i}_{'on' if on else 'off'}"
            run_dir.mkdir(parents=True)
            if run_demo(run_dir, 2, steps, worker={"fingerprints": on}, pin=True) != 0:
                return None, None, "a cost run failed"
            events = read_events(RunLayout(run_dir).rank_events(0))
            times = [e["step_time_s"] for e in events if e.get("event") == "step" and e.get("step", 0) > 10]
            medians[on].append(statistics.median(times))
            spent += [e["per_step_ms"] / 1000 for e in events if e.get("event") == "fingerprint_cost"]
    on, off = statistics.median(medians[True]), statistics.median(medians[False])
    pairwise = [(a / b - 1) * 100 for a, b in zip(medians[True], medians[False], strict=True)]
    spread = f"pairs {' '.join(f'{p:+.1f}' for p in pairwise)} %; median step {off * 1000:.1f} ms without"
    direct = statistics.median(spent) / on * 100 if spent else None
    return direct, (on / off - 1) * 100, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="21 trials and 4 cost pairs of 150 steps (< 5 minutes)")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--keep", action="store_true", help="keep the run dirs")
    args = parser.parse_args()
    trials, pairs, steps = (21, 4, 150) if args.quick else (args.trials, 5, 300)
    print_header(f"{trials} trials (seed {args.seed}), then {pairs} pairs of {steps}-step runs for the cost")
    with scratch_dir(args.keep) as work:
        right, costs = 0, []
        for index, trial in enumerate(draw(trials, args.seed), 1):
            ok, said, cost = judge_trial(index, trial, work)
            right += ok
            costs += [cost] if cost else []
            step_cost = f"{cost:.1f}x a step" if cost else "n/a"
            print(
                f"trial {index}/{trials}  {trial.world} ranks  {trial.spec:<26} expected {KINDS[trial.kind]}:"
                f"{trial.rank}  {said}  re-run step {step_cost}  {'right' if ok else 'WRONG'}",
                flush=True,
            )
        direct, against, spread = fingerprint_cost(work, pairs, steps)
    if costs:
        print(f"a step that is re-run takes {statistics.median(costs):.1f}x a median step (median of the trials)")
    shown = "n/a" if against is None else f"{against:+.1f}"
    print(f"median step with fingerprints against runs without them: {shown} % ({spread})")
    print(f"fingerprint cost per step: {'n/a' if direct is None else f'{direct:.2f}'} %")
    print(f"verdicts right: {right}/{trials}")


if __name__ == "__main__":
    main()
