"""Stack dumps of hung ranks, collected off the main thread before anything is killed.

Two sources: faulthandler inside each rank (the worker library registers it for STACK_DUMP_SIGNAL; it
dumps every thread even while the main thread is stuck in a C++ collective), and `py-spy dump` from
outside when py-spy is installed (it needs no cooperation, so it also covers scripts without the library).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from supervisor.core import StacksCollected
from supervisor.rank_logs import last_step
from worker.contract import STACK_DUMP_SIGNAL, RunLayout
from worker.files import atomic_write_bytes, open_regular

__all__ = ["StackDumps", "blocked_behind", "collect_stacks", "find_pyspy", "outside_collectives",
           "start_stack_collection"]

PYSPY_TIMEOUT_S = 10.0
FAULTHANDLER_WAIT_S = 2.0
MAX_DUMP_BYTES = 1 << 20  # one dump of every thread is a few KiB; the file is the rank's to write
# Frames of a rank waiting for its peers: inside a collective, or in backward where DDP all-reduces.
_COLLECTIVE_FRAMES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


def find_pyspy() -> str | None:
    """py-spy next to our interpreter (a venv not on PATH) or on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("py-spy", path=search)


def start_stack_collection(
    layout: RunLayout,
    attempt: int,
    pids: dict[int, int],
    faulthandler_ranks: tuple[int, ...],
    post: Callable[[object], None],
) -> None:
    """Collect stacks of `pids` (rank -> leader pid) in a thread; posts StacksCollected when done."""
    args = (layout, attempt, pids, faulthandler_ranks, post)
    threading.Thread(target=_collect, args=args, daemon=True, name=f"stacks-a{attempt}").start()


def _collect(layout: RunLayout, attempt: int, pids: dict[int, int], faulthandler_ranks: tuple[int, ...],
             post: Callable[[object], None]) -> None:
    dumps = StackDumps((), {}, ())
    try:
        dumps = collect_stacks(layout, attempt, pids, faulthandler_ranks)
    finally:
        culprit = outside_collectives(dumps.by_rank)
        post(StacksCollected(attempt, dumps.paths, culprit=culprit, last_steps=dumps.last_steps,
                             blocked=blocked_behind(dumps.by_rank, culprit)))


@dataclass(frozen=True)
class StackDumps:
    """What one collection found: the dump files written, each rank's stack text, and the step each rank logged."""

    paths: tuple[str, ...]
    by_rank: dict[int, str]
    last_steps: tuple[tuple[int, int], ...]


def collect_stacks(layout: RunLayout, attempt: int, pids: dict[int, int],
                   faulthandler_ranks: tuple[int, ...]) -> StackDumps:
    """Dump the stacks of `pids` (rank -> leader pid, on this machine): faulthandler, then py-spy if installed."""
    dumps: dict[str, str] = {}  # path -> the text this collection added
    before = {rank: _size(layout.stack_dump(rank, attempt)) for rank in faulthandler_ranks}
    for rank in faulthandler_ranks:
        _request_dump(pids[rank])
    pyspy = find_pyspy()
    if pyspy is not None:
        for rank, pid in pids.items():
            if text := _pyspy_dump(pyspy, pid, layout.pyspy_dump(rank, attempt), layout.root):
                dumps[str(layout.pyspy_dump(rank, attempt))] = text
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    for rank, size in before.items():
        path = layout.stack_dump(rank, attempt)
        while _size(path) <= size and time.monotonic() < deadline:
            time.sleep(0.05)
        if _size(path) > size:
            dumps[str(path)] = _read_from(path, size)
    by_rank = {rank: "".join(t for p, t in dumps.items() if Path(p).parent.name == f"rank_{rank}") for rank in pids}
    last_steps = tuple((rank, step) for rank in pids if (step := last_step(layout, rank, attempt)) is not None)
    return StackDumps(tuple(sorted(dumps)), by_rank, last_steps)


def blocked_behind(stacks: dict[int, str], culprit: int | None) -> tuple[int, ...]:
    """With a culprit named, the other ranks whose stacks show them inside a collective (waiting for it)."""
    if culprit is None:
        return ()
    return tuple(sorted(rank for rank, text in stacks.items()
                        if rank != culprit and text and any(m in text for m in _COLLECTIVE_FRAMES)))


def outside_collectives(stacks: dict[int, str]) -> int | None:
    """The one rank whose stacks show no collective or backward frame, when all others are inside one.

    In a collective hang every peer waits inside the collective; the rank that is elsewhere is the cause.
    """
    dumped = {rank: text for rank, text in stacks.items() if text}
    if len(dumped) < 2:
        return None
    outside = [rank for rank, text in dumped.items() if not any(m in text for m in _COLLECTIVE_FRAMES)]
    return outside[0] if len(outside) == 1 else None


def _request_dump(pid: int) -> None:
    try:
        os.kill(pid, STACK_DUMP_SIGNAL)
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            os.kill(pid, signal.SIGCONT)  # a frozen rank cannot run its handler; it is about to be killed anyway
    except (ProcessLookupError, psutil.Error):
        pass


def _pyspy_dump(pyspy: str, pid: int, path: Path, root: Path) -> str | None:
    """Write `py-spy dump` of `pid` to `path` (its error, if it fails); the dump when it worked."""
    try:
        result = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                timeout=PYSPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _write(path, f"py-spy dump of pid {pid} failed: {exc}\n", root)
        return None
    failure = f"\n[py-spy exit {result.returncode}] {result.stderr}" if result.returncode else ""
    _write(path, result.stdout + failure, root)
    return result.stdout if result.returncode == 0 else None


def _write(path: Path, text: str, root: Path) -> None:
    with contextlib.suppress(OSError, ValueError):  # a planted symlink or full disk costs this dump only
        atomic_write_bytes(path, text.encode(), root=root)


def _read_from(path: Path, offset: int) -> str:
    """What a rank's faulthandler appended to its dump file past `offset`, at most MAX_DUMP_BYTES."""
    try:
        fd = open_regular(path)
    except OSError:
        return ""
    try:
        return os.pread(fd, MAX_DUMP_BYTES, offset).decode(errors="replace")
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    """The size of a regular file (not followed if a symlink); 0 for anything else."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0
