"""Per-rank heartbeat file: cheap, atomic, throttled, and never raises into the training loop."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from worker.files import atomic_write_json

__all__ = ["Heartbeat"]


class Heartbeat:
    """Writes `{"seq", "step", "phase", ...}` to one file, at most once per `interval_s` per phase.

    Besides, for people and the supervisor's observers: the last step's `loss`, the smoothed `compute_s` (a step's
    time before it waits for peers), the loop's `total_steps`, the `save_s` spent in checkpoint saves so far and the
    newest one's `last_save_s`, the batches `skipped` and the `anomalies` this rank saw, by kind, why its resume
    is not exact (`inexact`) once it knows, `slow_saves` once its background writes outlast its save interval, and
    with the memory tier on, the bytes of its snapshots there (`memory_bytes`) and the newest one's `memory_step`."""

    def __init__(
        self, path: Path, *, root: Path, rank: int, attempt: int, interval_s: float, in_place: bool = False
    ) -> None:
        self.path = path
        self._root = root  # the run dir: no symlink below it is followed
        self.interval_s = interval_s
        # in_place: the rank runs its training function through worker.run, so it can recover in place.
        self._static = {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            **({"in_place": True} if in_place else {}),
        }
        self.last_step = 0  # the step of the newest beat
        self._seq = 0
        self._last_write = float("-inf")
        self._phase = ""
        self._failures = 0
        self._step_time_s: float | None = None
        self._compute_s: float | None = None
        self._loss: float | None = None
        self.total_steps: int | None = None  # `warden.steps(total)`'s total
        self.save_s = 0.0  # seconds spent in checkpoint saves by this process
        self.last_save_s: float | None = None  # the newest save's duration
        self.skipped = 0  # batches this process skipped (the same on every rank: they agree)
        self.anomalies: dict[str, int] = {}  # what this rank itself saw, by kind (non_finite, global_norm_spike, ...)
        self.inexact: str | None = None  # why this process's resume is not exact, once it knows (worker.verify)
        self.slow_saves: dict[str, float | str] | None = None  # {write_s, interval_s, setting}: writes outlast it
        self.memory_bytes: int | None = None  # bytes of this rank's snapshots in the memory tier (both slots)
        self.memory_step: int | None = None  # the newest complete snapshot in memory

    def beat(
        self,
        step: int,
        phase: str,
        *,
        force: bool = False,
        step_time_s: float | None = None,
        compute_s: float | None = None,
        loss: float | None = None,
        failed_s: float | None = None,
    ) -> None:
        """Record progress; writes only when the interval has passed, the phase changed, or forced.

        `step_time_s` (the last step's duration) is smoothed, so the supervisor can tell how far ranks get
        in a given time (it picks the step a stop order names from it); so is `compute_s`, the part of it up to
        `guard_step`, before any wait for peers there (a rank slower than its peers shows a larger one). `loss` is kept
        until the next one (a non-finite one is written as null). `failed_s`, recovering in place: the seconds since
        the collective this rank unwound from failed (its own clock), so the supervisor can tell whose failed first."""
        self.last_step = step
        if step_time_s is not None:
            self._step_time_s = _smoothed(self._step_time_s, step_time_s)
        if compute_s is not None:
            self._compute_s = _smoothed(self._compute_s, compute_s)
        if loss is not None:
            self._loss = loss if math.isfinite(loss) else None
        now = time.monotonic()
        if not force and phase == self._phase and now - self._last_write < self.interval_s:
            return
        self._seq += 1
        self._phase = phase
        self._last_write = now
        record = {
            **self._static,
            "seq": self._seq,
            "step": step,
            "phase": phase,
            "time": time.time(),
            "step_time_s": self._step_time_s,
            "compute_s": self._compute_s,
            "loss": self._loss,
            "total_steps": self.total_steps,
            "save_s": round(self.save_s, 6),
            "last_save_s": self.last_save_s,
            "skipped": self.skipped,
            "anomalies": self.anomalies,
            **({"failed_s": round(failed_s, 6)} if failed_s is not None else {}),
            **({"inexact": self.inexact} if self.inexact else {}),
            **({"slow_saves": self.slow_saves} if self.slow_saves else {}),
            **({"memory_bytes": self.memory_bytes, "memory_step": self.memory_step} if self.memory_step else {}),
        }
        try:
            # No fsync: a heartbeat only has to be whole for readers, not survive a power cut.
            atomic_write_json(self.path, record, root=self._root, durable=False)
        except (OSError, ValueError) as exc:  # a full or flaky disk, or a planted symlink, must not stop training
            self._failures += 1
            if self._failures == 1 or self._failures % 1000 == 0:
                print(f"trainwarden: heartbeat write failed ({self._failures}x): {exc}", file=sys.stderr)


def _smoothed(previous: float | None, value: float) -> float:
    return value if previous is None else 0.8 * previous + 0.2 * value
