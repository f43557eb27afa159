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

    def median_step_s(self, steps: int) -> float:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return statistics.median(times)


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
            trainer.median_step_s(10)
        medians: dict[int, list[float]] = {level: [] for level in levels}
        for _ in range(args.repeats):  # interleaved, so drift and neighbours' load hit every level alike
            for level, trainer in trainers.items():
                medians[level].append(trainer.median_step_s(args.steps))
        for trainer in trainers.values():
            trainer.warden.finish()
    report(medians, levels, args)


def report(medians: dict[int, list[float]], levels: list[int], args: argparse.Namespace) -> None:
    base = statistics.median(medians[levels[0]])
    print(f"demo model, 1 process, 1 thread; median of {args.repeats} blocks x {args.steps} steps (block medians)")
    for level in levels:
        step = statistics.median(medians[level])
        spread = f"blocks {min(medians[level]) * 1e3:.2f}-{max(medians[level]) * 1e3:.2f} ms"
        print(f"level {level}: step {step * 1e3:.3f} ms ({spread}); ratio to level {levels[0]}: {step / base:.4f} "
              f"({(step - base) * 1e6:+.0f} us)")


if __name__ == "__main__":
    main()
