"""trainwarden for the Hugging Face `Trainer`: one callback, where to save, and the checkpoint to resume from.

    from worker.integrations.hf import TrainwardenCallback, output_dir, resume_from_checkpoint

    args = TrainingArguments(output_dir=output_dir(), save_steps=10, max_grad_norm=0, ...)
    trainer = Trainer(model, args, ..., callbacks=[TrainwardenCallback(max_norm=1.0)])
    trainer.train(resume_from_checkpoint=resume_from_checkpoint())

The Trainer writes its own `checkpoint-STEP/` directories into the run's checkpoint directory (the job config says
`worker.prefix: checkpoint`, the Trainer's name for them); after each, every rank records it. A stop order asks the
Trainer to save and stop at the agreed step. `resume_from_checkpoint()` is the supervisor's choice (the newest
complete and healthy one), or, without a supervisor, the newest complete one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from worker.contract import ENV_WORKER_CONFIG, EXIT_CONFIG, WorkerConfig
from worker.exits import leave
from worker.files import unlink_quietly
from worker.integrations import drop_gradients, run_layout
from worker.integrations.records import resume_directory
from worker.manifest import MANIFEST
from worker.warden import SAVE_PHASE, Warden

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("worker.integrations.hf needs transformers: pip install 'trainwarden[hf]'") from exc

__all__ = ["PREFIX", "TrainwardenCallback", "output_dir", "resume_from_checkpoint"]

PREFIX = "checkpoint"  # the Trainer names its checkpoints checkpoint-STEP: the job config's worker.prefix


def output_dir() -> str:
    """For `TrainingArguments(output_dir=...)`: the run's checkpoint directory, where the supervisor looks."""
    return str(run_layout().checkpoint_dir)


def resume_from_checkpoint() -> str | None:
    """For `Trainer.train(resume_from_checkpoint=...)`: the checkpoint the supervisor chose, or None (scratch)."""
    directory = resume_directory(run_layout(), _config())
    return None if directory is None else str(directory)


def _config() -> WorkerConfig:
    """The worker config, with the Trainer's name for its checkpoints (without a supervisor nobody else names it)."""
    return replace(WorkerConfig.from_env(), prefix=PREFIX)


class TrainwardenCallback(TrainerCallback):
    """Heartbeats, phases, step events, anomaly skips, stop orders and health-tagged checkpoints for the Trainer.

    `max_norm`: clip gradients to this global norm after judging them; set `max_grad_norm=0` in the
    TrainingArguments so that the Trainer's own clipping does not hide a spike first (non-finite gradients are
    caught either way). A skipped step leaves weights and optimizer state untouched; the Trainer still counts it
    (`global_step`) and steps its LR scheduler.
    """

    def __init__(self, *, max_norm: float | None = None) -> None:
        self.max_norm = max_norm
        self.warden: Warden | None = None
        self._control: Any = None
        self._losses: list[Any] = []  # the model's losses since the last optimizer step (a forward hook's)
        self._loss: float | None = None
        self._back_to: tuple[str, str] | None = None  # (phase we are in, phase to go back to)
        self._save_started: float | None = None  # when the Trainer's save began (perf_counter)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        layout = run_layout()
        _check_setup(args, layout.checkpoint_dir, WorkerConfig.from_env())
        self.warden = Warden(model, optimizer, config=_config(), framework_save=_HFSave(self))
        self.warden.framework_resumed(state.global_step, resume_from_checkpoint())
        self.warden.expect_steps(state.max_steps if state.max_steps > 0 else None)
        model.register_forward_hook(self._model_output)

    def _model_output(self, module: Any, inputs: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and loss is not None:
            self._losses.append(loss.detach())

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        """Judged with every rank before the optimizer steps: a skip leaves the weights as they were."""
        if self.warden is None:
            return
        self._loss = float(sum(self._losses) / len(self._losses)) if self._losses else None
        self._losses.clear()
        if not self.warden.guard_step(0.0 if self._loss is None else self._loss, max_norm=self.max_norm):
            drop_gradients(model.parameters(), scaled=getattr(optimizer, "scaler", None) is not None)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.warden is None:
            return control
        self._control = control  # a save the Warden asks for (its cadence, a stop order) is asked of the Trainer
        self.warden.step_done(loss=self._loss, step=state.global_step)
        if self.warden.should_stop:
            control.should_training_stop = True
        elif 0 < state.max_steps <= state.global_step:
            self.warden.save_final()  # the final state, as the Warden saves its own (asked now: the Trainer ends next)
        if control.should_save and args.should_save:
            unlink_quietly(Path(args.output_dir) / f"{PREFIX}-{state.global_step}" / MANIFEST)  # saved again
        if control.should_evaluate:
            self._enter("eval")
        elif control.should_save:
            self._begin_save(state.global_step)
        return control

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warden is not None:
            self.warden.beat()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warden is not None and self._back_to is not None and self._back_to[0] == "eval":
            self._leave()
            if control.should_save:
                self._begin_save(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warden is None:
            return
        if self._back_to is not None:
            self._leave()
        self.warden.framework_saved(
            state.global_step, Path(args.output_dir) / f"{PREFIX}-{state.global_step}", started=self._save_started
        )
        self._save_started = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warden is not None:
            self.warden.finish(save=False)  # asked for at the last step, while the Trainer could still save
            self.warden = None

    def _enter(self, phase: str) -> None:
        assert self.warden is not None
        self._back_to = (phase, self.warden.enter_phase(phase))

    def _begin_save(self, step: int) -> None:
        assert self.warden is not None
        self._save_started = time.perf_counter()
        self._back_to = (SAVE_PHASE, self.warden.begin_save(step))

    def _leave(self) -> None:
        assert self.warden is not None and self._back_to is not None
        self.warden.leave_phase(*self._back_to)
        self._back_to = None


class _HFSave:
    """The Warden's `framework_save`: asks the Trainer to save this step (it does, after the callbacks)."""

    framework = "hf"
    deferred = True  # the Trainer saves after on_step_end; on_save records it

    def __init__(self, callback: TrainwardenCallback) -> None:
        self._callback = callback

    def __call__(self, step: int) -> None:
        self._callback._control.should_save = True


def _check_setup(args: Any, checkpoint_dir: Path, config: WorkerConfig) -> None:
    """The Trainer saves where the supervisor looks, under the name it looks for: else exit 78, saying how."""
    problems = []
    if Path(args.output_dir).resolve() != checkpoint_dir.resolve():
        problems.append(
            f"TrainingArguments(output_dir={args.output_dir!r}) is not the run's checkpoint directory: "
            f"use output_dir=worker.integrations.hf.output_dir() ({checkpoint_dir})"
        )
    if os.environ.get(ENV_WORKER_CONFIG) and config.prefix != PREFIX:  # the supervisor looks for its prefix
        problems.append(
            f"worker.prefix is {config.prefix!r}: the Trainer names its checkpoints {PREFIX}-STEP, "
            f"set worker.prefix: {PREFIX} in the job config"
        )
    if getattr(args, "save_total_limit", None):
        problems.append(
            "save_total_limit would delete checkpoints the supervisor may resume from: leave it unset "
            "and set worker.keep_checkpoint_max in the job config"
        )
    for problem in problems:
        print(f"trainwarden: worker config error: {problem}", file=sys.stderr)
    if problems:
        leave(EXIT_CONFIG)
