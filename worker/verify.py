"""Is this resume exact? Two checks, said loudly (`resume_inexact`) rather than found out weeks later.

- State the loop uses but the checkpoint does not hold: an enabled GradScaler that is not in `extra_state` (its
  loss scale, grown over thousands of steps, would restart at its initial value: other steps overflow and are
  skipped, and the run drifts from the one it resumes). Found after a process's first step by walking the garbage
  collector's objects (30 ms with a small model and torch loaded; once per process).
- `worker.verify_resume: N`, a replay check for test runs: after each save of step S, the losses of the next N
  batches are kept in the rank's `trajectory.json`; a run resumed from S compares its first N losses with them,
  bit for bit. One float per batch for N batches after a save, and one small file write when they are in: nothing
  a step would notice. A difference names the first batch that differs.
"""

from __future__ import annotations

import gc
import math
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from worker.files import atomic_write_json, read_json

__all__ = ["TRAJECTORIES_KEPT", "Trajectory", "unregistered_scalers"]

TRAJECTORIES_KEPT = 4  # the newest saves' trajectories: a resume is from one of the newest checkpoints
MAX_TRAJECTORY_BYTES = 1 << 20
_GRAD_SCALER_MODULE = "torch.amp.grad_scaler"


def unregistered_scalers(registered: Iterable[Any]) -> int:
    """How many enabled GradScalers this process holds that are not among `registered` (extra_state's objects)."""
    module = sys.modules.get(_GRAD_SCALER_MODULE)
    if module is None:  # torch is not loaded here at all (import torch loads it)
        return 0
    known = {id(obj) for obj in registered}

    def count() -> int:
        scalers = (o for o in gc.get_objects() if issubclass(type(o), module.GradScaler))  # type(): no __class__ hook
        return sum(1 for scaler in scalers if id(scaler) not in known and scaler.is_enabled())

    if not count():
        return 0
    gc.collect()  # one left unreachable in a cycle is no scaler in use (a quarter of a second with torch loaded)
    return count()


class Trajectory:
    """The losses of the `steps` batches after each save, kept for the check of a resume from it."""

    def __init__(self, path: Path, *, root: Path, steps: int) -> None:
        self.path, self._root, self.steps = path, root, steps
        self._recording: dict[int, list[float | None]] = {}  # save step -> losses so far
        self._expected: list[float | None] = []  # the losses after the step this process resumed from
        self._resumed_at: int | None = None
        self._seen: list[float | None] = []

    def resumed(self, step: int) -> str | None:
        """This process resumed from `step`: the check to come; a reason when there is nothing to check against."""
        try:
            kept = _kept(read_json(self.path, MAX_TRAJECTORY_BYTES))
        except FileNotFoundError:
            kept = {}
        except (OSError, ValueError) as exc:  # refused too (a symlink, a FIFO, too large)
            return f"unreadable {self.path.name}: {exc}"
        self._expected, self._resumed_at, self._seen = kept.get(step, []), step, []
        return None if self._expected else f"no trajectory recorded after step {step}"

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is written: record the batches after it."""
        self._recording[step] = []

    def batch_done(self, loss: float | None) -> tuple[int, float | None, float | None] | bool | None:
        """Record this batch's loss; for a resumed process, compare it: (batch after the resume, now, before) at the
        first difference, True once every recorded loss matched, else None."""
        loss = None if loss is None else float(loss)
        for losses in self._recording.values():
            if len(losses) < self.steps:
                losses.append(loss)
        if any(len(losses) == self.steps for losses in self._recording.values()):
            self._write()
        return self._compare(loss)

    def _compare(self, loss: float | None) -> tuple[int, float | None, float | None] | bool | None:
        if self._resumed_at is None or len(self._seen) >= len(self._expected):
            return None
        index = len(self._seen)
        self._seen.append(loss)
        before = self._expected[index]
        if not _same(loss, before):
            self._expected = self._seen  # said once
            return index + 1, loss, before
        return True if len(self._seen) == len(self._expected) else None

    def _write(self) -> None:
        """The newest complete trajectories, with those already on disk, atomically."""
        done = {step: losses for step, losses in self._recording.items() if len(losses) == self.steps}
        for step in done:
            del self._recording[step]
        try:
            kept = _kept(read_json(self.path, MAX_TRAJECTORY_BYTES))
        except (OSError, ValueError):
            kept = {}
        kept.update(done)
        newest = sorted(kept)[-TRAJECTORIES_KEPT:]
        record = {"steps": self.steps, "after": {str(step): [_encode(x) for x in kept[step]] for step in newest}}
        try:
            atomic_write_json(self.path, record, root=self._root, durable=False)  # a check, not a checkpoint
        except (OSError, ValueError) as exc:  # a check must never stop training
            print(f"trainwarden: {self.path.name} not written: {exc}", file=sys.stderr)


def _kept(raw: Any) -> dict[int, list[float | None]]:
    """The trajectories of a trajectory file, anything malformed dropped (the run dir is not trusted)."""
    after = raw.get("after") if isinstance(raw, Mapping) else None
    if not isinstance(after, Mapping):
        return {}
    kept: dict[int, list[float | None]] = {}
    for step, losses in after.items():
        if isinstance(step, str) and step.isdigit() and len(step) < 19 and isinstance(losses, list):
            decoded = [_decode(x) for x in losses]
            if all(x is not False for x in decoded):
                kept[int(step)] = [x for x in decoded if x is not False]
    return kept


def _encode(loss: float | None) -> str | None:
    """A float as its exact bits (hex), so JSON keeps NaN and every last bit."""
    return None if loss is None else struct.pack(">d", loss).hex()


def _decode(value: Any) -> float | None | bool:
    """The float `_encode` wrote; False for anything else."""
    if value is None:
        return None
    if isinstance(value, str) and len(value) == 16:
        try:
            return struct.unpack(">d", bytes.fromhex(value))[0]
        except ValueError:
            return False
    return False


def _same(a: float | None, b: float | None) -> bool:
    """Bit for bit (NaN equals NaN of the same bits)."""
    if a is None or b is None:
        return a is b
    return struct.pack(">d", a) == struct.pack(">d", b) or (math.isnan(a) and math.isnan(b))
