"""Dumping PyTorch's flight recorder into the run dir, so the supervisor can name a hang's culprit.

PyTorch records every collective a rank enqueues and completes (with `TORCH_FR_BUFFER_SIZE` > 0, which the
supervisor sets). A dump must run while the main thread waits inside a collective, where no Python signal
handler runs, so a helper thread does it. The request is the stack-dump signal the supervisor already sends:
faulthandler appends this rank's stacks to its dump file from C, and the thread, watching that file's size,
writes the flight recorder next to it. An uncaught exception (a collective that failed: a desync, a peer
that aborted) dumps it too, before the process exits. Nothing here is read back by the rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from worker.files import atomic_write_bytes
from worker.recovery import attempt_started_ns

__all__ = ["FlightRecorderDumps", "flight_record", "this_attempt"]

POLL_S = 0.1  # how often the helper thread looks at the stack dump file's size: one fstat


def flight_record() -> dict[str, Any] | None:
    """This process's flight recorder (every backend's, merged; of this attempt, in a process that recovered in
    place), or None when it records nothing."""
    c10d = getattr(sys.modules.get("torch"), "_C", None)
    c10d = getattr(c10d, "_distributed_c10d", None)
    merged: dict[str, Any] = {"entries": [], "pg_status": {}, "pg_config": {}}
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):  # NCCL keeps its own, with device states
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            part = json.loads(dump(True, False))
        except Exception:  # noqa: BLE001 - a recorder that cannot dump is no reason to fail a rank
            continue
        merged["version"] = part.get("version")
        merged["entries"] += part.get("entries") or []
        merged["pg_status"].update(part.get("pg_status") or {})
        merged["pg_config"].update({k: v for k, v in (part.get("pg_config") or {}).items() if k})
    since = attempt_started_ns()
    if since is not None:
        merged = this_attempt(merged, since)
    return merged if merged["entries"] else None


def this_attempt(record: dict[str, Any], since_ns: int) -> dict[str, Any]:
    """The collectives of the attempt that began at `since_ns` (epoch), each group keyed by its name.

    A process that recovered in place keeps the earlier attempts' collectives in its recorder, under process group
    ids that count every group the process ever made: a peer started later gave those ids to other groups. Group
    names start again from 0 with each attempt's groups, alike on every rank (as ids are in a process that never
    recovered), so the hang analyzer compares the same group across ranks."""
    fresh = [e for e in record["entries"] if isinstance(e, dict) and _created(e) >= since_ns]
    names = {str(e.get("pg_id")): _group_name(e) for e in fresh}
    return {
        **record,
        "entries": [{**e, "pg_id": names[str(e.get("pg_id"))]} for e in fresh],
        "pg_status": {names[k]: v for k, v in record["pg_status"].items() if k in names},
    }


def _created(entry: dict[str, Any]) -> int:
    created = entry.get("time_created_ns")
    return created if type(created) is int else -1


def _group_name(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    return group[0] if isinstance(group, list) and group and isinstance(group[0], str) else str(entry.get("pg_id"))


class FlightRecorderDumps:
    """A daemon thread that writes the flight recorder to `path` each time `stacks` (faulthandler's stream) grows,
    and at an uncaught exception."""

    def __init__(self, stacks: Any, path: Path, root: Path) -> None:
        self._stacks, self._path, self._root = stacks, path, root
        self._seen = os.fstat(stacks.fileno()).st_size
        self._closed = threading.Event()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._on_uncaught
        threading.Thread(target=self._watch, daemon=True, name="trainwarden-flight-recorder").start()

    def dump(self, *, empty_too: bool = True) -> bool:
        """Write the flight recorder now, empty when it records nothing if `empty_too` (asked for one, the supervisor
        then need not wait for it); False when nothing was written."""
        record = flight_record()
        if record is None and not empty_too:
            return False
        with contextlib.suppress(OSError, ValueError):  # a full disk or a planted symlink costs this dump only
            atomic_write_bytes(self._path, json.dumps(record or {"entries": []}).encode(), root=self._root)
            return True
        return False

    def close(self) -> None:
        self._closed.set()
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._previous_hook

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                size = os.fstat(self._stacks.fileno()).st_size
            except (OSError, ValueError):  # the stream was closed: the Warden is gone
                return
            if size > self._seen:  # the supervisor asked for stacks: it wants the flight recorder too
                self._seen = size
                self.dump()

    def _on_uncaught(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            self.dump(empty_too=False)
        self._previous_hook(kind, value, tb)
