"""Feature-value check overhead: the demo model's training step with the seed 002 checks on, against off.

Trains the demo's character transformer (examples/demo_train.py: 5 LayerNorms, d_model 64, batch 16,
block 64, one CPU thread) in one process under a Warden per level, in interleaved blocks of steps, and
prints the median step time (forward, backward, guard_step, optimizer step, step_done) of each level
and its ratio to level 0 (checks off). Level 2 (the demo's) costs what level 1 costs in one process;
across ranks it adds one float per rank to the step guard's all-reduce. Level 3 also logs every value.
Run: .venv/bin/python bench/feature_value_overhead.py [--steps N] [--repeats R] [--levels 0,2,3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker import Warden, WorkerConfig
from worker.feature_rule import FeatureValueConfig

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo_train.py"


def load_demo() -> Any:
    spec = importlib.util.spec_from_file_location("demo_train", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Trainer:
    """The demo's model, optimizer and loop under a Warden with feature-value checks at `level`."""

    def __init__(self, demo: Any, data: torch.Tensor, vocab: int, level: int, run_dir: str) -> None:
        torch.manual_seed(1234)
        self.demo, self.data, self.vocab = demo, data, vocab
        self.model = demo.CharTransformer(vocab, d_model=64, n_head=4, n_layer=2, block=64)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        os.environ["TRAINWARDEN_RUN_DIR"] = run_dir
        config = WorkerConfig(feature_value_check=FeatureValueConfig(level=level))
        self.warden = Warden(self.model, self.optimizer, config=config)

    def step(self) -> None:
        x, y = self.demo.batch_for(self.data, index=self.warden.batches, rank=0, seed=1234, batch=16, block=64)
        loss = nn.functional.cross_entropy(self.model(x).view(-1, self.vocab), y.view(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.warden.guard_step(loss.item(), max_norm=1.0):
            self.optimizer.step()
        self.warden.step_done(loss=loss.item())

    def step_times_s(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per block")
    parser.add_argument("--repeats", type=int, default=7, help="blocks per level, interleaved")
    parser.add_argument("--levels", default="0,2,3", help="comma-separated levels; the first is the baseline")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_ATTEMPT", "TRAINWARDEN_FAULTS", "TRAINWARDEN_ASD_ENABLE"):
        os.environ.pop(name, None)
    demo = load_demo()
    text = demo.TEXT.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    levels = [int(level) for level in args.levels.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {level: Trainer(demo, data, len(vocab), level, f"{tmp}/level_{level}") for level in levels}
        for trainer in trainers.values():  # warm-up: allocator, first-call costs
            trainer.step_times_s(10)
        times: dict[int, list[float]] = {level: [] for level in levels}
        for _ in range(args.repeats):  # interleaved, so drift and neighbours' load hit every level alike
            for level, trainer in trainers.items():
                times[level] += trainer.step_times_s(args.steps)
        checked = next((level for level in levels if level), None)  # the first level with checks on
        alone = check_work_s(trainers[checked], calls=2000) if checked is not None else None
        for trainer in trainers.values():
            trainer.warden.finish()
    report(times, levels, args)
    if alone is not None:
        base = statistics.median(times[levels[0]])
        print(
            f"the check's own work per step at level {checked}, timed alone (5 forward hooks, 5 gradient norms, "
            f"one verdict): {alone * 1e6:.0f} us = {alone / base * 100:.2f} % of the level-{levels[0]} median step"
        )


def check_work_s(trainer: Trainer, calls: int) -> float:
    """Per-step time of what the checks add, on the demo's activation-gradient shape, without the training step."""
    check = trainer.warden._features
    grad = torch.randn(16, 64, 64) * 1e-3
    layers = range(len(check.names))
    started = time.perf_counter()
    for step in range(calls):
        for index in layers:
            check._on_forward(index, None, None, torch.zeros(1, requires_grad=True) * 1.0)  # as in forward
            check._on_grad(index, grad)  # as in backward
        check.verdict(step=10_000 + step, batch=10_000 + step)
    return (time.perf_counter() - started) / calls


def report(times: dict[int, list[float]], levels: list[int], args: argparse.Namespace) -> None:
    print(f"demo model, 1 process, 1 thread; {args.repeats} interleaved blocks x {args.steps} steps per level")
    base_median, base_min = statistics.median(times[levels[0]]), min(times[levels[0]])
    for level in levels:
        median, fastest = statistics.median(times[level]), min(times[level])
        # The minimum is what a step costs when nothing else competes for the core; the median includes load.
        print(
            f"level {level}: median step {median * 1e3:.3f} ms, min {fastest * 1e3:.3f} ms; ratio to level "
            f"{levels[0]}: median {median / base_median:.4f} ({(median - base_median) * 1e6:+.0f} us), "
            f"min {fastest / base_min:.4f} ({(fastest - base_min) * 1e6:+.0f} us)"
        )


if __name__ == "__main__":
    main()
