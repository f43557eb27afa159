"""trainwarden for PyTorch Lightning: one callback, and the checkpoint to resume from.

    from worker.integrations.lightning import TrainwardenCallback, ckpt_path

    trainer = L.Trainer(..., callbacks=[TrainwardenCallback()], enable_checkpointing=False)
    trainer.fit(model, data, ckpt_path=ckpt_path(), weights_only=True)

The callback saves Lightning's own checkpoint (`Trainer.save_checkpoint`) every `worker.save_checkpoint_steps`
optimizer steps (or `worker.save_checkpoint_interval_s`), at a stop order's step and at the end, into the run's
`checkpoint/PREFIX-STEP/model.ckpt`, and records it on every rank. `ckpt_path()` is the supervisor's choice (the
newest complete and healthy one), or, without a supervisor, the newest complete one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.contract import WorkerConfig
from worker.files import ensure_dir, unlink_quietly
from worker.integrations import drop_gradients, run_layout
from worker.integrations.records import resume_directory
from worker.manifest import MANIFEST
from worker.warden import Warden

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        # unused-ignore: where lightning is not installed, both names are Any and mypy finds nothing to ignore;
        # assignment: where both packages are, their Callback classes are two types
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef, assignment, unused-ignore]
    except ImportError as exc:
        raise ImportError(
            "worker.integrations.lightning needs PyTorch Lightning: pip install 'trainwarden[lightning]'"
        ) from exc

__all__ = ["CHECKPOINT_FILE", "TrainwardenCallback", "ckpt_path"]

CHECKPOINT_FILE = "model.ckpt"  # Lightning's file (a directory with a sharded strategy) in PREFIX-STEP/
WHOLE_STATE = False  # Lightning's save option: optimizer, loops and callbacks too, a point to resume from
MID_EPOCH = (
    "resumed inside an epoch with a DataLoader that is not resumable: the rest of this epoch's batches "
    "differ from an uninterrupted run's (save at epoch ends, or use a resumable DataLoader such as "
    "torchdata's StatefulDataLoader)"
)


def ckpt_path() -> str | None:
    """For `Trainer.fit(ckpt_path=...)`: the checkpoint the supervisor chose, or None to start from scratch."""
    directory = resume_directory(run_layout(), WorkerConfig.from_env())
    return None if directory is None else str(directory / CHECKPOINT_FILE)


class TrainwardenCallback(Callback):
    """Heartbeats, phases, step events, anomaly skips, stop orders and health-tagged checkpoints for Lightning.

    `max_norm`: clip gradients to this global norm after judging them (None: Lightning's `gradient_clip_val`, if
    any, clips them after this callback). A skipped step leaves weights and optimizer state untouched; Lightning
    still counts it (`global_step`) and steps a per-step LR scheduler.
    """

    def __init__(self, *, max_norm: float | None = None) -> None:
        self.max_norm = max_norm
        self.warden: Warden | None = None
        self._losses: list[Any] = []  # this optimizer step's micro-batch losses
        self._loss: float | None = None
        self._counted = 0  # the global_step the last step_done saw
        self._eval_previous: str | None = None

    # ---- start and end ----

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Here, not at setup: Lightning has installed its signal handlers, so the Warden's SIGTERM handler is the
        # one that runs (Lightning's broadcasts to the peers, which hangs when one is dead).
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        save = _LightningSave(trainer, run_layout(), WorkerConfig.from_env())
        self.warden = Warden(pl_module, optimizer, framework_save=save)
        self._counted = trainer.global_step
        environment = getattr(trainer.strategy, "cluster_environment", None)
        self.warden.log.info(
            "framework_started",
            framework="lightning",
            cluster_environment=type(environment).__name__,
            auto_requeue=bool(getattr(environment, "auto_requeue", False)),
        )
        self.warden.framework_resumed(trainer.global_step, trainer.ckpt_path)
        self.warden.expect_steps(trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        if trainer.ckpt_path and _mid_epoch(trainer):
            self.warden.resume_inexact(MID_EPOCH)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.warden is not None:
            self.warden.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.warden is not None:
            self.warden.__exit__(type(exception), exception, None)

    # ---- each step ----

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Judged with every rank before Lightning clips and steps: a skip leaves the weights as they were."""
        warden = self.warden
        if warden is None or not pl_module.automatic_optimization:
            return
        self._loss = _mean(self._losses)
        self._losses.clear()
        if not warden.guard_step(0.0 if self._loss is None else self._loss, max_norm=self.max_norm):
            drop_gradients(pl_module.parameters(), scaled=_amp_scaler(trainer) is not None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        warden = self.warden
        if warden is None or trainer.global_step == self._counted:  # accumulating: no optimizer step yet
            return
        self._counted = trainer.global_step
        loss = self._loss if pl_module.automatic_optimization else _mean(self._losses)
        self._losses.clear()
        warden.step_done(loss=loss, step=trainer.global_step)
        if warden.should_stop:  # a stop order was carried out: Lightning ends the fit after this batch
            trainer.should_stop = True

    # ---- validation ----

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.warden is not None:
            self._eval_previous = self.warden.enter_phase("eval")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if self.warden is not None:
            self.warden.beat()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.warden is not None and self._eval_previous is not None:
            self.warden.leave_phase("eval", self._eval_previous)
            self._eval_previous = None


class _LightningSave:
    """The Warden's `framework_save`: Lightning writes `PREFIX-STEP/model.ckpt`, every rank takes part."""

    framework = "lightning"

    def __init__(self, trainer: Any, layout: Any, config: WorkerConfig) -> None:
        self._trainer, self._layout, self._prefix = trainer, layout, config.prefix

    def __call__(self, step: int) -> Path:
        directory = self._layout.checkpoints.framework_dir(step, self._prefix)
        if self._trainer.is_global_zero:
            unlink_quietly(directory / MANIFEST)  # a step saved again (after a resume): no manifest of old files
        ensure_dir(self._layout.root, directory)
        self._trainer.save_checkpoint(directory / CHECKPOINT_FILE, weights_only=WHOLE_STATE)
        return directory


def _mid_epoch(trainer: Any) -> bool:
    """Lightning resumed inside an epoch with a DataLoader that cannot say where it was (its own warning's test)."""
    batches = trainer.num_training_batches
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    if loader is None or not isinstance(batches, int) or batches <= 0:
        return False
    per_epoch = -(-batches // trainer.accumulate_grad_batches)
    resumable = all(
        callable(getattr(one, "state_dict", None)) and callable(getattr(one, "load_state_dict", None))
        for one in loader.flattened
    )
    return trainer.global_step % per_epoch != 0 and not resumable


def _amp_scaler(trainer: Any) -> Any:
    return getattr(trainer.precision_plugin, "scaler", None)


def _mean(losses: list[Any]) -> float | None:
    return float(sum(losses) / len(losses)) if losses else None
