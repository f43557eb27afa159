"""Heartbeat files and the stop file: a watchdog observer turns file-system events into hints; reading the
files is the truth."""

from __future__ import annotations

import ctypes
import math
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from supervisor.core import HeartbeatSeen, SlowSaves
from worker.contract import RunLayout
from worker.files import ensure_dir, read_json

__all__ = [
    "HeartbeatFiles",
    "HeartbeatUnreadable",
    "HeartbeatWatcher",
    "HeartbeatsChanged",
    "StopFileChanged",
    "StopFileWatcher",
    "read_heartbeat",
]


@dataclass(frozen=True)
class HeartbeatsChanged:
    """A hint that some ranks' heartbeat files may hold new records: `HeartbeatWatcher.take` says which (one hint
    stands for every write until the main loop takes them, so a flood of beats is one wake-up, not one each)."""


@dataclass(frozen=True)
class StopFileChanged:
    """A hint that the stop file was written, replaced or removed."""


# The kernel is asked for writes only: our own reads would raise open/close events, which would feed back forever.
_WRITES = [FileMovedEvent, FileCreatedEvent, FileModifiedEvent, FileClosedEvent, FileDeletedEvent]


class _Handler(FileSystemEventHandler):
    def __init__(self, targets: dict[str, Callable[[], None]]) -> None:
        self._targets = targets  # path -> what to do when it is written

    def on_any_event(self, event: FileSystemEvent) -> None:
        # Writers rename a temporary file onto the watched name, so the destination path matters.
        target = self._targets.get(str(event.dest_path or event.src_path))
        if target is not None:
            target()


class _Watcher:
    """A watchdog observer thread posting hints for writes to watched paths."""

    def __init__(self) -> None:
        self._observer = Observer()
        self._observer.daemon = True

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        if self._observer.is_alive():
            self._observer.stop()
            self._observer.join(timeout=5)


class HeartbeatWatcher:
    """Posts one HeartbeatsChanged hint for every burst of heartbeat writes; `take` returns the ranks written since
    the last take. inotify is asked for renames into the ranks' directories only (one event per beat), read by one
    thread in batches: watchdog's general pipeline (every event type, move pairing, two thread hand-offs per event)
    cost most of the supervisor's time at hundreds of beats a second (bench/console_overhead.py). Where inotify is
    unavailable the once-a-second look is all there is."""

    BATCH_S = 0.25  # after a wake-up, let more events arrive: one read for many beats (each is dated by its mtime)

    def __init__(self, layout: RunLayout, nproc: int, post: Callable[[object], None]) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._written: set[int] = set()
        self._ranks: dict[int, int] = {}  # watch descriptor -> rank
        self._name = os.fsencode(layout.heartbeat(0).name)  # the rank folders hold other files too
        self._fd = _inotify_init()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # `stop` writes here: the reader leaves its poll at once
        for rank in range(nproc):
            ensure_dir(layout.root, layout.rank_dir(rank))
            if self._fd is not None:
                wd = _libc.inotify_add_watch(self._fd, os.fsencode(layout.rank_dir(rank)), _IN_MOVED_TO)
                if wd >= 0:
                    self._ranks[wd] = rank
        self._thread = threading.Thread(target=self._read_forever, daemon=True, name="heartbeats")

    def start(self) -> None:
        if self._fd is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._wake_r, self._wake_w = None, -1, -1

    def take(self) -> set[int]:
        with self._lock:
            written, self._written = self._written, set()
        return written

    def _read_forever(self) -> None:
        assert self._fd is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            poller.poll()
            if self._stop.wait(self.BATCH_S):
                return
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                return
            ranks = {self._ranks.get(wd) for wd, name in _renamed(data) if name == self._name}
            self._wrote({rank for rank in ranks if rank is not None})

    def _wrote(self, ranks: set[int]) -> None:
        if not ranks:
            return
        with self._lock:
            first = not self._written
            self._written |= ranks
        if first:
            self._post(HeartbeatsChanged())


_IN_MOVED_TO = 0x80
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)
_libc = ctypes.CDLL(None, use_errno=True)


def _inotify_init() -> int | None:
    try:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    except AttributeError:  # not Linux
        return None
    return fd if fd >= 0 else None


def _renamed(data: bytes) -> list[tuple[int, bytes]]:
    """(watch descriptor, file name) of each event in a read of the inotify descriptor."""
    found, offset = [], 0
    while offset + _EVENT.size <= len(data):
        wd, _mask, _cookie, length = _EVENT.unpack_from(data, offset)
        start = offset + _EVENT.size
        found.append((wd, data[start : start + length].rstrip(b"\0")))
        offset = start + length
    return found


class StopFileWatcher(_Watcher):
    """Watches the stop file's directory when it exists (elsewhere the main loop's once-a-second look is all
    there is), posting StopFileChanged hints."""

    def __init__(self, stop_file: Path, post: Callable[[object], None]) -> None:
        super().__init__()
        if stop_file.parent.is_dir():
            stop = {str(stop_file): lambda: post(StopFileChanged())}
            self._observer.schedule(_Handler(stop), str(stop_file.parent), event_filter=_WRITES)


MAX_HEARTBEAT_BYTES = 4096  # a record is about 150 bytes
MAX_AGE_S = 5.0  # a beat read is dated at most this far back (it is read within a second of its writing)
MAX_PHASE_CHARS = 64
MAX_TEXT_CHARS = 400  # a reason a rank gives (`inexact`): a sentence, not a log
MAX_PROGRESS = 2**53  # any number a heartbeat reports: beyond it, it is garbage
MAX_ANOMALY_KINDS = 16  # the worker knows six


class HeartbeatUnreadable(Exception):
    """A heartbeat file exists but does not hold a valid record."""


def read_heartbeat(path: Path, rank: int) -> HeartbeatSeen | None:
    """The record in `rank`'s heartbeat file, None when there is none yet; HeartbeatUnreadable for garbage
    (a FIFO, symlink or directory in its place, strict-JSON errors, wrong types, another rank's record)."""
    try:
        record = read_json(path, MAX_HEARTBEAT_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: {exc}") from None
    if not isinstance(record, dict):
        raise HeartbeatUnreadable(f"{path}: not a JSON object")
    try:
        seen = HeartbeatSeen(
            attempt=_count(record, "attempt"),
            rank=_count(record, "rank"),
            seq=_count(record, "seq"),
            step=_count(record, "step"),
            phase=_phase(record.get("phase")),
            step_time_s=_positive_or_none(record.get("step_time_s")),
            **recovery_fields(record),
            **progress_fields(record),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HeartbeatUnreadable(f"{path}: missing or bad field {exc}") from None
    if seen.rank != rank:  # a record copied from, or forged for, another rank
        raise HeartbeatUnreadable(f"{path}: holds rank {seen.rank}'s heartbeat, not rank {rank}'s")
    return seen


class HeartbeatFiles:
    """Reads ranks' heartbeat files, each only when it changed since its last read (an lstat, where a read would
    open, read and parse): the once-a-second safety net, and an agent's poll, cost next to nothing."""

    def __init__(self, layout: RunLayout) -> None:
        self._layout = layout
        # rank -> (inode, mtime, size) of its file when last read, and why it was unreadable then
        self._read: dict[int, tuple[tuple[int, int, int], HeartbeatUnreadable | None]] = {}

    def read(self, rank: int) -> HeartbeatSeen | None:
        """Its record if the file changed (None if not, or if there is none); HeartbeatUnreadable for garbage,
        again at every look while the garbage stays (without reading it again)."""
        path = self._layout.heartbeat(rank)
        try:
            stat = os.lstat(path)
        except FileNotFoundError:
            self._read.pop(rank, None)
            return None
        except OSError as exc:
            raise HeartbeatUnreadable(f"{path}: {exc.strerror or exc}") from None
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        last = self._read.get(rank)
        if last is not None and last[0] == signature:
            if last[1] is not None:
                raise last[1]
            return None
        try:
            seen = read_heartbeat(path, rank)
        except HeartbeatUnreadable as exc:
            self._read[rank] = (signature, exc)
            raise
        self._read[rank] = (signature, None)
        # How long ago it was written (this machine's clock, as the writer's): it is dated right however late it
        # is read. Bounded: a clock step or a forged mtime must not date it before the attempt or after now.
        age = min(max(0.0, time.time() - stat.st_mtime), MAX_AGE_S)
        return None if seen is None else replace(seen, age_s=round(age, 3))

    def forget(self, ranks: Iterable[int]) -> None:
        """Read these ranks' files at the next look whatever their signature (a new attempt's first beats)."""
        for rank in ranks:
            self._read.pop(rank, None)


def _count(record: dict[str, Any], key: str) -> int:
    value = record[key]
    if type(value) is not int or value < 0:
        raise ValueError(f"{key!r}: {value!r} is not a count")
    return value


def _phase(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PHASE_CHARS or not value.isprintable():
        raise ValueError(f"'phase': {str(value)[:40]!r} is not a phase name")
    return value


def recovery_fields(record: dict[str, Any]) -> dict[str, Any]:
    """What a heartbeat says of recovery in place: whether the rank can, and when its collective failed."""
    return {"in_place": record.get("in_place") is True, "failed_s": _nonnegative_or_none(record.get("failed_s"))}


def progress_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A heartbeat's optional progress fields, each None unless it is a sane number (the file is untrusted)."""
    total = record.get("total_steps")
    return {
        "loss": _finite_or_none(record.get("loss")),
        "compute_s": _positive_or_none(record.get("compute_s")),
        "total_steps": total if _is_count(total) and total > 0 else None,
        "save_s": _nonnegative_or_none(record.get("save_s")),
        "last_save_s": _nonnegative_or_none(record.get("last_save_s")),
        "skipped": record.get("skipped") if _is_count(record.get("skipped")) else None,
        "anomalies": _anomaly_counts(record.get("anomalies")),
        "inexact": _text_or_none(record.get("inexact")),
        "slow_saves": _slow_saves(record.get("slow_saves")),
    }


def _slow_saves(value: object) -> SlowSaves | None:
    """A rank's word that its background writes outlast its save interval: two sane durations and one line."""
    if not isinstance(value, dict):
        return None
    write_s, interval_s = _nonnegative_or_none(value.get("write_s")), _nonnegative_or_none(value.get("interval_s"))
    setting = _text_or_none(value.get("setting"))
    if write_s is None or interval_s is None or setting is None:
        return None
    return SlowSaves(write_s, interval_s, setting)


def _text_or_none(value: object) -> str | None:
    """One printable line of at most MAX_TEXT_CHARS (a rank's words, shown to people as they are)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_TEXT_CHARS and value.isprintable():
        return value
    return None


def _anomaly_counts(value: object) -> tuple[tuple[str, int], ...] | None:
    """(kind, count) pairs from a mapping (the file) or a list of pairs (an agent's forward); None for garbage."""
    pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
    if pairs is None:
        return None
    try:
        counts = tuple((kind, count) for kind, count in pairs)
    except (TypeError, ValueError):
        return None
    sane = len(counts) <= MAX_ANOMALY_KINDS and all(
        isinstance(kind, str) and 0 < len(kind) <= MAX_PHASE_CHARS and kind.isprintable() and _is_count(count)
        for kind, count in counts
    )
    return tuple(sorted(counts)) if sane else None


def _is_count(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= MAX_PROGRESS


def _nonnegative_or_none(value: object) -> float | None:
    number = _finite_or_none(value)
    return number if number is not None and number >= 0 else None


def _finite_or_none(value: object) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(value) and abs(value) <= MAX_PROGRESS else None


def _positive_or_none(value: object) -> float | None:
    number = _finite_or_none(value)
    return number if number is not None and number > 0 else None
