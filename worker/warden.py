"""The worker library's entry point: one object the training loop calls once per step."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import math
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from worker.cadence import Choice, SnapshotCadence, SnapshotSchedule
from worker.checkpoint import (
    CheckpointRefused,
    capture_rng,
    checkpoint_health,
    clear_slot,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from worker.contract import (
    ENV_ATTEMPT,
    ENV_FAILURES,
    ENV_MEMORY_DIR,
    ENV_RESUME_DIR,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_SKIP_TO_BATCH,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_CONFIG,
    MEMORY_LABEL,
    SNAPSHOT_SLOTS,
    STACK_DUMP_SIGNAL,
    CheckpointStore,
    RunLayout,
    StopOrder,
    WorkerConfig,
    named_store,
    newest_complete,
    parse_checkpoint_name,
    parse_failures,
    resume_stores,
)
from worker.events import open_event_log
from worker.exits import leave
from worker.faults import FaultPlan
from worker.feature_check import FeatureValueCheck
from worker.feature_rule import with_env
from worker.files import open_append, read_json
from worker.fingerprint import NOT_DATA_PARALLEL, Recorder, install, uninstall
from worker.flight import FlightRecorderDumps
from worker.guard import RerunStep, StepGuard
from worker.heartbeat import Heartbeat
from worker.manifest import ManifestError, rank_record_name, remove_sharded
from worker.memory import check_memory_dir
from worker.memory_tier import (
    memory_room,
    pin_files,
    pin_sharded,
    snapshot_room_problem,
    unpin_files,
    unpin_sharded,
)
from worker.orders import StopOrders
from worker.recovery import attach, in_place
from worker.rerun import RandomState, Rerun, capture, rerun_step
from worker.sdc import DATA, Fingerprint
from worker.sharded import derived_rng
from worker.skip_list import SkipList
from worker.verify import Trajectory, unregistered_scalers

__all__ = ["Warden"]

DEFAULT_RUN_DIR = "runs/local"
CLOCK_AGREE_STEPS = 10  # without guard_step, ranks agree on a time-based save this often (a save may come 9 late)
SAVE_PHASE = "save"
# restore_rng's parts it could not put back, and the event saying so.
UNREGISTERED_SCALER = (
    "an enabled GradScaler is not in extra_state: checkpoints lack its loss scale, so a resume restarts it and is "
    "not exact; pass Warden(..., extra_state={'scaler': scaler})"
)
# Why an FSDP2 model's steps are not re-run: a partner would compute a suspect's batch alone, which a sharded model's
# forward cannot (it gathers the parameters from every rank).
RERUNS_OFF_FSDP = (
    "FSDP2: a partner cannot compute another rank's batch alone (its forward gathers parameters from every rank); "
    "the fingerprints name a rank that stands out, and the step guard decides as without re-runs"
)
_RNG_NOT_RESTORED = {"numpy": "numpy_rng_not_restored", "cuda": "cuda_rng_not_restored"}


PERSIST_WAIT_S = 30.0  # how long a stop's or the final save waits for the supervisor to persist its pinned step
PERSIST_POLL_S = 0.01


class Warden:
    """Heartbeats, step events, checkpoints and exact resume for one rank of a training job.

    Reads its rank and run directory from the environment (the supervisor's, or torchrun's).
    Phases (`startup`, `train`, `save`, `eval` or any name) tell the supervisor which timeout applies.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        *,
        config: WorkerConfig | None = None,
        data_state: Callable[[], dict[str, Any]] | None = None,
        global_batch_size: int | None = None,
        health_check: Callable[[int], str | None] | None = None,
        extra_state: dict[str, Any] | None = None,
        framework_save: Callable[[int], Any] | None = None,
    ) -> None:
        env = os.environ
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra_state = _stateful(extra_state or {})  # a GradScaler, a sampler, an EMA model: saved and restored
        # A trainer that writes and resumes its own checkpoints (worker.integrations): called with the step to save,
        # it returns the directory written, or (`deferred` set) asks the trainer to save after this step's callbacks.
        self._framework_save = framework_save
        self.config = config or _or_config_error(WorkerConfig.from_env)
        self.rank = int(env.get("RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        # torchrun's restart counter stands in when no supervisor is there (the benchmark baseline).
        self.attempt = int(env.get(ENV_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        self.layout = RunLayout(Path(env.get(ENV_RUN_DIR, DEFAULT_RUN_DIR)))
        self.data_state: dict[str, Any] = {}
        self._data_state_fn = data_state
        self.global_batch_size = global_batch_size  # samples per step over all ranks; scales the data position
        self._health_check = health_check  # the user's: a reason this rank's state is unhealthy at a step, or None
        self._tainted_at: int | None = None  # first applied step with a feature-value fault: later saves are suspect
        self._faults = _or_config_error(
            lambda: FaultPlan.from_env(
                rank=self.rank,
                attempt=self.attempt,
                on_fire=self._fault_fired,
                rank_dir=self.layout.rank_dir(self.rank),
            )
        )
        self._heartbeat = Heartbeat(
            self.layout.heartbeat(self.rank),
            root=self.layout.root,
            rank=self.rank,
            attempt=self.attempt,
            interval_s=self.config.heartbeat_interval_s,
            in_place=in_place(),
        )
        self.log, self._log_stream = open_event_log(
            self.layout.rank_events(self.rank), root=self.layout.root, rank=self.rank, attempt=self.attempt
        )
        self.step = 0  # optimizer steps applied
        self.batches = 0  # data position: batches consumed, skipped ones included; the next batch's index
        self.samples = 0  # the same as a global count of samples (with global_batch_size): exact across a resize
        self._sharded: Any = None  # the ShardedCheckpointer, made at the first sharded save or resume (collectively)
        # The sharded save not yet logged as done: step, store, directory, and when the loop went on after staging it.
        self._background: tuple[int, CheckpointStore, Path, float] | None = None
        self._first_step_done = False  # the first save's costs were paid ahead, after the first applied step
        self._on_schedule = False  # this save is one the config's cadence made due (not a stop's or the script's)
        self._said_slow_saves = False  # `save_slower_than_interval` is said once per process
        self._resumed = False
        self._state_checked = False  # for state the checkpoints would lack (worker.verify), after the first step
        self._trajectory = (
            Trajectory(self.layout.trajectory(self.rank), root=self.layout.root, steps=self.config.verify_resume)
            if self.config.verify_resume > 0
            else None
        )
        self._saved_at = 0  # step of the newest regular checkpoint this rank holds (0: none)
        self._last_save = time.monotonic()  # the time-based cadence counts from here
        if self.config.snapshot_steps == "auto" and (framework_save is not None or not os.environ.get(ENV_MEMORY_DIR)):
            self.config = replace(self.config, snapshot_steps=0)  # `auto` snapshots to memory only; disk's: a number
        self._schedule = _or_config_error(self._snapshot_schedule)  # `snapshot_steps: auto` (worker.cadence)
        self._auto_slot: int | None = None  # with it, the disk slot of the newest snapshot this process wrote
        self._stopping = False  # a stop order was carried out and the loop asked about it: the loop ends
        self._loop_asks = False  # the loop reads `should_stop` (or runs `steps()`): a stop returns to it
        self._guard = StepGuard(
            self.config,
            log=self.log,
            faults=self._faults,
            world_size=self.world_size,
            rank=self.rank,
            on_leave=self._leaving,
            where=(socket.gethostname(), _gpu_index(model)),
        )
        self._features = self._feature_value_check()
        self._fault_hooks = self._faults.hook_step(model, optimizer, lambda: self.step + 1)
        self._fingerprints = self._fingerprint(model)
        self._owner = self.rank  # whose batch the model computes now (a re-run's partner computes another's)
        self._fault_hooks += self._faults.hook_data(model, lambda: (self.batches, self._owner))
        self._skips = SkipList(self.layout.skip_list(self.rank), root=self.layout.root)
        self._wants_rerun = False  # the loop hands `recompute` to guard_step: each step's random state is kept
        self._said_reruns_off = False
        self._started: RandomState | None = None  # the random state this step started from (with re-runs)
        self._heartbeat.anomalies = self._guard.anomalies  # one dict: the guard counts, the heartbeat reports
        self._decision: tuple[bool, float, bool] | None = None  # this iteration's (apply?, global norm, save due?)
        self._phase = "startup"
        self._last_step_end = time.perf_counter()
        self._compute_since = self._last_step_end  # a step's compute starts here: after the last step or phase
        self._compute_s: float | None = None  # this step's, from guard_step to step_done (None: no guard_step)
        self._stacks = _register_stack_dump(self.layout.stack_dump(self.rank, self.attempt), self.layout.root)
        self._flight = (
            None
            if self._stacks is None
            else FlightRecorderDumps(self._stacks, self.layout.flight_dump(self.rank, self.attempt), self.layout.root)
        )
        self._term_pending = False  # a SIGTERM arrived during a save; it takes effect when the save is done
        self._orders = StopOrders(self.layout.stop_order)
        self._obeyed: int | None = None  # id of the last stop order carried out
        # At guard_step: the order this rank held, and the (lowest, highest) order id any rank held.
        self._orders_held: tuple[StopOrder | None, tuple[int, int]] | None = None
        self._resumed_at = 0  # orders for steps up to here were carried out before this process started
        self._previous_term = _install_handler(signal.SIGTERM, self._on_sigterm)
        self._heartbeat.beat(0, self._phase, force=True)
        self.log.info("rank_started", pid=os.getpid(), world_size=self.world_size)
        if framework_save is None:
            self._say_if_no_checkpoints()
            self.layout = replace(self.layout, memory=self._memory_dir())
        self._sharded_format = framework_save is None and self._choose_format() == "dcp"
        # The memory tier (worker.memory_tier): the slot of the newest complete snapshot, never the next one written;
        # whether its snapshots fit was asked (once, at the first, on every rank alike); bytes held per slot; the
        # step this process pinned last (a stop's or the final save of that step drops the pin: it goes to disk).
        self._memory_newest: int | None = None  # set at a resume from a memory slot: every rank alike
        self._memory_given = framework_save is None and bool(os.environ.get(ENV_MEMORY_DIR))  # alike on every rank
        self._memory_room_checked = False
        self._memory_bytes: dict[int, int] = {}
        self._pinned: int | None = None
        _at_exit_once()
        # worker.run: how this attempt's Warden unwinds after a peer failed, and when it must not be interrupted.
        self._detach = attach(self._unwind, lambda: self._phase == SAVE_PHASE)

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the number of steps already done.

        Afterwards `batches` is the index of the next batch to train on (past any window the supervisor
        said to skip after an anomaly abort).
        """
        step = self._load_resume_checkpoint()
        self._resumed, self._resumed_at, self._saved_at = True, step, step
        if step and self._trajectory is not None and (unverified := self._trajectory.resumed(step)):
            self.log.info("resume_unverified", step=step, reason=unverified)
        skip_to = int(os.environ.get(ENV_SKIP_TO_BATCH) or 0)
        if self.batches < skip_to:
            self.log.warning("data_window_skipped", from_batch=self.batches, to_batch=skip_to, step=self.step)
            self.samples += (skip_to - self.batches) * (self.global_batch_size or 0)
            self.batches = skip_to
        self._last_step_end = self._compute_since = time.perf_counter()
        return step

    def _load_resume_checkpoint(self) -> int:
        found = self._resume_point()
        if found is None:
            self.log.info("fresh_start")
            return 0
        store, step = found
        self._memory_newest = self._resumed_slot(store)
        if store.is_sharded(step, self.config.prefix):
            state, resharded = self._load_sharded(store, step)
        else:
            state, resharded = self._load(store, step), False
            self._check_world_size(state, store, step)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if resharded:
            derived_rng(state["rng"], step, self.rank)
        else:
            for part, reason in restore_rng(state["rng"]).items():
                self.log.warning(_RNG_NOT_RESTORED[part], step=step, reason=reason)
                self._heartbeat.inexact = f"{part} RNG state not restored: {reason}"
        self.data_state = state["data_state"]
        if self._schedule is not None:
            self._schedule.resumed(int(state.get("snapshot_every") or 0))
        self._restore_extra_state(state, step)
        saved_batch = state.get("global_batch_size")
        if saved_batch and self.global_batch_size and saved_batch != self.global_batch_size:
            # Gradient norms scale with the batch's noise: a history of the old size would misjudge the new one.
            self.log.warning(
                "anomaly_history_reset",
                step=step,
                saved_global_batch_size=saved_batch,
                global_batch_size=self.global_batch_size,
            )
        elif state.get("anomaly_history") is not None:  # checkpoints before these were kept have neither
            self._guard.detector.load_state_dict(state["anomaly_history"])
        if state.get("feature_history") is not None:
            self._features.load_state_dict(state["feature_history"])
        self.step = step
        self.batches = self._resumed_position(state["data_position"], state.get("global_batch_size"))
        self.samples = self._resumed_samples(state)
        self.log.info(
            "resumed",
            step=step,
            data_position=self.batches,
            saved_data_position=state["data_position"],
            samples=self.samples,
            source=store.label,
            directory=str(store.root),
        )
        return step

    def _load_sharded(self, store: CheckpointStore, step: int) -> tuple[dict[str, Any], bool]:
        """Model and optimizer restored from a sharded checkpoint (resharded if another world size wrote it), and
        this rank's state (rank 0's after a change of world size); a manifest that does not check out, or a file
        refused, ends the rank with EXIT_CHECKPOINT_REFUSED."""
        directory = store.sharded_dir(step, self.config.prefix)
        self._need_numpy()
        try:
            loaded = self._sharded_checkpointer().load(directory, step, self.model, self.optimizer)
        except (ManifestError, OSError, pickle.UnpicklingError) as exc:
            self.log.error("checkpoint_refused", step=step, path=str(directory), error=str(exc), source=store.label)
            leave(EXIT_CHECKPOINT_REFUSED)
        if loaded.resharded:
            self.log.warning(
                "world_size_changed",
                step=step,
                saved_world_size=loaded.manifest["world_size"],
                world_size=self.world_size,
                resumed="resharded; RNG streams derived, not bitwise",
            )
        return loaded.state, loaded.resharded

    def _sharded_checkpointer(self) -> Any:
        if self._sharded is None:
            from worker.sharded import ShardedCheckpointer

            self._sharded = ShardedCheckpointer(
                rank=self.rank,
                world_size=self.world_size,
                root=self.layout.root,
                async_save=self.config.async_save,
                on_write=self._faults.in_background_write,
            )
        return self._sharded

    def _load(self, store: CheckpointStore, step: int) -> dict[str, Any]:
        """The checkpoint's contents; a refused file ends the rank with EXIT_CHECKPOINT_REFUSED (use an older one)."""
        if not self.config.weights_only:
            path = store.file(self.rank, step, self.config.prefix)
            self.log.warning(
                "unsafe_checkpoint_load",
                step=step,
                path=str(path),
                reason="worker.weights_only is false: a crafted checkpoint file can run any code here",
            )
        try:
            return load_checkpoint(
                store, rank=self.rank, step=step, prefix=self.config.prefix, weights_only=self.config.weights_only
            )
        except CheckpointRefused as exc:
            self.log.error("checkpoint_refused", step=step, path=str(exc.path), error=exc.reason, source=store.label)
            leave(EXIT_CHECKPOINT_REFUSED)

    def _check_world_size(self, state: dict[str, Any], store: CheckpointStore, step: int) -> None:
        """A checkpoint another number of ranks wrote holds only some ranks' state: end with EXIT_CONFIG (plain
        torchrun; the supervisor refuses such a resume before launching)."""
        saved = state.get("world_size")
        if type(saved) is int and saved != self.world_size:
            self.log.error(
                "world_size_changed",
                step=step,
                saved_world_size=saved,
                world_size=self.world_size,
                directory=str(store.root),
            )
            print(
                f"trainwarden: checkpoint {step} in {store.root} was written by {saved} ranks, this job has "
                f"{self.world_size}: use a new run dir, or resume_training: false to start from scratch",
                file=sys.stderr,
            )
            leave(EXIT_CONFIG)

    def _resumed_samples(self, state: dict[str, Any]) -> int:
        """The global sample count to go on from: as saved, unless the data position was reset or moved."""
        saved = state.get("samples")
        if type(saved) is int and not self.config.ignore_data_skip and self.config.data_skip_steps is None:
            return saved
        return self.batches * (self.global_batch_size or 0)

    def _resumed_position(self, saved: int, saved_batch_size: int | None) -> int:
        """Seed 001: continue the data where the checkpoint left it, unless the dataset or batch size changed."""
        if self.config.ignore_data_skip:  # a new dataset, read from its beginning
            return 0
        if self.config.data_skip_steps is not None:  # a new dataset, this many steps of it already trained
            return self.config.data_skip_steps
        if saved_batch_size and self.global_batch_size and saved_batch_size != self.global_batch_size:
            # The same samples seen, counted in batches of the new size (rounded down, as the seed says).
            return saved * saved_batch_size // self.global_batch_size
        return saved

    def guard_step(
        self, loss: Any, *, max_norm: float | None = None, recompute: Callable[[int], Any] | None = None
    ) -> bool:
        """Between `backward()` and `optimizer.step()`: clip gradients to `max_norm` (None: no clipping) and say
        whether to step.

        False means skip this batch (a NaN/Inf, a global-norm spike, or a GradScaler overflow, which the scaler
        skips anyway); every rank gets the same answer. With a GradScaler in `extra_state`, call
        `scaler.unscale_(optimizer)` first, then `scaler.step(optimizer)` only if this returns True, and
        `scaler.update()` either way. A streak of `global_norm_spike_count_threshold` skipped anomalies exits with
        EXIT_ANOMALY, and so does, on every rank, a feature-value fault on any rank at `feature_value_check.level`
        2 or 3.

        `recompute(rank)`: the loss of the batch `rank` trained at this step, computed again through the model
        (its backward is run here). Given it, a DDP job re-runs a step that alarmed to tell a bad GPU from a bad
        batch (worker.rerun): `sdc_verdict` events; a transient fault's step goes on with the re-run's gradients.
        """
        step, batch = self.step + 1, self.batches
        self._faults.in_compute(step)
        # Compute ends here; then comes waiting for peers: the guard's all-reduce, and on a GPU the host's first sync
        # (the clip), which waits for DDP's gradient all-reduce.
        self._compute_s = time.perf_counter() - self._compute_since
        scaler = self._scaler()
        fault = self._features.verdict(step=step, batch=batch, loss_scale=self._loss_scale(scaler))
        held = self._orders.poll()
        verdict = self._guard.check(
            self.model.parameters(),
            float(loss),
            step=step,
            batch=batch,
            max_norm=math.inf if max_norm is None else max_norm,
            feature_fault=fault if self._features.aborts else None,
            order_id=held.id if held else 0,
            save_due=self._save_clock_due(),
            amp_scaling=scaler is not None,
            snapshot_every=None if self._schedule is None else self._schedule.proposed,
            fingerprint=None if self._fingerprints is None else self._fingerprints.take(),
            rerun=self._rerun_with(recompute),
            listed=batch in self._skips,
        )
        if data := [v.rank for v in verdict.sdc if v.verdict == DATA]:
            self._skips.add(batch, step=step, ranks=data)
        if self._schedule is not None:
            self._schedule.agree(verdict.snapshot_every)
        self._heartbeat.skipped = self._guard.skipped
        if fault:
            self._guard.saw("feature_value")
        if verdict.suspects:
            self._features.abort(step=step, batch=batch, suspect_ranks=list(verdict.suspects))
        if fault and verdict.apply:
            self._taint(step)
        self._decision = (verdict.apply, verdict.grad_norm, verdict.save_due)
        self._orders_held = (held, verdict.orders)
        return verdict.apply

    @property
    def should_stop(self) -> bool:
        """True once a stop order was carried out (checkpoint saved): end the loop, and code after it runs.

        A loop that never asks is ended inside `step_done` instead (exit 0), as it always was.
        """
        self._loop_asks = True
        return self._stopping

    def steps(self, total: int) -> Iterator[int]:
        """The training loop: resumes (if not done yet), then yields the number of the step to attempt until
        `total` steps are applied or a stop was ordered. A skipped batch yields the same number again."""
        self._heartbeat.total_steps = _whole_or_none(total)
        if not self._resumed:
            self.resume()
        while self.step < total and not self.should_stop:
            yield self.step + 1

    def step_done(
        self, *, loss: float | None, grad_norm: float | None = None, step: int | None = None, **fields: Any
    ) -> bool:
        """Report that this batch is done: counts the step if it was applied, saves a checkpoint when due.

        Returns whether the step was applied (False: the batch was skipped and `step` did not move), so a loop's
        own logging or eval at step multiples can run once per step. `step`: a trainer's own count of optimizer
        steps, which counts skipped ones too (worker.integrations); `loss` None: the trainer did not say.
        """
        if self._stopping:  # the loop went on after a stop it had asked about
            self.log.warning("trained_past_stop", step=self.step)
            self.finish()
            leave(0)
        now = time.perf_counter()
        step_time_s, self._last_step_end = now - self._last_step_end, now
        compute_s, self._compute_s = self._compute_s, None
        self._step_starts()
        if self._decision is None:  # no guard_step: judge the feature values here, on this rank alone
            self._judge_unguarded()
        applied, guarded_norm, save_due = self._decision or (True, grad_norm, None)
        self._decision = None
        self._check_exactness(loss)
        self.batches += 1
        self.samples += self.global_batch_size or 0
        self.step = self.step + applied if step is None else step
        self._note_background_save()
        self.log.info(
            "step",
            step=self.step,
            batch=self.batches - 1,
            skipped=not applied,
            loss=None if loss is None else float(loss),
            grad_norm=None if guarded_norm is None else float(guarded_norm),
            step_time_s=round(step_time_s, 6),
            **fields,
        )
        self._phase = "train"
        self._heartbeat.beat(
            self.step, "train", step_time_s=step_time_s, compute_s=compute_s, loss=None if loss is None else float(loss)
        )
        if not applied:
            return False
        self._faults.after_step(self.step)
        if not self._first_step_done:
            self._after_first_step()
        saved = self._checkpoint_due(save_due)
        snapshot_due = self._snapshot_due(step_time_s, saved=saved, agreed=save_due is not None)
        self._on_schedule = True
        try:
            if saved or snapshot_due:
                self._save_on_schedule(saved)
        finally:
            self._on_schedule = False
        if self._trajectory is not None and (saved or snapshot_due):
            self._trajectory.saved(self.step)
        self._obey_stop_order(saved and self._saved_at == self.step)  # a pinned snapshot is not on disk yet
        self._last_step_end = self._compute_since = time.perf_counter()  # a save is not part of the next step
        return True

    def resume_inexact(self, reason: str, **fields: Any) -> None:
        """Say that this process's resume is not exact, and why: in its log, and to the supervisor (its heartbeat),
        which journals it and shows it in `status`."""
        self.log.warning("resume_inexact", step=self.step, reason=reason, **fields)
        self._heartbeat.inexact = reason

    def _check_unsaved_state(self) -> None:
        """After this process's first step, or at its first save: state the checkpoint would lack."""
        if not self._state_checked:
            self._state_checked = True
            if unregistered_scalers(self.extra_state.values()):
                self.resume_inexact(UNREGISTERED_SCALER)

    def _check_exactness(self, loss: float | None) -> None:
        """The replay check's verdict on this batch (worker.verify_resume)."""
        if self._trajectory is None:
            return
        verdict = self._trajectory.batch_done(loss)
        if verdict is True:
            self.log.info("resume_verified", step=self._resumed_at, batches=self.config.verify_resume)
        elif isinstance(verdict, tuple):
            batch, now, before = verdict
            self.resume_inexact(
                f"the resumed run differs from the run before at batch {batch} after step {self._resumed_at}: "
                f"loss {now!r}, before the resume {before!r}",
                resumed_from=self._resumed_at,
            )

    # -- the snapshot cadence (worker.cadence) -----------------------------------------------------------------------

    def _snapshot_schedule(self) -> SnapshotSchedule | None:
        """`snapshot_steps: auto`'s schedule, with the run's failures as the supervisor counted them (none known
        under a plain torchrun: the prior); None for a fixed interval. ValueError for a setting that is neither."""
        every = self.config.snapshot_steps
        if every != "auto":
            if type(every) is not int or every < 0:
                raise ValueError(f"worker.snapshot_steps must be 0 or more, or auto, got {every!r}")
            return None
        failures, wall_s = parse_failures(os.environ.get(ENV_FAILURES) or "") or (0, 0.0)
        by_time = self.config.save_checkpoint_interval_s if self.config.save_checkpoint_steps == 0 else 0.0
        cadence = SnapshotCadence(
            failures=failures,
            wall_s=wall_s,
            disk_every_steps=self.config.save_checkpoint_steps,
            disk_every_s=by_time,
        )
        return SnapshotSchedule(cadence, counted_at=time.monotonic())

    def _snapshot_due(self, step_time_s: float, *, saved: bool, agreed: bool) -> bool:
        """Whether to snapshot after this applied step: every `snapshot_steps`, or when `auto`'s schedule says (its
        interval agreed by guard_step's all-reduce, or without guard_step by one of its own, at most every
        CLOCK_AGREE_STEPS steps). Never at a step saved as a regular checkpoint."""
        schedule = self._schedule
        if schedule is None:
            return not saved and _due(self.step, int(self.config.snapshot_steps))
        schedule.cadence.step_measured(step_time_s)
        if not agreed and (self.world_size == 1 or self.step % CLOCK_AGREE_STEPS == 0):
            schedule.agree(_lowest(schedule.proposed, self.world_size, self.model))
        if saved:
            schedule.saved(self.step)
            return False
        return schedule.due(self.step) and self._memory_tier_on()  # a tier turned off (no room) ends `auto`'s snapshots

    def _save_on_schedule(self, saved: bool) -> None:
        """The save (`saved`) or snapshot the cadence made due. With `auto`, a snapshot's stall is measured, and a
        save's where it went to memory (a snapshot pinned there), and a new interval is said (`cadence_chosen`)."""
        started = time.perf_counter()
        if saved:
            self.save(self.step)
        else:
            self.snapshot(self.step)
        if self._schedule is None or (saved and self.layout.memory is None):
            return
        choice = self._schedule.snapshotted(self.step, time.perf_counter() - started, now=time.monotonic())
        if choice is not None:
            self._say_cadence(choice)

    def _say_cadence(self, choice: Choice) -> None:
        """`cadence_chosen`: this rank's new interval, its rule and the figures behind it (all take the lowest)."""
        assert self._schedule is not None
        cadence = self._schedule.cadence
        self.log.info(
            "cadence_chosen",
            step=self.step,
            interval_steps=choice.interval_steps,
            rule=choice.rule,
            reason=choice.reason,
            stall_s=round(choice.stall_s, 6),
            step_s=round(choice.step_s, 6),
            mtbf_s=round(choice.mtbf_s, 1),
            young_daly_steps=choice.young_daly_steps,
            failures=cadence.failures,
            wall_s=round(cadence.wall_s, 1),
            disk_every_steps=cadence.disk_every_steps,
        )

    def _disk_snapshot_slot(self, step: int) -> int:
        """The disk slot for a snapshot of `step`: `step // N % 2` for a fixed N, so that consecutive ones alternate;
        with `auto`, whose intervals vary, the other slot than the last one, starting with the one not resumed from
        (which every rank names alike: a slot holding the newest complete snapshot is never overwritten)."""
        every = self.config.snapshot_steps
        if every != "auto":
            return SNAPSHOT_SLOTS[step // int(every) % len(SNAPSHOT_SLOTS)]
        if self._auto_slot is None:
            resumed = os.environ.get(ENV_RESUME_DIR) or ""
            held = [slot for slot in SNAPSHOT_SLOTS if resumed == str(self.layout.snapshot_slot(slot).root)]
            self._auto_slot = held[0] if held else SNAPSHOT_SLOTS[-1]
        self._auto_slot = SNAPSHOT_SLOTS[1 - self._auto_slot]
        return self._auto_slot

    def _checkpoint_due(self, agreed: bool | None) -> bool:
        """Every `save_checkpoint_steps` steps; without a step count, once `save_checkpoint_interval_s` passed on
        any rank's clock (`agreed` by guard_step, else agreed here), so that every rank saves the same step."""
        if self.config.save_checkpoint_steps > 0:
            return _due(self.step, self.config.save_checkpoint_steps)
        if self.config.save_checkpoint_interval_s <= 0:
            return False
        if agreed is not None:
            return agreed
        # Without guard_step, a collective of its own: every CLOCK_AGREE_STEPS steps, not to sync every step.
        return self.step % CLOCK_AGREE_STEPS == 0 and _any_rank(self._save_clock_due(), self.world_size, self.model)

    def _save_clock_due(self) -> bool:
        every = self.config.save_checkpoint_interval_s
        return self.config.save_checkpoint_steps == 0 and every > 0 and time.monotonic() - self._last_save >= every

    def _scaler(self) -> Any:
        """An enabled GradScaler in `extra_state`, or None: its overflows are not anomalies."""
        return next(
            (
                obj
                for obj in self.extra_state.values()
                if callable(getattr(obj, "unscale_", None))
                and callable(getattr(obj, "is_enabled", None))
                and obj.is_enabled()
            ),
            None,
        )

    def _loss_scale(self, scaler: Any) -> float | None:
        """The scale the feature values are judged under; read only when they are checked (on a GPU it syncs)."""
        return float(scaler.get_scale()) if scaler is not None and self._features.names else None

    def _say_if_no_checkpoints(self) -> None:
        if self.config.save_checkpoint_steps or self.config.save_checkpoint_interval_s > 0:
            return
        self.log.warning("checkpointing_off", reason="save_checkpoint_steps and save_checkpoint_interval_s are 0")
        if self.rank == 0:
            print(
                "trainwarden: WARNING: this run saves no checkpoints (worker.save_checkpoint_steps and "
                "worker.save_checkpoint_interval_s are 0): after a crash it starts again from step 0",
                file=sys.stderr,
                flush=True,
            )

    def _obey_stop_order(self, saved: bool) -> None:
        """At the stop order's step: save (unless just saved), then exit or go on. Every rank acts at the same
        step: with guard_step, the step from which all ranks held the order (its step, or later if some rank
        read it late); without, the order's step as named (the supervisor chose it with room to spare)."""
        # One os.stat per step: the order guard_step agreed on, or (no guard_step) a fresh look.
        order, held = self._orders_held if self._orders_held else (self._orders.poll(), None)
        self._orders_held = None
        if order is None or order.id == self._obeyed or order.step <= self._resumed_at:
            return
        # With guard_step: once every rank holds this order, at its step or (some rank read it late) now.
        due = self.step >= order.step and held == (order.id, order.id) if held else self.step == order.step
        if not due:
            return
        self._obeyed = order.id
        if self.step > order.step:
            self.log.warning("stop_order_late", step=self.step, ordered_step=order.step, order=order.id)
        if not saved:
            self.save(self.step)
        self.log.info("stop_order_done", step=self.step, order=order.id, exit=order.exit)
        if order.exit and self._loop_asks:
            self._stopping = True  # `should_stop` ends the loop; the script then exits 0 on its own
        elif order.exit:
            self.finish()
            leave(0)  # stopped on request: a success, nothing to retry

    def _feature_value_check(self) -> FeatureValueCheck:
        config, problems = with_env(self.config.feature_value_check, os.environ)
        for problem in problems:
            self.log.warning("feature_value_env_invalid", problem=problem)
        return FeatureValueCheck(
            self.model,
            config,
            log=self.log,
            faults=self._faults,
            rank=self.rank,
            attempted_step=lambda: self.step + 1,
            on_leave=self._leaving,
        )

    def _judge_unguarded(self) -> None:
        """Without guard_step a fault is seen after the optimizer step, still before this step's checkpoint."""
        step, batch = self.step + 1, self.batches
        if self._features.verdict(step=step, batch=batch, loss_scale=self._loss_scale(self._scaler())):
            self._guard.saw("feature_value")
            if self._features.aborts:
                self._features.abort(step=step, batch=batch, suspect_ranks=[self.rank])
            self._taint(step)

    def _taint(self, step: int) -> None:
        """A feature-value fault went into the model (level 1 trains on): checkpoints from now on are suspect."""
        if self._tainted_at is None:
            self._tainted_at = step

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a stretch of work (`eval`, `save`, a custom name) so the supervisor applies its timeout."""
        previous = self.enter_phase(name)
        try:
            yield
        finally:
            self.leave_phase(name, previous)

    def enter_phase(self, name: str) -> str:
        """`phase` for a trainer's callbacks, whose stretches begin in one hook and end in another: returns the
        phase to go back to (`leave_phase`)."""
        previous, self._phase = self._phase, name
        self._heartbeat.beat(self.step, name, force=True)
        return previous

    def leave_phase(self, name: str, previous: str) -> None:
        self._phase = previous
        self._step_starts()  # an eval between steps is not the next step's compute
        self._heartbeat.beat(self.step, previous, force=True)
        if name == SAVE_PHASE and self._term_pending:
            self.log.warning("stopped_after_save", step=self.step)
            self._obey_sigterm()

    def beat(self) -> None:
        """Show progress inside a long phase (an eval loop, a slow data fetch); throttled, never raises."""
        self._heartbeat.beat(self.step, self._phase)

    def save(self, step: int) -> Path:
        """Save this rank's checkpoint of `step` atomically (all ranks must save the same steps). With the memory
        tier on, a save the cadence made due is a snapshot in memory, pinned for the supervisor to copy to disk; any
        other (a stop's, the final one, the script's own) is written to disk here."""
        if self._on_schedule and self._memory_tier_on():
            return self._snapshot_in_memory(step, pin=True)
        with self.phase(SAVE_PHASE):
            if step == self._pinned:  # a stop's or the final save of a pinned step: the supervisor is copying it
                persisted = self._await_persisted(step)
                if persisted is not None:
                    return persisted
                self._unpin(step)  # not in time: this step goes to disk from here, and not from the pin
            return self._save(step, self.layout.checkpoints)

    def _await_persisted(self, step: int) -> Path | None:
        """This rank's checkpoint of `step` on disk once the supervisor has copied its pin there (it is copying it
        now, and a second write of the same step beside the copy could pair one write's file with the other's
        record), or None after PERSIST_WAIT_S."""
        started = time.perf_counter()
        store, prefix = self.layout.checkpoints, self.config.prefix
        while time.perf_counter() - started < PERSIST_WAIT_S:
            steps = store.sharded_steps(prefix) if self._sharded_format else store.steps(self.rank, prefix)
            if step in steps:
                path = store.sharded_dir(step, prefix) if self._sharded_format else store.file(self.rank, step, prefix)
                self._saved(step, store, path, time.perf_counter() - started, persisted_by="supervisor")
                self._pinned = None
                return path
            self.beat()  # alive, waiting on the supervisor's copy (its persists queue up): not a hung save
            time.sleep(PERSIST_POLL_S)
        self.log.warning("persist_wait_timed_out", step=step, waited_s=PERSIST_WAIT_S, then="saving it to disk here")
        return None

    def snapshot(self, step: int) -> Path:
        """Save a snapshot of `step` into the slot not holding the previous one (seed 004): at most two exist. In
        memory when the supervisor gave a memory directory and the snapshots fit there, else on disk."""
        if self._memory_tier_on():
            return self._snapshot_in_memory(step, pin=False)
        store = self.layout.snapshot_slot(self._disk_snapshot_slot(step))
        with self.phase(SAVE_PHASE):
            self._empty_slot(store)
            return self._save(step, store)

    def _empty_slot(self, store: CheckpointStore) -> None:
        """This rank's files in a snapshot slot (rank 0: its sharded directories) go before the slot is reused."""
        clear_slot(store, self.rank, self.config.prefix)
        if self.rank == 0 and self._sharded_format:
            for old in store.sharded_steps(self.config.prefix, kind="any"):
                remove_sharded(store.sharded_dir(old, self.config.prefix))

    # -- the memory tier (worker.memory, worker.memory_tier) -------------------------------------------------------

    def _memory_dir(self) -> Path | None:
        """The memory directory the supervisor gave (ENV_MEMORY_DIR), if it is one we may trust; a refused one is
        said (`memory_tier_off`) and snapshots and saves go to disk as without it."""
        given = os.environ.get(ENV_MEMORY_DIR)
        if not given:
            return None
        try:
            return check_memory_dir(Path(given))
        except OSError as exc:
            self.log.warning("memory_tier_off", directory=given, reason=exc.strerror or str(exc))
            return None

    def _store_at(self, path: Path) -> CheckpointStore:
        """The store the supervisor named to resume from: in the memory tier (named so in the logs), or on disk."""
        memory = self.layout.memory
        if memory is not None and path.is_relative_to(memory):
            return CheckpointStore(path, label=MEMORY_LABEL, base=memory)
        return CheckpointStore(path)

    def _resumed_slot(self, store: CheckpointStore) -> int | None:
        """The memory slot a resume came from (the next snapshot goes to the other), or None (then slot 0 first).
        From the resume point, which every rank shares, never from what each rank finds in its slots: after a kill
        the survivors hold one step more than the killed rank, in the other slot, and snapshots split between the
        slots by rank would never again be complete on every rank."""
        if self.layout.memory is None:
            return None
        held = [slot for slot in SNAPSHOT_SLOTS if store.root == self.layout.memory_slot(slot).root]
        return held[0] if held else None

    def _memory_tier_on(self) -> bool:
        """Whether snapshots go to memory: a memory directory was given and its snapshots fit (asked at the first
        snapshot, a step every rank reaches: ranks agree, as a sharded save needs, even where one refused its
        directory)."""
        if not self._memory_given:
            return False
        if not self._memory_room_checked:
            self._memory_room_checked = True
            problem = self._memory_room_problem()
            if _any_rank(problem is not None, self.world_size, self.model):
                memory, self.layout = self.layout.memory, replace(self.layout, memory=None)
                if memory is not None:  # a refused directory was said at start
                    reason = problem or "another rank cannot keep its snapshots in memory"
                    self.log.warning("memory_tier_off", step=self.step, directory=str(memory), reason=reason)
        return self.layout.memory is not None

    def _memory_room_problem(self) -> str | None:
        """Why this node's memory cannot hold two slots and a pin of every local rank's snapshots, or None."""
        if self.layout.memory is None:
            return "its memory directory was refused"
        rank_bytes = _tensor_bytes(self.model.state_dict()) + _tensor_bytes(self.optimizer.state_dict())
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        local_ranks = int(local) if local.isdigit() and int(local) > 0 else self.world_size  # torchrun's, or all
        if self._sharded_format and local_ranks < self.world_size:  # each node's memory would hold some shards only
            return "sharded checkpoints spanning nodes are not kept in memory (each node holds some shards only)"
        try:
            room = memory_room(self.layout.memory)
        except OSError as exc:
            return f"cannot tell how much memory is free: {exc}"
        return snapshot_room_problem(rank_bytes, local_ranks, room, self.config.snapshot_max_bytes)

    def _snapshot_in_memory(self, step: int, *, pin: bool) -> Path:
        """A snapshot of `step` in the memory slot not holding the newest complete one (a kill mid-copy leaves that
        one whole); `pin`: a scheduled save, hard-linked into MEMORY/persist/STEP for the supervisor to persist."""
        slot = SNAPSHOT_SLOTS[0] if self._memory_newest is None else SNAPSHOT_SLOTS[1 - self._memory_newest]
        store = self.layout.memory_slot(slot)
        started = time.perf_counter()
        # No save phase: its two forced heartbeat writes (to the run dir) would cost more than this copy; a copy to
        # memory is over long before any phase timeout would tell it apart from training.
        self._empty_slot(store)
        self._faults.in_save(step)
        self._check_unsaved_state()
        path = self._snapshot_sharded(step, store, started) if self._sharded_format else self._save_files(step, store)
        if pin:
            self._pin(step, store)
        stall_s = time.perf_counter() - started
        self._memory_newest = slot
        self._memory_bytes[slot] = self._snapshot_bytes(store, step)
        self._heartbeat.memory_bytes, self._heartbeat.memory_step = sum(self._memory_bytes.values()), step
        self._heartbeat.last_save_s = round(stall_s, 6)
        self._heartbeat.save_s += self._heartbeat.last_save_s  # the loop's stall: goodput's save time
        self._last_save = time.monotonic()  # the time-based cadence counts from a pinned save too
        self.log.info(
            "snapshot_pinned" if pin else "snapshot_saved",
            step=step,
            path=str(path),
            bytes=self._memory_bytes[slot],
            stall_s=round(stall_s, 4),
            **({"pin": str(self.layout.memory_pin(step).root)} if pin else {}),
        )
        self._faults.after_save(step)
        return path

    def _snapshot_sharded(self, step: int, store: CheckpointStore, started: float) -> Path:
        """A sharded snapshot into memory, written synchronously: the copy into tmpfs is its only stall, so the
        background writer (which serves the disk saves a rank still makes) is not needed."""
        self._wait_for_save_in_flight(step, started)  # one save at a time: a disk save in flight ends first
        self._write_sharded(step, store, started, root=self.layout.memory, background=False)
        self._sharded_checkpointer().wait()  # written: taken off the checkpointer, raising what the write raised
        return store.sharded_dir(step, self.config.prefix)

    def _write_sharded(self, step: int, store: CheckpointStore, started: float, **where: Any) -> float:
        """Hand this rank's state of `step` to the sharded checkpointer (`where`: its root and background options);
        the loop's stall."""
        return self._sharded_checkpointer().save(
            store.sharded_dir(step, self.config.prefix),
            step,
            self.model,
            self.optimizer,
            self._rank_state(),
            self._health(),
            self._sharded_common(),
            started=started,
            **where,
        )

    def _pin(self, step: int, store: CheckpointStore) -> None:
        """Hard-link this rank's files of the snapshot of `step` (sharded: rank 0, the whole directory, complete on
        return from the synchronous save) into its pin."""
        pin = self.layout.memory_pin(step)
        if not self._sharded_format:
            pin_files(store, pin, rank=self.rank, step=step, prefix=self.config.prefix)
        elif self.rank == 0:
            pin_sharded(store, pin, step=step, prefix=self.config.prefix)
        self._pinned = step

    def _unpin(self, step: int) -> None:
        """Drop this rank's pin of `step` (a stop's or the final save writes that step to disk itself)."""
        if self.layout.memory is None:
            return
        pin = self.layout.memory_pin(step)
        if not self._sharded_format:
            unpin_files(pin, rank=self.rank, step=step, prefix=self.config.prefix)
        elif self.rank == 0:
            unpin_sharded(pin, step=step, prefix=self.config.prefix)
        self._pinned = None

    def _snapshot_bytes(self, store: CheckpointStore, step: int) -> int:
        """The bytes this rank's snapshot of `step` in `store` takes (its files, as its record says)."""
        try:
            if self._sharded_format:
                record = read_json(store.sharded_dir(step, self.config.prefix) / rank_record_name(self.rank))
                return sum(int(entry["size"]) for entry in record["files"].values())
            return int(read_json(store.record(self.rank, step, self.config.prefix))["size"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _save(self, step: int, store: CheckpointStore) -> Path:
        started = time.perf_counter()
        if self._framework_save is not None:
            return self._ask_framework(step, store, started)
        self._faults.in_save(step)
        self._check_unsaved_state()
        if self._sharded_format:
            return self._save_sharded(step, store, started)
        path = self._save_files(step, store)
        took = time.perf_counter() - started  # once: the log line below takes time too, on a loaded machine
        self._saved(step, store, path, took)
        self._heartbeat.last_save_s = round(took, 6)
        self._heartbeat.save_s += self._heartbeat.last_save_s
        self._faults.after_save(step)
        return path

    def _save_files(self, step: int, store: CheckpointStore) -> Path:
        """This rank's checkpoint file of `step` in `store`, its record and meta.json (worker.checkpoint)."""
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self._rank_state(),
        }
        return save_checkpoint(
            store,
            rank=self.rank,
            step=step,
            prefix=self.config.prefix,
            payload=payload,
            health=self._health(),
            before_rename=self._torn_save if self._faults.due("sigkill_in_save", step) else None,
            in_memory=store.label == MEMORY_LABEL,
        )

    def _ask_framework(self, step: int, store: CheckpointStore, started: float) -> Path:
        """The trainer saves `step` now (then it is recorded here), or later, after this step's callbacks (then
        its callback calls `begin_save` and `framework_saved`)."""
        save = self._framework_save
        assert save is not None  # the caller's check
        if getattr(save, "deferred", False):
            save(step)
            return store.framework_dir(step, self.config.prefix)
        self._faults.in_save(step)
        written = save(step)
        self.framework_saved(step, written, started=started)
        return written

    def begin_save(self, step: int) -> str:
        """A trainer is about to write its checkpoint of `step`: the save phase begins (its timeout applies);
        returns the phase to go back to (`leave_phase`)."""
        previous = self.enter_phase(SAVE_PHASE)
        self._faults.in_save(step)
        return previous

    def framework_resumed(self, step: int, source: str | None) -> None:
        """A trainer restored its own checkpoint of `step` (`source`; step 0: a fresh start): orders up to it were
        carried out before this process started, and its checkpoint need not be saved again."""
        self.step = self._resumed_at = self._saved_at = step
        self._resumed = True
        if step:
            self.log.info("resumed", step=step, source=self._framework_name, directory=str(source))
        else:
            self.log.info("fresh_start")
        self._last_step_end = time.perf_counter()
        self._step_starts()

    def expect_steps(self, total: int | None) -> None:
        """The run's length in steps, for the supervisor's progress and ETA (a trainer's own loop knows it)."""
        self._heartbeat.total_steps = _whole_or_none(total)

    def framework_saved(self, step: int, directory: Path, *, started: float | None = None) -> None:
        """The trainer wrote its checkpoint of `step` into `directory`: every rank records its share of the files and
        its health, rank 0 the manifest (collective: every rank calls it for the same step)."""
        from worker.integrations.records import record_completion

        duration_s = record_completion(
            directory,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            health=self._health(),
            framework=self._framework_name,
            root=self.layout.root,
        )
        took = duration_s if started is None else time.perf_counter() - started
        self._saved(step, self.layout.checkpoints, directory, took, framework=self._framework_name)
        self._heartbeat.last_save_s = round(took, 6)
        self._heartbeat.save_s += self._heartbeat.last_save_s
        self._faults.after_save(step)

    @property
    def _framework_name(self) -> str:
        return str(getattr(self._framework_save, "framework", "framework"))

    def _saved(self, step: int, store: CheckpointStore, path: Path, duration_s: float, **fields: Any) -> None:
        self.log.info("checkpoint_saved", step=step, path=str(path), duration_s=round(duration_s, 4), **fields)
        self._last_save = time.monotonic()
        if store == self.layout.checkpoints:
            self._saved_at = step

    def _after_first_step(self) -> None:
        """What the first save would pay beyond the others, paid after the first step (the optimizer's state exists)
        so that the first save stalls like the others: the check for state checkpoints would lack, and the staging
        buffers of a background save, allocated in a thread (worker.sharded's `prepare`)."""
        if self._framework_save is not None or not (self._checkpointing or self.config.snapshot_steps):
            self._first_step_done = True
            return
        self._check_unsaved_state()
        if not (self._sharded_format and self.config.async_save):
            self._first_step_done = True
        elif getattr(self.optimizer, "state", True):  # none yet (a skipped step): DCP would step it to make one
            self._first_step_done = True
            self._sharded_checkpointer().prepare(self.model, self.optimizer)

    def _save_sharded(self, step: int, store: CheckpointStore, started: float) -> Path:
        """A sharded save: with async_save the loop goes on once the state is staged (one save in flight). Its
        stall is all the loop spends in it, from `started`: `waited_s` of it for the previous save's write."""
        waited_s = self._wait_for_save_in_flight(step, started)  # the previous one is done before this one starts
        directory = store.sharded_dir(step, self.config.prefix)
        stall_s = self._write_sharded(step, store, started)
        self._heartbeat.last_save_s = round(stall_s, 6)
        self._heartbeat.save_s += self._heartbeat.last_save_s  # goodput's save time: the waits are in it
        self._last_save = time.monotonic()  # the time-based cadence counts from the start of a save in flight
        self._background = (step, store, directory, time.perf_counter())
        if not self.config.async_save:
            self._note_background_save(wait=True)
        else:
            self.log.info(
                "checkpoint_staged",
                step=step,
                path=str(directory),
                stall_s=round(stall_s, 4),
                waited_s=round(waited_s, 4),
            )
            if store == self.layout.checkpoints:
                self._saved_at = step  # in flight: finish() and stop orders wait for it rather than save again
        return directory

    def _sharded_common(self) -> dict[str, Any]:
        """What a sharded checkpoint's manifest says for every rank."""
        return {
            "global_batch_size": self.global_batch_size,
            "data_position": self.batches,
            "samples": self.samples if self.global_batch_size else None,
            "sharding": self._sharding(),
        }

    def _note_background_save(self, *, wait: bool = False) -> Any:
        """Log a sharded save that ended (waiting for it if `wait`, in the save phase so its timeout applies);
        returns it (worker.sharded's record of it), or None."""
        if self._sharded is None or self._background is None:
            return None
        if wait and self._sharded.in_flight is not None:
            with self.phase(SAVE_PHASE):
                done = self._sharded.wait()
        else:
            done = self._sharded.finished()
        if done is None:
            return None
        step, store, directory, _ = self._background
        self._background = None
        self._saved(
            step, store, directory, done.duration_s, stall_s=round(done.stall_s, 4), background=self.config.async_save
        )
        self._faults.after_save(step)
        return done

    def _wait_for_save_in_flight(self, step: int, started: float) -> float:
        """Before the save of `step`: wait for the one still being written, if any; the seconds waited. A write that
        took longer than the training between two scheduled saves is said once (`save_slower_than_interval`)."""
        previous = self._background if self._sharded is not None and self._sharded.in_flight is not None else None
        begun = time.perf_counter()
        done = self._note_background_save(wait=True)
        if previous is None or done is None:
            return 0.0
        waited_s = time.perf_counter() - begun
        trained_s = max(0.0, started - previous[3])  # from the loop going on after staging it to this save
        if self._on_schedule and not self._said_slow_saves and done.write_s > trained_s:
            self._said_slow_saves = True
            self._say_slower_than_interval(done.write_s, trained_s, step - previous[0], waited_s, step)
        return waited_s

    def _say_slower_than_interval(
        self, write_s: float, interval_s: float, interval_steps: int, waited_s: float, step: int
    ) -> None:
        """The warning, in the log and the heartbeat (the supervisor journals it and `status` shows it)."""
        setting = self._save_interval_setting(write_s, interval_s, interval_steps)
        self.log.warning(
            "save_slower_than_interval",
            step=step,
            write_s=round(write_s, 3),
            interval_s=round(interval_s, 3),
            interval_steps=interval_steps,
            waited_s=round(waited_s, 3),
            setting=setting,
            reason=f"a background write takes {write_s:.2f} s and the loop trains {interval_s:.2f} s "
            f"({interval_steps} steps) between saves: each save waits for the previous one",
        )
        self._heartbeat.slow_saves = {
            "write_s": round(write_s, 3),
            "interval_s": round(interval_s, 3),
            "setting": setting,
        }

    def _save_interval_setting(self, write_s: float, interval_s: float, interval_steps: int) -> str:
        """What to set so that the write fits between two saves: the cadence in steps at the pace seen, or seconds."""
        if self.config.snapshot_steps or self.config.save_checkpoint_steps:
            key = "snapshot_steps" if self.config.snapshot_steps else "save_checkpoint_steps"
            steps = math.ceil(write_s * interval_steps / interval_s) if interval_s > 0 else None
            return f"worker.{key}: {steps} or more" if steps else f"worker.{key}: more steps than {write_s:.1f} s"
        return f"worker.save_checkpoint_interval_s: {math.ceil(write_s)} or more"

    def _sharding(self) -> dict[str, Any]:
        """What the manifest says of how the model was laid out (for people; loading reshards whatever it was)."""
        from worker.sharded import holds_dtensors

        return {"dtensor_params": holds_dtensors(self.model), "world_size": self.world_size}

    def _choose_format(self) -> str:
        """`checkpoint_format`, `auto` decided by the model; a sharded one checks at once that it can work."""
        chosen = self.config.checkpoint_format
        if chosen == "auto":
            from worker.sharded import holds_dtensors

            chosen = "dcp" if holds_dtensors(self.model) else "files"
        if chosen == "dcp":
            self._need_numpy()
        return chosen

    def _need_numpy(self) -> None:
        """Sharded saves and loads across ranks plan through object collectives, which need NumPy: exit 78 without."""
        from worker.sharded import NUMPY_NEEDED, numpy_missing

        if self.world_size > 1 and numpy_missing():
            print(f"trainwarden: worker config error: {NUMPY_NEEDED}", file=sys.stderr)
            leave(EXIT_CONFIG)

    def _rank_state(self) -> dict[str, Any]:
        """Everything of this rank's state but model and optimizer (a sharded save keeps them apart)."""
        return {
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": capture_rng(),
            "data_position": self.batches,
            "data_state": self._data_state_fn() if self._data_state_fn else {},
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "extra_state": {name: obj.state_dict() for name, obj in self.extra_state.items()},
            "anomaly_history": self._guard.detector.state_dict(),
            "feature_history": self._features.state_dict(),
            "samples": self.samples,
            "snapshot_every": 0 if self._schedule is None else self._schedule.agreed,  # `auto`'s, for a relaunch
        }

    def finish(self, *, save: bool = True) -> None:
        """Save the final state (unless saved at this step already, or checkpointing is off or `save` is False),
        mark the rank done and close its event log. Every rank calls it at the same step."""
        if save:
            self.save_final()
        self._note_background_save(wait=True)
        if self._fingerprints is not None and self._fingerprints.steps:  # measured, so a user knows what it costs
            steps, spent = self._fingerprints.steps, self._fingerprints.spent_s + self._guard.fingerprint_s
            self.log.info("fingerprint_cost", steps=steps, per_step_ms=round(spent / steps * 1000, 4))
        self.log.info("rank_finished", step=self.step)
        self._phase = "done"
        self._heartbeat.beat(self.step, "done", force=True)
        self._close()

    def save_final(self) -> None:
        """Save this step unless it is saved already or checkpointing is off (a trainer's callback asks at its last
        step, while the trainer can still save)."""
        if self.step != self._saved_at and self._checkpointing:
            self.save(self.step)

    def __enter__(self) -> Warden:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self._close()

    def _leaving(self) -> None:
        """About to exit on an abort: the heartbeat says so, so a slow interpreter teardown is not taken for a hang."""
        self._heartbeat.beat(self.step, "done", force=True)

    def _unwind(self, error: str, evidence: bool) -> Heartbeat:
        """A peer failed and this process recovers in place (worker.recovery): say so, leave the flight recorder if
        the supervisor may seek the culprit (`evidence`: its collective failed before the supervisor's word), let a
        save in flight end (its collective fails fast, the peer gone), close; the heartbeat says `recovering` once
        the group is gone."""
        self.log.warning("peer_failed", step=self.step, error=error)
        if evidence and self._flight is not None:  # as a rank dying of the failed collective would (20 ms)
            self._flight.dump(empty_too=False)
        if self._sharded is not None and self._sharded.in_flight is not None:
            self._sharded.wait_quietly()
        self._close()
        return self._heartbeat

    def _rerun_with(self, recompute: Callable[[int], Any] | None) -> RerunStep | None:
        """How this step is re-run should it alarm: from the random state it started with (taken at every step's
        start once a loop hands `recompute` over; its first such step cannot be re-run)."""
        if recompute is None or self._fingerprints is None:
            return None
        if not callable(getattr(self.model, "no_sync", None)):  # FSDP2: the fingerprints name a rank, nothing more
            if not self._said_reruns_off:
                self._said_reruns_off = True
                self.log.warning("reruns_off", why=RERUNS_OFF_FSDP)
            return None
        started, self._wants_rerun = self._started, True
        if started is None:
            return None
        recorder = self._fingerprints

        def rerun(
            prints: tuple[Fingerprint, ...], suspects: tuple[int, ...], norm: float, again: Callable[[], None]
        ) -> Rerun:
            with self._features.paused():  # a re-run's activation gradients are not the next step's
                return rerun_step(
                    self.model,
                    functools.partial(self._computing, recompute),
                    originals=prints,
                    suspects=suspects,
                    started=started,
                    take_fingerprint=functools.partial(recorder.take, rerun=True),
                    original_norm=norm,
                    after_backward=again,
                )

        return rerun

    def _computing(self, recompute: Callable[[int], Any], owner: int) -> Any:
        """`recompute(owner)`, the model knowing whose batch it computes (a `poison` fault is the batch's)."""
        self._owner = owner
        try:
            return recompute(owner)
        finally:
            self._owner = self.rank

    def _step_starts(self) -> None:
        """A step's compute starts now (after the last step, a phase, a resume): its random state, for a re-run."""
        self._compute_since = time.perf_counter()
        self._started = capture(everything=False) if self._wants_rerun else None

    def _fingerprint(self, model: Any) -> Recorder | None:
        """With data-parallel peers, each rank's own gradient fingerprint from DDP's hook (worker.fingerprint)."""
        if self.world_size == 1 or not self.config.fingerprints:
            return None
        recorder = Recorder(model, self._faults, lambda: self.step + 1)
        why_not = install(model, recorder, self.world_size)
        if why_not is None:
            return recorder
        if why_not != NOT_DATA_PARALLEL:  # a DDP or FSDP2 model: its user may want to know
            self.log.warning("fingerprints_off", why=why_not)
        return None

    def _close(self) -> None:
        self._detach()
        if self._fingerprints is not None:
            uninstall(self._fingerprints)
        for handle in self._fault_hooks:
            handle.remove()
        self._features.close()
        self._log_stream.close()
        if self._previous_term is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            # A trainer's handler is not put back either: a rank tearing down after a peer died must still die of it.
            _install_handler(signal.SIGTERM, self._previous_term if self._framework_save is None else signal.SIG_DFL)
        if self._flight is not None:
            self._flight.close()
        if self._stacks is not None:
            faulthandler.unregister(STACK_DUMP_SIGNAL)
            _install_handler(STACK_DUMP_SIGNAL, signal.SIG_IGN)  # a dump asked of a leaving rank must not kill it
            self._stacks.close()

    @property
    def _checkpointing(self) -> bool:
        return self.config.save_checkpoint_steps > 0 or self.config.save_checkpoint_interval_s > 0

    def _restore_extra_state(self, state: dict[str, Any], step: int) -> None:
        """Each registered object gets its saved state back; one the checkpoint lacks keeps its own, said once."""
        saved = state.get("extra_state") or {}
        for name, obj in self.extra_state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                self.log.warning(
                    "extra_state_missing",
                    step=step,
                    name=name,
                    reason="the checkpoint has no state for it (saved before it was registered)",
                )
                self._heartbeat.inexact = f"extra_state {name!r} not restored: the checkpoint has no state for it"
        for name in saved.keys() - self.extra_state.keys():
            self.log.warning("extra_state_unused", step=step, name=name, reason="not in this Warden's extra_state")

    def _resume_point(self) -> tuple[CheckpointStore, int] | None:
        """Where to resume: the supervisor's choice, else (plain torchrun) the config's, else the newest complete."""
        named = os.environ.get(ENV_RESUME_STEP)
        if named is not None:  # the supervisor decided
            where = os.environ.get(ENV_RESUME_DIR)
            return (self._store_at(Path(where)) if where else self.layout.checkpoints, int(named)) if named else None
        if self.config.resume_training is False:
            return None
        if isinstance(self.config.resume_training, str):
            step = parse_checkpoint_name(self.config.resume_training)
            return None if step is None else (named_store(self.layout, self.config), step)
        return newest_complete(resume_stores(self.layout, self.config), self.world_size, self.config.prefix)

    def _health(self) -> dict[str, Any]:
        if not self.config.use_checkpoint_health_monitor:
            return {"is_health": 0, "health_reasons": [], "health_monitored": False}
        health = checkpoint_health(
            self.model,
            self.optimizer,
            threshold=self.config.embedding_local_norm_threshold,
            embedding_param=self.config.embedding_param,
        )
        if health["embedding_local_norm"] is not None:
            self.log.info("embedding_local_norm", step=self.step, embedding_local_norm=health["embedding_local_norm"])
        reasons = [*health["health_reasons"], *self._more_health_reasons()]
        return {**health, "is_health": int(bool(reasons)), "health_reasons": reasons, "health_monitored": True}

    def _more_health_reasons(self) -> list[str]:
        """A feature-value fault trained into the model, and whatever the user's `health_check` says."""
        reasons = []
        if self._tainted_at is not None:
            reasons.append(f"feature-value fault at step {self._tainted_at} trained into the model")
        if self._health_check is not None:
            try:
                verdict = self._health_check(self.step)
            except Exception as exc:  # noqa: BLE001 - a broken check must not cost the save; it is not a pass
                verdict = f"raised {exc!r}"
            if verdict:
                reasons.append(f"health_check: {verdict}")
        return reasons

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # A peer crashed or the job is stopping: a save in flight finishes first (the supervisor waits for it).
        if self._phase == SAVE_PHASE:
            self._term_pending = True  # no logging here: the handler may interrupt a write to the same log
        else:
            self._obey_sigterm(frame)

    def _obey_sigterm(self, frame: Any = None) -> None:
        """Act on SIGTERM as the script would have without us: its own handler, or death by the signal; a sharded
        save being written in the background is finished first (the supervisor's save timeout bounds it)."""
        if self._sharded is not None and self._sharded.in_flight is not None:
            self._heartbeat.beat(self.step, SAVE_PHASE, force=True)  # the supervisor waits for a save, not longer
            self._sharded.wait_quietly()
        # A trainer's own handler is not called: Lightning's broadcasts to its peers, which hangs when one is dead.
        previous = self._previous_term if self._framework_save is None else signal.SIG_DFL
        if callable(previous):
            previous(signal.SIGTERM, frame)
        elif previous != signal.SIG_IGN:
            self._close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _fault_fired(self, fault: Any) -> None:
        self.log.warning("fault_injected", kind=fault.kind, step=fault.step)

    def _torn_save(self, tmp: Path) -> None:
        # Leave the half-written temporary file a kill mid-write would leave, then die by SIGKILL.
        os.truncate(tmp, tmp.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def _or_config_error(read: Callable[[], Any]) -> Any:
    """What `read` returns; a bad setting in the environment ends the rank with EXIT_CONFIG (never retried)."""
    try:
        return read()
    except (TypeError, ValueError) as exc:
        print(f"trainwarden: worker config error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _whole_or_none(total: Any) -> int | None:
    """`steps(total)`'s total for the heartbeat; None for an endless loop's `math.inf` or anything odd."""
    try:
        return int(total) if math.isfinite(total) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _stateful(objects: dict[str, Any]) -> dict[str, Any]:
    """`extra_state` checked at once: a name for each object, and state_dict/load_state_dict on each."""
    for name, obj in objects.items():
        if not isinstance(name, str) or not all(
            callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")
        ):
            raise TypeError(
                f"extra_state[{name!r}]: needs a string name and an object with state_dict() and "
                f"load_state_dict(), got {type(obj).__name__}"
            )
    return dict(objects)


def _lowest(value: int, world_size: int, model: Any) -> int:
    """The lowest `value` over all ranks: one tiny all-reduce when there are peers to ask (as `_any_rank`)."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return value
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    lowest = torch.tensor([float(value)], device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return int(lowest.item())


def _any_rank(flag: bool, world_size: int, model: Any) -> bool:
    """Whether `flag` holds on any rank: one tiny all-reduce when there are peers to ask, on the model's device
    (NCCL reduces CUDA tensors only)."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return flag
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) state dict: this rank's own part of a DTensor (its local shard)."""
    import torch

    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    if torch.is_tensor(state):
        local = getattr(state, "_local_tensor", state)
        return int(local.numel() * local.element_size())
    return 0


@functools.cache
def _at_exit_once() -> None:
    """Registered once per process, however many Wardens it makes (one per attempt, recovering in place)."""
    # Python's last collections at exit walk torch's whole object graph (0.8 s of CPU per rank, measured): a rank
    # that leaves, on a stop or an abort, would hold its relaunch up for it. Runs after the handler below.
    atexit.register(gc.freeze)
    atexit.register(_release_process_group)  # a script that never destroys its group must not die of SIGABRT


def _release_process_group() -> None:
    """At interpreter exit: a live gloo/NCCL group can abort the shutdown (see worker.exits.leave)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _install_handler(signum: int, handler: Any) -> Any:
    """Install a signal handler, returning the previous one; None outside the main thread (nothing installed)."""
    try:
        return signal.signal(signum, handler)
    except ValueError:  # signal handlers can only be set from the main thread
        return None


def _register_stack_dump(path: Path, root: Path) -> Any:
    """Dump every thread's Python stack to `path` when the supervisor sends STACK_DUMP_SIGNAL.

    faulthandler writes from the C signal handler, so it works while the main thread is stuck in a collective.
    """
    try:
        stream = os.fdopen(open_append(path, root=root), "a")  # must stay open for the handler
        faulthandler.register(STACK_DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError) as exc:  # no stack dumps is better than no training
        print(f"trainwarden: cannot register the stack dump handler: {exc}", file=sys.stderr)
        return None
    return stream


def _gpu_index(model: Any) -> int | None:
    """The index of the GPU the model's parameters are on (None: not on a GPU), as its verdicts name it."""
    device = next((p.device for p in model.parameters()), None) if hasattr(model, "parameters") else None
    return device.index if device is not None and device.type == "cuda" else None
