"""Atomic per-rank checkpoints: model, optimizer, scheduler, every RNG state and the data position."""

from __future__ import annotations

import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.contract import RunLayout, atomic_write_json, fsync_dir, unlink_quietly

__all__ = ["capture_rng", "load_checkpoint", "restore_rng", "save_checkpoint"]

FORMAT_VERSION = 1


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may draw from: Python, torch CPU/CUDA, and NumPy if loaded."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only if the script uses it; never import it ourselves
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states captured by `capture_rng`."""
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def save_checkpoint(
    layout: RunLayout,
    *,
    rank: int,
    step: int,
    prefix: str,
    payload: dict[str, Any],
    before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Write this rank's checkpoint of `step` atomically, then its `meta.json` (seed 001)."""
    import torch

    path = layout.checkpoint_file(rank, step, prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, "step": step, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)
    meta = {"last_epoch": payload.get("epoch", 0), "last_step": step, "last_ckpt_file": path.name}
    atomic_write_json(layout.meta_file(rank), meta)
    return path


def load_checkpoint(layout: RunLayout, *, rank: int, step: int, prefix: str) -> dict[str, Any]:
    """Load this rank's checkpoint of `step` (our own file, so full unpickling is allowed)."""
    import torch

    return torch.load(layout.checkpoint_file(rank, step, prefix), map_location="cpu", weights_only=False)
