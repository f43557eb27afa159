"""Atomic per-rank checkpoints: model, optimizer, scheduler, every RNG state and the data position."""

from __future__ import annotations

import io
import os
import pickle
import random
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker import flat
from worker.files import Refused, atomic_write, atomic_write_json, open_regular, unlink_quietly
from worker.store import CheckpointStore

__all__ = [
    "CheckpointRefused",
    "HashingWriter",
    "capture_rng",
    "checkpoint_health",
    "clear_slot",
    "load_checkpoint",
    "read_checkpoint_file",
    "restore_rng",
    "save_checkpoint",
]

# 2: NumPy's RNG state as plain types and a tensor, loadable with weights_only; 3: Python's RNG words as a tensor
FORMAT_VERSION = 3


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may draw from: Python, torch CPU/CUDA, and NumPy if loaded.

    All of it plain types and tensors, so that `torch.load(weights_only=True)` reads it back.
    """
    import torch

    version, words, gauss = random.getstate()
    # Python's 625 words as one tensor: as a tuple, each int costs the pickler a call (a third of a small save)
    python = {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss}
    state: dict[str, Any] = {"python": python, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # a list of uint8 tensors, one per device
    if "numpy" in sys.modules:  # only if the script uses it; never import it ourselves
        state["numpy"] = _numpy_state(sys.modules["numpy"])
    return state


def _numpy_state(numpy: Any) -> dict[str, Any]:
    """NumPy's global (legacy) RNG state without ndarrays: weights_only refuses those."""
    import torch

    name, keys, pos, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "keys": torch.tensor(keys.tolist(), dtype=torch.int64),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def restore_rng(state: dict[str, Any]) -> dict[str, str]:
    """Put back the RNG states captured by `capture_rng`; returns the parts it could not restore, with why."""
    import torch

    python = state["python"]
    if isinstance(python, dict):  # format 3; earlier ones kept random.getstate() as it is
        python = (python["version"], tuple(torch.as_tensor(python["words"]).tolist()), python["gauss"])
    random.setstate(python)
    torch.set_rng_state(state["torch"])
    skipped: dict[str, str] = {}
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            skipped["cuda"] = (
                f"CUDA is not available in this process, so nothing here draws from a CUDA generator; "
                f"the {len(state['cuda'])} saved CUDA generator state(s) are left unused"
            )
    if "numpy" in state:
        try:
            import numpy
        except ImportError as exc:  # then no code in this process can draw from NumPy's RNG either
            skipped["numpy"] = (
                f"numpy cannot be imported in this process ({exc}), so nothing here can draw from "
                "its RNG; the saved NumPy RNG state is left unused"
            )
        else:
            numpy.random.set_state(_numpy_tuple(numpy, state["numpy"]))
    return skipped


def _numpy_tuple(numpy: Any, saved: Any) -> tuple[Any, ...]:
    """What `numpy.random.set_state` takes, from `_numpy_state`'s dict (or a format-1 checkpoint's tuple)."""
    import torch

    if isinstance(saved, tuple):  # format 1 stored get_state() as is (loadable only with weights_only off)
        return saved
    keys = numpy.asarray(torch.as_tensor(saved["keys"]).tolist(), dtype=numpy.uint32)
    return saved["bit_generator"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]


class CheckpointRefused(Exception):
    """A checkpoint file that must not or cannot be loaded: more than tensors and plain data (a crafted pickle
    can run code), not a regular file, or not a file torch can read at all."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} refused: {reason}")
        self.path = path
        self.reason = reason


class HashingWriter:
    """A write-only file wrapper that checksums (CRC-32) and counts what passes through it.

    CRC-32 catches truncation and flipped bytes at ~5 GB/s; blake2b (~1 GB/s) made saves 2.5x slower.
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        self._crc = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._crc = zlib.crc32(data, self._crc)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

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
    in_memory: bool = False,
) -> Path:
    """Write this rank's checkpoint of `step` atomically, then its completion record, then `meta.json`.

    The completion record (size, checksum, health, and the payload's `world_size`, which the supervisor reads
    without torch) is written last: without it the file does not count. `in_memory`: the store is in host memory
    (worker.memory): serialized whole first, in worker.flat's layout (read back without unpickling in a few ms at a
    recovery) or, for what that cannot hold, torch.save's into a buffer (several times faster than through a
    file object's many small writes); written in one piece, no fsync (tmpfs has no disk to reach).
    """
    import torch

    path = store.file(rank, step, prefix)
    hashing = HashingWriter(None)
    content = {"format_version": FORMAT_VERSION, "step": step, **payload}

    def write(f: Any) -> None:
        hashing.file = f  # checksummed while written: a big save is never read back
        if in_memory and (chunks := flat.encode(content)) is not None:  # read back at once in a recovery
            for chunk in chunks:
                hashing.write(chunk)
        elif in_memory:
            buffer = io.BytesIO()
            torch.save(content, buffer)
            hashing.write(buffer.getbuffer())
        else:  # streamed: a disk save of a big model must not hold a second copy of it in memory
            # torch.save writes to any object with write() and flush(); its annotation says IO[bytes]
            torch.save(content, hashing)  # type: ignore[arg-type]

    durable = not in_memory
    atomic_write(path, write, root=store.write_root, before_rename=before_rename, durable=durable)
    world = {"world_size": payload["world_size"]} if "world_size" in payload else {}
    record = {"step": step, "file": path.name, "size": hashing.size, "crc32": hashing.hexdigest(), **world, **health}
    atomic_write_json(store.record(rank, step, prefix), record, root=store.write_root, durable=durable)
    meta = {"last_epoch": 0, "last_step": step, "last_ckpt_file": path.name}  # seed 001; epochs are not tracked
    atomic_write_json(store.meta(rank), meta, root=store.write_root, durable=durable)
    return path


def load_checkpoint(
    store: CheckpointStore, *, rank: int, step: int, prefix: str, weights_only: bool = True
) -> dict[str, Any]:
    """Load this rank's checkpoint of `step`: tensors and plain data only unless `weights_only` is False.

    CheckpointRefused names the file when it is a symlink or special file, holds anything else, or cannot be
    read at all.
    """
    return read_checkpoint_file(store.file(rank, step, prefix), weights_only=weights_only)


def read_checkpoint_file(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """A checkpoint file's contents, in either layout it is written in: torch.save's, or worker.flat's (a memory
    snapshot, and its copy on disk); CheckpointRefused as `load_checkpoint` says."""
    import torch

    try:
        fd = open_regular(path)
    except Refused as exc:
        raise CheckpointRefused(path, exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        if flat.is_flat(os.pread(fd, len(flat.MAGIC), 0)):
            return _load_flat(f, path)
        try:
            return torch.load(f, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            raise CheckpointRefused(path, _why_unpickling_failed(exc, weights_only)) from None
        except Exception as exc:  # noqa: BLE001 - not a checkpoint torch can read (empty, not a zip): never retry it
            raise CheckpointRefused(path, f"cannot be read: {type(exc).__name__}: {exc}") from None


def _load_flat(f: Any, path: Path) -> dict[str, Any]:
    """A snapshot in worker.flat's layout (nothing in it is unpickled), read whole."""
    buffer = bytearray(os.fstat(f.fileno()).st_size)
    if f.readinto(buffer) != len(buffer):
        raise CheckpointRefused(path, "cannot be read: it changed while it was read")
    try:
        content = flat.decode(buffer)
    except ValueError as exc:
        raise CheckpointRefused(path, f"cannot be read: {exc}") from None
    if not isinstance(content, dict):
        raise CheckpointRefused(path, "cannot be read: it holds no checkpoint")
    return content


def _why_unpickling_failed(exc: pickle.UnpicklingError, weights_only: bool) -> str:
    """torch's own words on what it refused (the unsupported global, say), without its general advice."""
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line for line in map(str.strip, str(exc).splitlines()) if line and not line.startswith(advice)]
    detail = "; ".join(lines) or str(exc) or type(exc).__name__
    return f"not tensors and plain data only (weights_only load): {detail}" if weights_only else detail


def clear_slot(store: CheckpointStore, rank: int, prefix: str) -> None:
    """Empty this rank's part of a snapshot slot before reuse: records first, so a kill leaves junk, not lies.

    Only our own files go (checkpoints, records, meta.json of this prefix and rank); anything else is left."""
    try:
        names = os.listdir(store.rank_dir(rank))
    except (FileNotFoundError, NotADirectoryError):
        return
    ours = sorted((n for n in names if store.owns(n, rank, prefix)), key=lambda name: not name.endswith(".json"))
    for name in ours:
        unlink_quietly(store.rank_dir(rank) / name)
