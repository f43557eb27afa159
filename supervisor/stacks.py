"""Stack dumps of hung ranks, collected off the main thread before anything is killed.

Two sources: faulthandler inside each rank (the worker library registers it for STACK_DUMP_SIGNAL; it
dumps every thread even while the main thread is stuck in a C++ collective), and `py-spy dump` from
outside when py-spy is installed (it needs no cooperation, so it also covers scripts without the library).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from supervisor.core import StacksCollected
from worker.contract import STACK_DUMP_SIGNAL, RunLayout

__all__ = ["find_pyspy", "start_stack_collection"]

PYSPY_TIMEOUT_S = 10.0
FAULTHANDLER_WAIT_S = 2.0


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
    paths: list[str] = []
    try:
        before = {rank: _size(layout.stack_dump(rank, attempt)) for rank in faulthandler_ranks}
        for rank in faulthandler_ranks:
            _request_dump(pids[rank])
        pyspy = find_pyspy()
        if pyspy is not None:
            for rank, pid in pids.items():
                if _pyspy_dump(pyspy, pid, layout.pyspy_dump(rank, attempt)):
                    paths.append(str(layout.pyspy_dump(rank, attempt)))
        deadline = time.monotonic() + FAULTHANDLER_WAIT_S
        for rank, size in before.items():
            path = layout.stack_dump(rank, attempt)
            while _size(path) <= size and time.monotonic() < deadline:
                time.sleep(0.05)
            if _size(path) > size:
                paths.append(str(path))
    finally:
        post(StacksCollected(attempt, tuple(sorted(paths))))


def _request_dump(pid: int) -> None:
    try:
        os.kill(pid, STACK_DUMP_SIGNAL)
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            os.kill(pid, signal.SIGCONT)  # a frozen rank cannot run its handler; it is about to be killed anyway
    except (ProcessLookupError, psutil.Error):
        pass


def _pyspy_dump(pyspy: str, pid: int, path: Path) -> bool:
    """Write `py-spy dump` of `pid` to `path` (its error, if it fails); True when it worked."""
    try:
        result = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                timeout=PYSPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        path.write_text(f"py-spy dump of pid {pid} failed: {exc}\n")
        return False
    failure = f"\n[py-spy exit {result.returncode}] {result.stderr}" if result.returncode else ""
    path.write_text(result.stdout + failure)
    return result.returncode == 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
