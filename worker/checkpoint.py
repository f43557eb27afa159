"""Atomic per-rank checkpoints: model, optimizer, scheduler, every RNG state and the data position."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.contract import CheckpointStore, atomic_write_json, fsync_dir, unlink_quietly

__all__ = [
    "HashingWriter",
    "capture_rng",
    "checkpoint_health",
    "clear_slot",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
]

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


class HashingWriter:
    """A write-only file wrapper that checksums (CRC-32) and counts what passes through it.

    CRC-32 catches truncation and flipped bytes at ~5 GB/s; blake2b (~1 GB/s) made saves 2.5x slower.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        self._crc = zlib.crc32(data, self._crc)
        self.size += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


def checkpoint_health(model: Any, optimizer: Any, *, threshold: float, embedding_param: str | None) -> dict[str, Any]:
    """This rank's part of a checkpoint judged as seed 000 does; `is_health` 0 means healthy.

    Unhealthy: the embedding's local gradient norm above `threshold`, or any NaN/Inf in parameters or
    optimizer state. The embedding is `embedding_param` or else the first `nn.Embedding`'s weight.
    """
    import torch

    reasons = []
    embedding = _embedding_weight(model, embedding_param)
    norm = None
    if embedding is not None and embedding.grad is not None:
        norm = float(embedding.grad.detach().norm())
        if not norm <= threshold:  # NaN counts too
            reasons.append(f"embedding_local_norm {norm:.6g} above {threshold:g}")
    if any(not bool(torch.isfinite(p.detach()).all()) for p in model.parameters()):
        reasons.append("non-finite parameter")
    state_tensors = (t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in state_tensors):
        reasons.append("non-finite optimizer state")
    return {"is_health": int(bool(reasons)), "health_reasons": reasons, "embedding_local_norm": norm}


def _embedding_weight(model: Any, name: str | None) -> Any:
    import torch

    if name is not None:
        return dict(model.named_parameters()).get(name)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return module.weight
    return None


def save_checkpoint(
    store: CheckpointStore,
    *,
    rank: int,
    step: int,
    prefix: str,
    payload: dict[str, Any],
    health: dict[str, Any],
    before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Write this rank's checkpoint of `step` atomically, then its completion record, then `meta.json`.

    The completion record (size, checksum, health) is written last: without it the file does not count.
    """
    import torch

    path = store.file(rank, step, prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = HashingWriter(f)  # checksummed while written: a big save is never read back
            torch.save({"format_version": FORMAT_VERSION, "step": step, **payload}, hashing)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)
    record = {"step": step, "file": path.name, "size": hashing.size, "crc32": hashing.hexdigest(), **health}
    atomic_write_json(store.record(rank, step, prefix), record)
    meta = {"last_epoch": 0, "last_step": step, "last_ckpt_file": path.name}  # seed 001; epochs are not tracked
    atomic_write_json(store.meta(rank), meta)
    return path


def load_checkpoint(store: CheckpointStore, *, rank: int, step: int, prefix: str) -> dict[str, Any]:
    """Load this rank's checkpoint of `step` (written by trainwarden, so full unpickling is allowed)."""
    import torch

    return torch.load(store.file(rank, step, prefix), map_location="cpu", weights_only=False)


def clear_slot(store: CheckpointStore, rank: int) -> None:
    """Empty this rank's part of a snapshot slot before reuse: records first, so a kill leaves junk, not lies."""
    try:
        names = sorted(os.listdir(store.rank_dir(rank)), key=lambda name: not name.endswith(".json"))
    except FileNotFoundError:
        return
    for name in names:
        unlink_quietly(store.rank_dir(rank) / name)
