"""Worker library overhead per training step: `Warden.step_done` (event line + heartbeat) against a bare loop.

Prints the cost of one call in microseconds and as a share of a 50 ms training step (the target is < 1 %).
Checkpoint saves are excluded: they happen every `save_checkpoint_steps`, not every step.
Run: .venv/bin/python bench/worker_overhead.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from worker import Warden, WorkerConfig

STEP_S = 0.050


def per_call_us(calls: int, fn) -> float:
    started = time.perf_counter()
    for step in range(1, calls + 1):
        fn(step)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        os.environ["TRAINWARDEN_RUN_DIR"] = run_dir
        model = torch.nn.Linear(4, 4)
        warden = Warden(model, torch.optim.SGD(model.parameters(), lr=0.1), config=WorkerConfig())
        loss = 1.2345
        baseline, warden_us = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            baseline.append(per_call_us(args.calls, lambda step: None))
            warden_us.append(per_call_us(args.calls, lambda step: warden.step_done(loss=loss, grad_norm=0.5)))
        warden.finish()
    cost = statistics.median(warden_us) - statistics.median(baseline)
    print(f"bare loop iteration: {statistics.median(baseline):.2f} us (median of {args.repeats} x {args.calls})")
    spread = f"min {min(warden_us):.2f}, max {max(warden_us):.2f}"
    print(f"Warden.step_done:    {statistics.median(warden_us):.2f} us ({spread})")
    print(f"overhead per step:   {cost:.2f} us = {cost / (STEP_S * 1e6) * 100:.3f} % of a {STEP_S * 1000:.0f} ms step"
          f" (target < 1 %)")


if __name__ == "__main__":
    main()
