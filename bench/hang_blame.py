"""Blame benchmark: does trainwarden name the right culprit, of the right class, for every kind of hang?

Each round runs the demo job (4 ranks, gloo, CPU) under the supervisor through a stream of faults, each firing once
(`TRAINWARDEN_FAULTS_ONCE=1`), on a rank that changes from round to round. Two jobs: the demo as it is (a
checkpoint every 5 steps, saved in the loop), and the demo saving sharded checkpoints (DCP) in the background every
3 steps, so a save is in flight, or its collectives on the checkpoint writer's own process group are in the record,
when each fault strikes (NumPy needed: `pip install -e '.[dcp]'`). The faults:
- `hang`: the rank sleeps before the next all-reduce (expected class: host-side);
- `dataloader_hang`: it waits for a DataLoader worker that never delivers (host-side);
- `stall_in_collective`: its all-reduce never completes on its side, its peers go on to the next (in-collective);
- `extra_collective`: it issues one all-reduce more than its peers (desync; gloo usually aborts a rank);
- `collective_sizes`: its all-reduce has one element fewer (desync);
- `sigstop`: it freezes itself (silent);
- `hang_in_async_write` (background saves only): its checkpoint writer stalls inside a shard write, the loops go on
  to the next save and wait there (host-side, in phase save);
- `slow`: from then on every step of it takes 0.5 s longer, its peers wait for it, every rank still beats inside the
  train timeout: it must be neither declared hung nor blamed (checked for the rest of the run).
For each fault the journal gives: declared after (the fault's `fault_injected` event to the supervisor's
`hang_suspected`, or for a collective that failed, its `rank_crashed`), named after (to `hang_detected` or
`culprit_named`), the rank and class named, and what named it. A trial is right when rank and class are both right
(for `slow`: when nothing was declared or blamed after it struck; for a stuck writer: the phase named is `save` too).
The train timeout is 2 s, the save timeout 30 s (6 s with background saves); calibration off.
Run from the repository root:
    .venv/bin/python bench/hang_blame.py [--quick] [--rounds N] [--background-rounds M] [--keep]
--quick: 3 rounds of the demo and 1 with background saves (29 trials), about 5 minutes on 2 cores; the default:
5 and 2 (51 trials).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    event_time,
    launched,
    print_header,
    rank_events,
    read_events,
    scratch_dir,
    spread,
    trainwarden_launch,
)

from worker.contract import RunLayout

NPROC = 4
TRAIN_TIMEOUT_S = 2.0
SLOW_S = 0.5
ROUND_TIMEOUT_S = 240.0
Stream = list[tuple[str, int, str | None]]  # (kind, step, expected class: None for `slow`, never blamed)


@dataclass(frozen=True)
class Job:
    """The demo with one way of saving, and the faults that strike it."""

    name: str  # in the report
    stream: Stream  # one fault every few steps, slow last (it stays for the rest of the run)
    steps: int
    save_every: int
    save_timeout_s: float
    worker: dict[str, Any]  # more of the worker config


SYNC = Job(
    "saved in the loop",
    [
        ("hang", 6, "host-side"),
        ("dataloader_hang", 12, "host-side"),
        ("stall_in_collective", 18, "in-collective"),
        ("extra_collective", 24, "desync"),
        ("collective_sizes", 30, "desync"),
        ("sigstop", 36, "silent"),
        ("slow", 40, None),
    ],
    steps=52,
    save_every=5,
    save_timeout_s=30.0,
    worker={},
)
# A save every 3 steps: faults on a save step (the peers' writers then wait for the culprit's in the writer's group)
# and right after one (its write may still be in flight); the stuck writer's save step is a save step.
BACKGROUND = Job(
    "sharded, background",
    [
        ("hang", 7, "host-side"),
        ("dataloader_hang", 12, "host-side"),
        ("stall_in_collective", 19, "in-collective"),
        ("extra_collective", 25, "desync"),
        ("collective_sizes", 30, "desync"),
        ("sigstop", 34, "silent"),
        ("hang_in_async_write", 39, "host-side"),
        ("slow", 46, None),
    ],
    steps=58,
    save_every=3,
    save_timeout_s=6.0,
    worker={"checkpoint_format": "dcp", "async_save": True},
)
IN_SAVE = {"hang_in_async_write"}  # faults whose hang must be named in phase save


@dataclass(frozen=True)
class Trial:
    """One fault and what the supervisor said about it."""

    job: str
    kind: str
    rank: int
    expected: str | None
    declared_s: float | None  # fault -> hang declared (or the first crash of a failed collective)
    named_s: float | None  # fault -> verdict
    named_rank: int | None
    named_class: str | None
    named_by: str | None
    named_phase: str | None = None

    @property
    def right(self) -> bool:
        if self.expected is None:  # slow: nothing may be declared or blamed
            return self.declared_s is None and self.named_rank is None
        in_save = self.kind not in IN_SAVE or self.named_phase == "save"
        return (self.named_rank, self.named_class) == (self.rank, self.expected) and in_save


def faults_of(job: Job, round_index: int) -> str:
    """Round r puts kind i on rank (i + r) % NPROC; slow gets its seconds per step."""
    return ",".join(
        f"{(i + round_index) % NPROC}:{kind}@{step}" + (f":{SLOW_S}" if kind == "slow" else "")
        for i, (kind, step, _) in enumerate(job.stream)
    )


def run_round(job: Job, round_index: int, work: Path) -> list[Trial]:
    work.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": faults_of(job, round_index)}
    hang = {
        "heartbeat": "required",
        "phase_timeouts_s": {"train": TRAIN_TIMEOUT_S, "save": job.save_timeout_s},
        "calibration": {"enabled": False},
    }
    extra = {
        "nproc_per_node": NPROC,
        "args": ["--steps", str(job.steps), "--batch-size", "8", "--block", "32"],
        "restart": {"max_restarts": 20, "backoff_initial_s": 0.2, "backoff_factor": 1.0},
        "stop": {"kill_grace_s": 1.0},
        "worker": job.worker,
    }
    launch = trainwarden_launch(work, job.steps, job.save_every, env=env, hang=hang, extra_config=extra)
    with launched(launch, work) as proc:
        try:
            code = proc.wait(timeout=ROUND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
    if code != 0:
        print(
            f"  {job.name} round {round_index + 1}: the supervisor "
            f"{'timed out' if code is None else f'exited {code}'}; see {work}",
            flush=True,
        )
    return judge_round(job, round_index, RunLayout(launch.run_dir))


def judge_round(job: Job, round_index: int, layout: RunLayout) -> list[Trial]:
    journal = read_events(layout.journal)
    fired = {(e["kind"], e["rank"]): e for e in rank_events(layout, range(NPROC)) if e["event"] == "fault_injected"}
    trials = []
    for i, (kind, _, expected) in enumerate(job.stream):
        rank = (i + round_index) % NPROC
        fault = fired.get((kind, rank))
        trials.append(judge_fault(job.name, kind, rank, expected, fault, journal))
    return trials


def judge_fault(
    job: str,
    kind: str,
    rank: int,
    expected: str | None,
    fault: dict[str, Any] | None,
    journal: list[dict[str, Any]],
) -> Trial:
    if fault is None:
        return Trial(job, kind, rank, expected, None, None, None, None, "never fired")
    at, attempt = event_time(fault), fault["attempt"]
    later = (
        [e for e in journal if e.get("attempt", -1) >= attempt]
        if expected is None
        else [e for e in journal if e.get("attempt") == attempt]
    )
    declared = next((e for e in later if e["event"] in ("hang_suspected", "rank_crashed")), None)
    verdict = next((e for e in later if e["event"] in ("hang_detected", "culprit_named")), None)
    return Trial(
        job,
        kind,
        rank,
        expected,
        since(at, declared),
        since(at, verdict),
        None if verdict is None else verdict.get("rank"),
        None if verdict is None else verdict.get("class"),
        None if verdict is None else verdict.get("named_by"),
        None if verdict is None else verdict.get("phase"),
    )


def since(at: float, event: dict[str, Any] | None) -> float | None:
    return None if event is None else max(0.0, event_time(event) - at)


def trial_line(round_index: int, t: Trial) -> str:
    named_s = t.named_s if t.named_s is None else round(t.named_s, 2)
    said = (
        "nothing declared"
        if t.declared_s is None
        else f"declared after {t.declared_s:.2f} s, named after {named_s} s: rank {t.named_rank} {t.named_class} by "
        f"{t.named_by}" + (f" in phase {t.named_phase}" if t.named_phase else "")
    )
    return f"  {t.job} round {round_index + 1} {t.kind} on rank {t.rank}: {said} -> {'right' if t.right else 'WRONG'}"


def summary(trials: list[Trial], jobs: list[Job]) -> str:
    by_kind: dict[tuple[str, str], list[Trial]] = defaultdict(list)
    for t in trials:
        by_kind[(t.job, t.kind)].append(t)
    lines = [
        f"{'fault':<20} {'checkpoints':<20} {'expected':<16} {'declared after s':<24} {'named after s':<24} "
        f"{'right':>6}"
    ]
    for job in jobs:
        for kind, _, expected in job.stream:
            mine = by_kind[(job.name, kind)]
            declared = spread([t.declared_s for t in mine])[1] if expected else "never (target)"
            named = spread([t.named_s for t in mine])[1] if expected else "never (target)"
            shown = expected if kind not in IN_SAVE else f"{expected}, save"
            lines.append(
                f"{kind:<20} {job.name:<20} {shown or 'not blamed':<16} {declared:<24} {named:<24} "
                f"{sum(t.right for t in mine):>3}/{len(mine)}"
            )
    right = sum(t.right for t in trials)
    lines.append(f"culprit named correctly: {right}/{len(trials)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds and 1 with background saves (29 trials)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the demo saving in the loop")
    parser.add_argument("--background-rounds", type=int, default=2, help="rounds of it saving in the background")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    rounds = [(SYNC, 3), (BACKGROUND, 1)] if args.quick else [(SYNC, args.rounds), (BACKGROUND, args.background_rounds)]
    rounds = [(job, n) for job, n in rounds if n > 0]
    if any(job is BACKGROUND for job, _ in rounds) and importlib.util.find_spec("numpy") is None:
        print("sharded saves need NumPy: pip install -e '.[dcp]' (or --background-rounds 0)", file=sys.stderr)
        return 2
    print_header(
        ", ".join(f"{n} round{'s' * (n > 1)} of {len(job.stream)} faults ({job.name})" for job, n in rounds)
        + f" on the demo, {NPROC} ranks, gloo, train timeout {TRAIN_TIMEOUT_S:g} s"
    )
    trials: list[Trial] = []
    with scratch_dir(args.keep) as work:
        for job, count in rounds:
            for index in range(count):
                got = run_round(job, index, work / f"{'background' if job is BACKGROUND else 'sync'}_{index + 1}")
                for t in got:
                    print(trial_line(index, t), flush=True)
                trials += got
    print(summary(trials, [job for job, _ in rounds]))
    return 0 if all(t.right for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
