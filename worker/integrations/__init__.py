"""trainwarden inside the trainers people already use: one callback each, over the worker library's Warden.

- `worker.integrations.lightning`: PyTorch Lightning (`pip install 'trainwarden[lightning]'`).
- `worker.integrations.hf`: the Hugging Face `Trainer` (`pip install 'trainwarden[hf]'`).

The callback writes heartbeats and step events, marks phases, skips anomalous steps, obeys stop orders at the
agreed step and answers SIGTERM as the Warden does. The trainer writes and loads its own checkpoints; after each
one the ranks record it (worker.integrations.records), so the supervisor picks the newest complete and healthy one
and names it on relaunch, and a one-line helper hands it to the trainer.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from worker.contract import ENV_RUN_DIR, RunLayout

__all__ = ["drop_gradients", "run_layout"]


def run_layout() -> RunLayout:
    """This rank's run directory, as the supervisor (or the Warden's default) names it."""
    from worker.warden import DEFAULT_RUN_DIR

    return RunLayout(Path(os.environ.get(ENV_RUN_DIR, DEFAULT_RUN_DIR)))


def drop_gradients(params: Any, *, scaled: bool) -> None:
    """A true skip: the optimizer leaves a parameter without a gradient as it is (moments and step count too).
    Under a GradScaler the gradients become NaN instead, so that the scaler skips the step (it refuses to step
    an optimizer it recorded no gradients for)."""
    for p in params:
        if p.grad is not None:
            if scaled:
                p.grad.fill_(math.nan)
            else:
                p.grad = None
