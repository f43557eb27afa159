"""Blame benchmark: does trainwarden name the right culprit, of the right class, for every kind of hang?

Each round runs the demo job (4 ranks, gloo, CPU) under the supervisor through a stream of faults, each firing once
(`TRAINWARDEN_FAULTS_ONCE=1`), on a rank that changes from round to round:
- `hang`: the rank sleeps before the next all-reduce (expected class: host-side);
- `dataloader_hang`: it waits for a DataLoader worker that never delivers (host-side);
- `stall_in_collective`: its all-reduce never completes on its side, its peers go on to the next (in-collective);
- `extra_collective`: it issues one all-reduce more than its peers (desync; gloo usually aborts a rank);
- `collective_sizes`: its all-reduce has one element fewer (desync);
- `sigstop`: it freezes itself (silent);
- `slow`: from then on every step of it takes 0.5 s longer, its peers wait for it, every rank still beats inside the
  train timeout: it must be neither declared hung nor blamed (checked for the rest of the run).
For each fault the journal gives: declared after (the fault's `fault_injected` event to the supervisor's
`hang_suspected`, or for a collective that failed, its `rank_crashed`), named after (to `hang_detected` or
`culprit_named`), the rank and class named, and what named it. A trial is right when rank and class are both right
(for `slow`: when nothing was declared or blamed after it struck). The train timeout is 2 s; calibration off.
Run from the repository root:
    .venv/bin/python bench/hang_blame.py [--quick] [--rounds N] [--keep]
--quick: 3 rounds (21 trials), about 5 minutes on 2 cores; the default: 5 rounds.
"""

from __future__ import annotations

import argparse
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
SAVE_EVERY = 5
# (kind, step, expected class): one fault every 6 steps, slow last (it stays for the rest of the run).
STREAM = [
    ("hang", 6, "host-side"),
    ("dataloader_hang", 12, "host-side"),
    ("stall_in_collective", 18, "in-collective"),
    ("extra_collective", 24, "desync"),
    ("collective_sizes", 30, "desync"),
    ("sigstop", 36, "silent"),
    ("slow", 40, None),
]
STEPS = 52
SLOW_S = 0.5
ROUND_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Trial:
    """One fault and what the supervisor said about it."""

    kind: str
    rank: int
    expected: str | None
    declared_s: float | None  # fault -> hang declared (or the first crash of a failed collective)
    named_s: float | None  # fault -> verdict
    named_rank: int | None
    named_class: str | None
    named_by: str | None

    @property
    def right(self) -> bool:
        if self.expected is None:  # slow: nothing may be declared or blamed
            return self.declared_s is None and self.named_rank is None
        return (self.named_rank, self.named_class) == (self.rank, self.expected)


def faults_of(round_index: int) -> str:
    """Round r puts kind i on rank (i + r) % NPROC; slow gets its seconds per step."""
    return ",".join(
        f"{(i + round_index) % NPROC}:{kind}@{step}" + (f":{SLOW_S}" if kind == "slow" else "")
        for i, (kind, step, _) in enumerate(STREAM)
    )


def run_round(round_index: int, work: Path) -> list[Trial]:
    work.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": faults_of(round_index)}
    hang = {
        "heartbeat": "required",
        "phase_timeouts_s": {"train": TRAIN_TIMEOUT_S, "save": 30},
        "calibration": {"enabled": False},
    }
    extra = {
        "nproc_per_node": NPROC,
        "args": ["--steps", str(STEPS), "--batch-size", "8", "--block", "32"],
        "restart": {"max_restarts": 20, "backoff_initial_s": 0.2, "backoff_factor": 1.0},
        "stop": {"kill_grace_s": 1.0},
    }
    launch = trainwarden_launch(work, STEPS, SAVE_EVERY, env=env, hang=hang, extra_config=extra)
    with launched(launch, work) as proc:
        try:
            code = proc.wait(timeout=ROUND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
    if code != 0:
        print(
            f"  round {round_index + 1}: the supervisor {'timed out' if code is None else f'exited {code}'}; "
            f"see {work}",
            flush=True,
        )
    return judge_round(round_index, RunLayout(launch.run_dir))


def judge_round(round_index: int, layout: RunLayout) -> list[Trial]:
    journal = read_events(layout.journal)
    fired = {(e["kind"], e["rank"]): e for e in rank_events(layout, range(NPROC)) if e["event"] == "fault_injected"}
    trials = []
    for i, (kind, _, expected) in enumerate(STREAM):
        rank = (i + round_index) % NPROC
        fault = fired.get((kind, rank))
        trials.append(judge_fault(kind, rank, expected, fault, journal))
    return trials


def judge_fault(
    kind: str, rank: int, expected: str | None, fault: dict[str, Any] | None, journal: list[dict[str, Any]]
) -> Trial:
    if fault is None:
        return Trial(kind, rank, expected, None, None, None, None, "never fired")
    at, attempt = event_time(fault), fault["attempt"]
    later = (
        [e for e in journal if e.get("attempt", -1) >= attempt]
        if expected is None
        else [e for e in journal if e.get("attempt") == attempt]
    )
    declared = next((e for e in later if e["event"] in ("hang_suspected", "rank_crashed")), None)
    verdict = next((e for e in later if e["event"] in ("hang_detected", "culprit_named")), None)
    return Trial(
        kind,
        rank,
        expected,
        since(at, declared),
        since(at, verdict),
        None if verdict is None else verdict.get("rank"),
        None if verdict is None else verdict.get("class"),
        None if verdict is None else verdict.get("named_by"),
    )


def since(at: float, event: dict[str, Any] | None) -> float | None:
    return None if event is None else max(0.0, event_time(event) - at)


def trial_line(round_index: int, t: Trial) -> str:
    named_s = t.named_s if t.named_s is None else round(t.named_s, 2)
    said = (
        "nothing declared"
        if t.declared_s is None
        else f"declared after {t.declared_s:.2f} s, named after {named_s} s: rank {t.named_rank} {t.named_class} by "
        f"{t.named_by}"
    )
    return f"  round {round_index + 1} {t.kind} on rank {t.rank}: {said} -> {'right' if t.right else 'WRONG'}"


def summary(trials: list[Trial]) -> str:
    by_kind: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        by_kind[t.kind].append(t)
    lines = [f"{'fault':<20} {'expected':<14} {'declared after s':<24} {'named after s':<24} {'right':>6}"]
    for kind, _, expected in STREAM:
        mine = by_kind[kind]
        declared = spread([t.declared_s for t in mine])[1] if expected else "never (target)"
        named = spread([t.named_s for t in mine])[1] if expected else "never (target)"
        lines.append(
            f"{kind:<20} {expected or 'not blamed':<14} {declared:<24} {named:<24} "
            f"{sum(t.right for t in mine):>3}/{len(mine)}"
        )
    right = sum(t.right for t in trials)
    lines.append(f"culprit named correctly: {right}/{len(trials)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds (21 trials)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the run dirs")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    rounds = 3 if args.quick else args.rounds
    print_header(
        f"{rounds} rounds of {len(STREAM)} faults on the demo, {NPROC} ranks, gloo, train timeout {TRAIN_TIMEOUT_S:g} s"
    )
    trials: list[Trial] = []
    with scratch_dir(args.keep) as work:
        for index in range(rounds):
            got = run_round(index, work / f"round_{index + 1}")
            for t in got:
                print(trial_line(index, t), flush=True)
            trials += got
    print(summary(trials))
    return 0 if all(t.right for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
