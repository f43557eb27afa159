"""The supervisor's stop order, read by every rank at the end of each step: one `os.stat` unless it changed."""

from __future__ import annotations

import os
from pathlib import Path

from worker.contract import StopOrder
from worker.files import read_json

__all__ = ["StopOrders"]


class StopOrders:
    """Polls the stop-order file; the file is replaced atomically, so a new inode or mtime means a new order."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._seen: tuple[int, int] | None = None
        self._order: StopOrder | None = None

    def poll(self) -> StopOrder | None:
        """The order in force now, or None."""
        try:
            stat = os.stat(self._path)
        except OSError:  # no order (or no run dir yet)
            self._seen = self._order = None
            return None
        key = (stat.st_ino, stat.st_mtime_ns)
        if key != self._seen:
            self._seen = key
            try:
                self._order = StopOrder.from_json(read_json(self._path))
            except (OSError, KeyError, TypeError, ValueError):  # not ours to judge: the supervisor writes it whole
                self._order = None
        return self._order
