"""The batches a re-run judged the data's (worker.rerun), kept in the rank's folder of the run dir: a run resumed from
before one of them skips it again, without re-running it and without a new verdict (Megatron-LM builds its list of
iterations to skip from its tracker file alike). Every rank keeps its own copy of the same list: a relaunched rank
reads the one its predecessor wrote, and the step guard's all-reduce makes a hit on any rank a skip on all.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worker.files import atomic_write_json, read_json

__all__ = ["MAX_ENTRIES", "SkipList"]

MAX_SKIP_LIST_BYTES = 1 << 20  # the run dir is not trusted: read with a cap
MAX_ENTRIES = 10_000  # a run that judges more batches the data's has a data problem, not a list problem


class SkipList:
    """The batch indices to skip, read once at the start, added to as verdicts come."""

    def __init__(self, path: Path, *, root: Path) -> None:
        self.path, self._root = path, root
        self._entries = _read(path)

    def __contains__(self, batch: int) -> bool:
        return batch in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, batch: int, *, step: int, ranks: list[int | None]) -> None:
        """Record `batch` (trained at `step`; the data of `ranks`, None: the whole step's); a write that fails is said,
        never raised into the loop."""
        if batch in self._entries or len(self._entries) >= MAX_ENTRIES:
            return
        self._entries[batch] = {"batch": batch, "step": step, "ranks": ranks}
        record = {"batches": [self._entries[b] for b in sorted(self._entries)]}
        try:
            atomic_write_json(self.path, record, root=self._root)
        except (OSError, ValueError) as exc:
            print(f"trainwarden: {self.path.name} not written: {exc}", file=sys.stderr)


def _read(path: Path) -> dict[int, dict[str, Any]]:
    """The entries of a skip-list file; anything malformed dropped; none if it is missing or unreadable."""
    try:
        raw = read_json(path, MAX_SKIP_LIST_BYTES)
    except (OSError, ValueError):
        return {}
    listed = raw.get("batches") if isinstance(raw, Mapping) else None
    entries: dict[int, dict[str, Any]] = {}
    for entry in listed if isinstance(listed, list) else []:
        batch = entry.get("batch") if isinstance(entry, Mapping) else None
        if type(batch) is int and batch >= 0 and len(entries) < MAX_ENTRIES:
            step, ranks = entry.get("step"), entry.get("ranks")
            entries[batch] = {"batch": batch, "step": step if type(step) is int else None, "ranks": _ranks(ranks)}
    return entries


def _ranks(raw: Any) -> list[int | None]:
    return [r for r in raw if r is None or type(r) is int][:64] if isinstance(raw, list) else []
