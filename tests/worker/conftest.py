"""A real single-process training loop under a Warden, for the worker library's tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.anomaly import MonitorConfig
from worker.contract import (
    ENV_ATTEMPT,
    ENV_RESUME_DIR,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_SKIP_TO_BATCH,
    ENV_WORKER_CONFIG,
    WorkerConfig,
)
from worker.faults import ENV_FAULTS
from worker.feature_rule import (
    ENV_ASD_ENABLE,
    ENV_ASD_LAYERS,
    ENV_ASD_MIN_STEPS,
    ENV_ASD_SIGMA_THRESH,
    ENV_ASD_UPPER_THRESH,
)
from worker.warden import Warden

GUARDED = WorkerConfig(
    use_skip_data_by_global_norm=True, monitor_config=MonitorConfig(global_norm_spike_count_threshold=3)
)
MAX_NORM = 1.0


class Loop:
    """A tiny model (by default one Linear layer, 4 in, 2 out) with AdamW and StepLR, trained one batch at a time."""

    def __init__(
        self, config: WorkerConfig, model: Callable[[], torch.nn.Module] | None = None, **warden_options: Any
    ) -> None:
        torch.manual_seed(0)
        self.model = model() if model is not None else torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.warden = Warden(self.model, self.optimizer, self.scheduler, config=config, **warden_options)

    def backward(self) -> float:
        """Forward and backward on batch `warden.batches` (fixed data per index); returns the loss."""
        data = torch.Generator().manual_seed(self.warden.batches)
        x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss.item()

    def train_batch(self) -> bool:
        """One iteration as a training script writes it; returns whether the optimizer stepped."""
        loss = self.backward()
        applied = self.warden.guard_step(loss, max_norm=MAX_NORM)
        if applied:
            self.optimizer.step()
            self.scheduler.step()
        self.warden.step_done(loss=loss)
        return applied

    def snapshot(self) -> dict[str, Any]:
        """Deep copies of the model's, the optimizer's and the scheduler's state."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
        )


@pytest.fixture
def loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A factory of `Loop`s running as rank 0 of attempt 0 in `tmp_path` with the given faults armed."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT",
        ENV_ATTEMPT,
        ENV_RESUME_STEP,
        ENV_RESUME_DIR,
        ENV_SKIP_TO_BATCH,
        ENV_WORKER_CONFIG,
        ENV_ASD_ENABLE,
        ENV_ASD_UPPER_THRESH,
        ENV_ASD_SIGMA_THRESH,
        ENV_ASD_MIN_STEPS,
        ENV_ASD_LAYERS,
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
    made: list[Loop] = []

    def make(
        faults: str = "",
        config: WorkerConfig = GUARDED,
        model: Callable[[], torch.nn.Module] | None = None,
        **warden_options: Any,
    ) -> Loop:
        monkeypatch.setenv(ENV_FAULTS, faults)
        made.append(Loop(config, model, **warden_options))
        return made[-1]

    yield make
    for each in made:
        if not each.warden._log_stream.closed:
            each.warden.finish()
