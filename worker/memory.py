"""The memory tier's home: one private directory per run and machine in host shared memory (`/dev/shm`).

Snapshots written there outlive the rank that wrote them (tmpfs keeps files after their writer dies) and cost no
disk I/O. Files rather than memfds: a relaunched rank, a successor supervisor and a new `trainwarden run` of the same
run dir find them by name, with no process left holding descriptors, and the same code (atomic writes, records
with checksums, the safe loaders) serves both tiers.

The directory is named after the run dir's resolved path and the user, created by the supervisor (or a node's
agent) with mode 0700, and trusted only if it is a real directory (not a symlink), owned by this user and closed
to everyone else: another user cannot plant snapshots for us to load, nor read ours. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

from worker.files import Refused

__all__ = ["MEMORY_BASE", "check_memory_dir", "create_memory_dir", "memory_dir_for", "remove_memory_dir"]

MEMORY_BASE = Path("/dev/shm")


def memory_dir_for(run_dir: Path, base: Path = MEMORY_BASE) -> Path:
    """This run's memory directory on this machine: the same for every process of the run dir (a relaunched rank,
    a successor, a new `trainwarden run`), so snapshots are found again after their writer died."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return base / f"trainwarden-{os.getuid()}-{digest}"


def create_memory_dir(path: Path) -> Path:
    """Create `path` (mode 0700) if missing, then check it as `check_memory_dir` does; Refused, or OSError (no
    /dev/shm, read-only), when it cannot serve."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return check_memory_dir(path)


def check_memory_dir(path: Path) -> Path:
    """`path` if it is a directory (not a symlink) owned by this user and open to no one else; Refused otherwise."""
    info = os.lstat(path)  # FileNotFoundError: nobody created it
    if not stat.S_ISDIR(info.st_mode):
        raise Refused(errno.ENOTDIR, "not a directory (a symlink is not followed)", str(path))
    if info.st_uid != os.getuid():
        raise Refused(errno.EPERM, f"owned by uid {info.st_uid}, not by this user ({os.getuid()})", str(path))
    if info.st_mode & 0o077:
        raise Refused(errno.EPERM, f"open to others (mode {stat.S_IMODE(info.st_mode):o}, 700 wanted)", str(path))
    return path


def remove_memory_dir(path: Path) -> None:
    """Remove the run's memory directory and everything in it (the run ended); a directory we do not trust (a
    symlink, someone else's) is left alone."""
    try:
        check_memory_dir(path)
    except OSError:
        return
    shutil.rmtree(path, ignore_errors=True)  # rmtree never follows symlinks inside
