"""What tests need to read and forge checkpoint files: a weights-only load, a bitwise comparison, a crafted pickle."""

from __future__ import annotations

import os
import shlex
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from worker.checkpoint import read_checkpoint_file

__all__ = [
    "CRAFTED_REFUSAL",
    "assert_bitwise_equal",
    "bitwise_difference",
    "bitwise_equal",
    "load_saved",
    "write_crafted",
]

# Why the library refuses `write_crafted`'s file, in torch 2.13's words (pinned in .ci/run).
CRAFTED_REFUSAL = (
    "not tensors and plain data only (weights_only load): "
    "Trying to load unsupported GLOBAL posix.system whose module posix is blocked."
)


def load_saved(path: Path) -> dict[str, Any]:
    """A checkpoint file's contents, loaded as the library loads them: tensors and plain data only (a memory
    snapshot's copy on disk is in worker.flat's layout)."""
    return read_checkpoint_file(path)


def bitwise_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where two nested values differ (None: nowhere): tensors and ndarrays by bytes, floats by bits (NaN-safe),
    containers by type and contents, everything else by ==."""
    if type(a) is not type(b):
        return f"type differs at {where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
        return None if same else f"tensor differs at {where}"
    if _is_ndarray(a):
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return None if same else f"ndarray differs at {where}"
    if isinstance(a, float):  # NumPy's cached Gaussian, a learning rate: bit for bit, NaN included
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"float differs at {where}: {a!r} != {b!r}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"keys differ at {where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        return next((d for k in a if (d := bitwise_difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"length differs at {where}: {len(a)} != {len(b)}"
        pairs = enumerate(zip(a, b, strict=True))
        return next((d for i, (x, y) in pairs if (d := bitwise_difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"differs at {where}: {a!r} != {b!r}"


def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two nested values (state dicts, RNG states) hold the same structure, values and bytes."""
    return bitwise_difference(a, b) is None


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Fail naming the first place where `a` and `b` differ."""
    difference = bitwise_difference(a, b, where)
    assert difference is None, difference


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _is_ndarray(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # never imported here: a test without NumPy has no ndarrays
    return numpy is not None and isinstance(value, numpy.ndarray)


class _TouchesMarker:
    """Unpickled by full unpickling, this runs `touch MARKER` (what an attacker's payload would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def write_crafted(path: Path, marker: Path) -> None:
    """Replace `path` with a real torch.save file that looks like a checkpoint but creates `marker` when unpickled."""
    torch.save({"format_version": 2, "step": 0, "model": {}, "payload": _TouchesMarker(marker)}, path)
