"""Worker library overhead per training step: what `guard_step` + `step_done` add to a plain loop.

The baseline iteration clips gradients with `clip_grad_norm_`, as a plain loop would; the library's
iteration calls `guard_step` (which clips, judges the step with the default threshold and the adaptive
detector on) and `step_done` (an event line and the throttled heartbeat). The difference is printed in
microseconds and as a share of a 50 ms training step (the target is < 1 %). Single process: the
cross-rank all-reduce of one number is not included, nor are checkpoint saves.
Run: .venv/bin/python bench/worker_overhead.py [--calls N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from worker import Warden, WorkerConfig
from worker.anomaly import AdaptiveConfig

STEP_S = 0.050


def per_call_us(calls: int, fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(64, 64)
    (model(torch.randn(8, 64)).mean() * 0.01).backward()  # small, normal gradients to clip and judge
    config = WorkerConfig(use_skip_data_by_global_norm=True, adaptive_spike=AdaptiveConfig(enabled=True))
    with tempfile.TemporaryDirectory() as run_dir:
        os.environ["TRAINWARDEN_RUN_DIR"] = run_dir
        warden = Warden(model, torch.optim.SGD(model.parameters(), lr=0.0), config=config)

        def plain() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)

        def guarded() -> None:
            warden.guard_step(1.2345, max_norm=1e9)
            warden.step_done(loss=1.2345)

        baseline, library = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            baseline.append(per_call_us(args.calls, plain))
            library.append(per_call_us(args.calls, guarded))
        warden.finish()
    cost = statistics.median(library) - statistics.median(baseline)
    print(
        f"plain iteration (clip_grad_norm_):        {statistics.median(baseline):.2f} us "
        f"(median of {args.repeats} x {args.calls})"
    )
    print(
        f"library iteration (guard_step+step_done): {statistics.median(library):.2f} us "
        f"(min {min(library):.2f}, max {max(library):.2f})"
    )
    print(
        f"overhead per step: {cost:.2f} us = {cost / (STEP_S * 1e6) * 100:.3f} % of a "
        f"{STEP_S * 1000:.0f} ms step (target < 1 %)"
    )


if __name__ == "__main__":
    main()
