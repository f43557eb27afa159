"""Who supervises a run: a lease in the run dir, so that two supervisors never act at once, and a heartbeat that
tells `trainwarden status` on any host whether the supervisor lives.

Each holder writes only its own generation's file, `supervisor/lease/<generation>.json`; the newest generation is
the lease. A new holder claims generation n+1 by linking a complete file into place: the link fails when the file
exists, so exactly one claimant wins, on a local filesystem as on NFS. The holder renews its file every fifth
of its ttl (a wall-clock stamp advanced by the monotonic clock, so a clock step cannot age it). A lease may be claimed
once it was released (the run ended), abdicated (its holder lost its link), or not renewed for its ttl, or when its
holder is gone for sure (a dead pid on this host; a Slurm job that ended). A holder that sees a newer generation is
deposed and must stop acting at once; one that could not renew for most of its ttl stops acting too, before any
claimant may take over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

from worker.contract import RunLayout
from worker.files import FILE_MODE, atomic_write_bytes, atomic_write_json, open_dir, read_json

__all__ = [
    "ABDICATED",
    "HELD",
    "LOCAL_TTL_S",
    "Lease",
    "LeaseHolder",
    "LeaseLost",
    "RELEASED",
    "claim",
    "claimable",
    "newest",
    "pid_alive",
    "read",
    "read_keeper",
    "read_relayed_signal",
    "relay_signal",
    "write_keeper",
]

HELD, ABDICATED, RELEASED = "held", "abdicated", "released"
_STATES = (HELD, ABDICATED, RELEASED)
RENEW_SHARE = 0.2  # of the ttl: three renewals in a row may fail before the holder stops acting
LOCAL_TTL_S = 10.0  # a run on one machine: its lease is a heartbeat for `status`
VALID_SHARE = 0.7  # a holder acts only while its last renewal is younger than this share of the ttl
KEEP_GENERATIONS = 8  # older lease files are removed by a new holder
MAX_LEASE_FILES = 10_000  # a directory listing is bounded too: the run dir is untrusted
_NAME = re.compile(r"^(\d{1,12})\.json$")


@dataclass(frozen=True)
class Lease:
    """One generation of the lease, as its holder last wrote it."""

    generation: int
    host: str
    pid: int
    renewed_at: float  # wall clock (time.time()), advanced by the holder's monotonic clock
    ttl_s: float
    state: str = HELD
    job: str | None = None  # the holder's Slurm job, if any
    batch: bool = False  # the holder is the job's batch process: its exit ends the job
    exit_code: int | None = None  # released: how the run ended

    def age(self, now: float) -> float:
        return max(0.0, now - self.renewed_at)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, generation: int, raw: Any) -> Lease:
        """ValueError for anything but a whole lease of `generation` (the file is untrusted)."""
        if not isinstance(raw, dict) or raw.get("generation") != generation:
            raise ValueError("not a lease of its generation")
        host, pid, at, ttl, state = (raw.get(k) for k in ("host", "pid", "renewed_at", "ttl_s", "state"))
        job, code = raw.get("job"), raw.get("exit_code")
        if not (isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable()):
            raise ValueError("a lease's host is not a host name")
        if type(pid) is not int or not _is_number(at) or not _is_number(ttl) or ttl <= 0:
            raise ValueError("a lease's pid, renewed_at or ttl_s has the wrong type")
        if state not in _STATES or not (job is None or (isinstance(job, str) and job.isalnum() and len(job) < 64)):
            raise ValueError("a lease's state or job is not one of ours")
        if not (code is None or type(code) is int) or type(raw.get("batch", False)) is not bool:
            raise ValueError("a lease's exit_code or batch has the wrong type")
        return cls(generation, host, pid, float(at), float(ttl), state, job, raw.get("batch", False), code)


@dataclass(frozen=True)
class LeaseLost:
    """The supervisor must stop acting: a newer generation deposed it, or it could not renew its lease."""

    why: str
    by: Lease | None = None  # the newer holder, when deposed


def _lease_dir(layout: RunLayout) -> Path:
    return layout.root / "supervisor" / "lease"


def newest(layout: RunLayout) -> Lease | None:
    """The newest generation's lease; None when there is none. An unreadable newest file (torn by hand, forged)
    counts as an abdicated lease of that generation: claimable, never trusted."""
    generations = _generations(layout)
    if not generations:
        return None
    top = generations[-1]
    try:
        return Lease.from_json(top, read_json(_lease_dir(layout) / f"{top}.json"))
    except (OSError, ValueError):
        return Lease(top, "?", 0, 0.0, LOCAL_TTL_S, ABDICATED)


def read(layout: RunLayout, generation: int) -> Lease | None:
    """One generation's lease, or None when it is missing or not one of ours."""
    with contextlib.suppress(OSError, ValueError):
        return Lease.from_json(generation, read_json(_lease_dir(layout) / f"{generation}.json"))
    return None


def _generations(layout: RunLayout) -> list[int]:
    try:
        with os.scandir(_lease_dir(layout)) as entries:
            names = [entry.name for _, entry in zip(range(MAX_LEASE_FILES), entries, strict=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := _NAME.match(name)))


def claimable(
    lease: Lease | None,
    now: float,
    *,
    here: str,
    pid_alive: Callable[[int], bool],
    job_running: Callable[[str], bool],
    job: str | None,
) -> str | None:
    """Why `lease` may be claimed now (one line), or None while its holder may still act."""
    if lease is None:
        return "no lease yet"
    if lease.state != HELD:
        return f"generation {lease.generation} was {lease.state} by {lease.host}"
    if lease.age(now) > lease.ttl_s:
        return f"generation {lease.generation} of {lease.host} expired {lease.age(now) - lease.ttl_s:.1f} s ago"
    if lease.host == here and not pid_alive(lease.pid):
        return f"generation {lease.generation}'s holder, pid {lease.pid} on this host, is gone"
    if lease.job is not None and lease.job != job and not job_running(lease.job):
        return f"generation {lease.generation}'s job {lease.job} has ended"
    return None


def claim(layout: RunLayout, lease: Lease) -> Lease | None:
    """Take `lease.generation` (the newest plus one) if nobody else did; None when another claimant won."""
    data = (json.dumps(lease.to_json(), indent=1) + "\n").encode()
    dir_fd = open_dir(layout.root, _lease_dir(layout))
    try:
        tmp = f".{lease.generation}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, f"{lease.generation}.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    _prune(layout, lease.generation)
    return lease


def _write(layout: RunLayout, lease: Lease, *, durable: bool) -> None:
    data = (json.dumps(lease.to_json(), indent=1) + "\n").encode()
    atomic_write_bytes(_lease_dir(layout) / f"{lease.generation}.json", data, root=layout.root, durable=durable)


def _prune(layout: RunLayout, current: int) -> None:
    for generation in _generations(layout):
        if generation <= current - KEEP_GENERATIONS:
            with contextlib.suppress(OSError):
                os.unlink(_lease_dir(layout) / f"{generation}.json")


def write_keeper(layout: RunLayout, generation: int, now: float) -> None:
    """The batch process waits while a successor supervises: it says so, so that the successor leaves the end of
    the job to the batch script (whose exit code and resubmission logic Slurm then sees)."""
    keeper = {"host": socket.gethostname(), "pid": os.getpid(), "renewed_at": now, "generation": generation}
    atomic_write_json(_lease_dir(layout) / "keeper.json", keeper, root=layout.root, durable=False)


def _is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return type(value) in (int, float)


def read_keeper(layout: RunLayout) -> float | None:
    """When the batch process last said it waits (wall clock), or None."""
    try:
        at = read_json(_lease_dir(layout) / "keeper.json").get("renewed_at")
    except (OSError, ValueError, AttributeError):
        return None
    return float(at) if type(at) in (int, float) else None


RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def relay_signal(layout: RunLayout, generation: int, signum: int) -> None:
    """Pass a signal the batch process got on to the supervisor holding `generation` (it reads this each tick)."""
    relayed = {"id": secrets.token_hex(8), "generation": generation, "signum": int(signum)}
    atomic_write_json(_lease_dir(layout) / "signal.json", relayed, root=layout.root)


def read_relayed_signal(layout: RunLayout, generation: int) -> tuple[str, int] | None:
    """(id, signum) of the signal relayed to `generation`, or None (none, another's, or not one of ours)."""
    try:
        raw = read_json(_lease_dir(layout) / "signal.json", limit=4096)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("generation") != generation or not isinstance(raw.get("id"), str):
        return None
    signum = raw.get("signum")
    return (raw["id"][:32], signum) if signum in RELAYED_SIGNALS else None


class LeaseHolder:
    """Holds one generation: renews it from a thread (a slow filesystem never stalls the main loop) and posts
    LeaseLost to `post` once, when a newer generation appears or renewals keep failing."""

    def __init__(self, layout: RunLayout, lease: Lease, post: Callable[[object], None] | None = None) -> None:
        self._layout = layout
        self._lease = lease
        self._post = post
        self._wall0, self._mono0 = lease.renewed_at, time.monotonic()
        self._renewed = self._mono0  # monotonic: the last renewal that landed
        self._stop = threading.Event()
        self._lost: LeaseLost | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="lease")

    @property
    def lease(self) -> Lease:
        return self._lease

    def start(self) -> None:
        self._thread.start()

    def now(self) -> float:
        """Wall clock as the holder stamps it: its start's wall time advanced by its monotonic clock."""
        return self._wall0 + (time.monotonic() - self._mono0)

    def valid(self) -> bool:
        """Whether the holder may act: not deposed, and renewed recently enough that no claimant may take over."""
        return self._lost is None and time.monotonic() - self._renewed < self._lease.ttl_s * VALID_SHARE

    @property
    def lost(self) -> LeaseLost | None:
        return self._lost

    def end(self, state: str, exit_code: int | None = None) -> None:
        """Stop renewing and write the final word: released (with the run's exit code) or abdicated."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            if self._lost is not None and self._lost.by is not None:
                return  # a newer generation holds it: ours is history
            self._lease = replace(self._lease, state=state, exit_code=exit_code, renewed_at=self.now())
            with contextlib.suppress(OSError, ValueError):
                _write(self._layout, self._lease, durable=True)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._lease.ttl_s * RENEW_SHARE):
            self.renew()

    def renew(self) -> None:
        """One renewal (the thread's, every RENEW_SHARE of the ttl): deposed by a newer generation, or our stamp
        advanced."""
        newer = [g for g in _generations(self._layout) if g > self._lease.generation]
        if newer:
            self._lose(LeaseLost(f"generation {newer[-1]} took over", read(self._layout, newer[-1])))
            return
        with self._lock:
            if self._stop.is_set():
                return
            self._lease = replace(self._lease, renewed_at=self.now())
            try:
                _write(self._layout, self._lease, durable=False)
                self._renewed = time.monotonic()
            except (OSError, ValueError) as exc:
                if not self.valid():
                    self._lose(LeaseLost(f"cannot renew the lease: {exc}"))

    def _lose(self, lost: LeaseLost) -> None:
        if self._lost is None:
            self._lost = lost
            self._stop.set()
            if self._post is not None:
                self._post(lost)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (pid_t range only)."""
    if not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True
