"""Whole process trees: ranks die with the supervisor, orphans come back to it, and nothing is left behind.

The supervisor makes itself a child subreaper, so a grandchild whose rank died is re-parented to the
supervisor instead of init: "everything of this run" is then simply "every descendant of the supervisor".
The pids (with start times, so a reused pid is never touched) are recorded in the run dir, so a
supervisor restarted after a SIGKILL can end what its predecessor left; it kills only processes that
also carry this run dir in their environment, so a forged record cannot aim it at anything else.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable
from typing import Any

import psutil

from worker.contract import ENV_RUN_DIR, RunLayout
from worker.files import atomic_write_json, read_json

__all__ = [
    "become_subreaper",
    "descendants",
    "is_subreaper",
    "die_with_parent",
    "kill_predecessor_leftovers",
    "record_pids",
    "reap_orphans",
    "sigkill",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
# Resolved once in the parent: the preexec hook runs between fork and exec and must do next to nothing.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """preexec_fn for ranks: SIGKILL this process when the supervisor dies, even by SIGKILL."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux 3.4+); False where the kernel refuses."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def is_subreaper() -> bool:
    """This process adopts orphaned descendants (it made itself a subreaper)."""
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 1


def descendants() -> list[psutil.Process]:
    """Every live process below the supervisor: ranks, their children, and adopted orphans. From the kernel's
    lists of each process's children (a look at the run's own processes, not at every process of a busy node:
    a recovery in place waits for it); psutil's scan of all of /proc where the kernel keeps no such list."""
    pids = _descendant_pids(os.getpid())
    if pids is None:
        try:
            return psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _descendant_pids(root: int) -> list[int] | None:
    """Pids below `root`, parents first, from /proc/PID/task/TID/children; None if the kernel lacks those files."""
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile: its children are re-parented to us and listed under this process
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as listed:
                    children = [int(child) for child in listed.read().split()]
            except FileNotFoundError:
                if pid == root and tid == str(root):
                    return None  # no CONFIG_PROC_CHILDREN
                continue
            except (OSError, ValueError):
                continue
            found.extend(children)
            pending.extend(children)
    return found


def sigkill(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each process that is still the one we saw (psutil checks the start time); returns them."""
    hit = []
    for proc in procs:
        try:
            proc.kill()
            hit.append(proc)
        except psutil.NoSuchProcess:
            continue
    return hit


def reap_orphans(procs: Iterable[psutil.Process], managed: set[int]) -> None:
    """Collect exit statuses of adopted orphans among `procs` (our descendants) (never of the ranks, whose Popen
    waiters own theirs)."""
    me = os.getpid()
    for proc in procs:
        if proc.pid in managed:
            continue
        try:
            if proc.ppid() == me and proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue


def record_pids(layout: RunLayout, procs: Iterable[psutil.Process]) -> None:
    """Write the pids and start times of the run's processes for a successor supervisor."""
    records = []
    for proc in procs:
        try:
            records.append({"pid": proc.pid, "create_time": proc.create_time(), "name": proc.name()})
        except psutil.Error:
            continue
    atomic_write_json(
        layout.pids_file, {"supervisor_pid": os.getpid(), "processes": records}, root=layout.root, durable=False
    )


def kill_predecessor_leftovers(layout: RunLayout) -> list[dict[str, Any]]:
    """SIGKILL processes recorded by an earlier supervisor of this run dir that are provably still its own.

    pids.json may be forged, so a recorded pid is killed only if the process has the recorded start time
    and carries this run dir in its environment (every rank, and what it starts, inherits it)."""
    try:
        recorded = read_json(layout.pids_file)["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(recorded, list):
        return []
    return [record for record in recorded if _kill_if_ours(layout, record)]


def _kill_if_ours(layout: RunLayout, record: Any) -> bool:
    try:
        pid, started = record["pid"], record["create_time"]
        if type(pid) is not int or pid in (0, 1, os.getpid(), os.getppid()) or type(started) is not float:
            return False
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > 0.01:
            return False  # the pid was reused by an unrelated process
        if proc.environ().get(ENV_RUN_DIR) != str(layout.root):
            return False  # not a process of this run, whatever the file says
        proc.kill()
    except (psutil.Error, KeyError, TypeError, ValueError, OverflowError):
        return False
    return True
