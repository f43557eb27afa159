"""Evidence from hung ranks, collected off the main thread before anything is killed, and the verdict on it.

Stacks from two sources: faulthandler inside each rank (the worker library registers it for STACK_DUMP_SIGNAL; it
dumps every thread even while the main thread is stuck in a C++ collective), and `py-spy dump` from
outside when py-spy is installed (it needs no cooperation, so it also covers scripts without the library).
With the stacks, a worker-library rank writes its flight recorder (`worker.flight`); and each rank's process
state is read before it is signalled (a frozen rank is woken to dump). `supervisor.core.blame` names the culprit.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.core import StacksCollected
from supervisor.core.blame import Verdict, blocked_behind, name_culprit, parse_flight, trim_flight
from supervisor.rundir.rank_logs import last_step
from worker.contract import STACK_DUMP_SIGNAL, RunLayout
from worker.files import atomic_write_bytes, open_regular, read_json

__all__ = ["StackDumps", "collect_stacks", "find_pyspy", "judge", "start_stack_collection"]

PYSPY_TIMEOUT_S = 10.0
FAULTHANDLER_WAIT_S = 2.0  # for a rank's stacks and its flight recorder: one that has written neither is evidence
MAX_DUMP_BYTES = 1 << 20  # one dump of every thread is a few KiB; the file is the rank's to write
MAX_FLIGHT_BYTES = 16 << 20  # a flight recorder of 2,000 collectives is about 1.5 MB of JSON


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
    *,
    ranks: tuple[int, ...] = (),
    collective_failed: bool = False,
) -> None:
    """Collect the evidence of `pids` (rank -> leader pid) in a thread; posts StacksCollected with the verdict.

    `ranks`: every rank of the attempt on this machine (an exited one may have left its flight recorder)."""
    args = (layout, attempt, pids, faulthandler_ranks, post, ranks, collective_failed)
    threading.Thread(target=_collect, args=args, daemon=True, name=f"stacks-a{attempt}").start()


def _collect(
    layout: RunLayout,
    attempt: int,
    pids: dict[int, int],
    faulthandler_ranks: tuple[int, ...],
    post: Callable[[object], None],
    ranks: tuple[int, ...],
    collective_failed: bool,
) -> None:
    dumps = StackDumps((), {}, ())
    try:
        dumps = collect_stacks(layout, attempt, pids, faulthandler_ranks, ranks=ranks)
    finally:
        verdict, blocked = judge(tuple(sorted({*pids, *ranks})), dumps, collective_failed=collective_failed)
        post(
            StacksCollected(
                attempt,
                dumps.paths,
                culprit=None if verdict is None else verdict.rank,
                last_steps=dumps.last_steps,
                blocked=blocked,
                verdict=verdict,
            )
        )


@dataclass(frozen=True)
class StackDumps:
    """What one collection found: the dump files written, each rank's stack text, the step each rank logged, each
    rank's flight recorder (trimmed, as `trim_flight` cuts it), each rank's process state before it was signalled,
    and the ranks expected to write a flight recorder."""

    paths: tuple[str, ...]
    by_rank: dict[int, str]
    last_steps: tuple[tuple[int, int], ...]
    flights: dict[int, dict] = field(default_factory=dict)
    states: dict[int, str] = field(default_factory=dict)
    expected: tuple[int, ...] = ()


def judge(
    ranks: tuple[int, ...], dumps: StackDumps, *, collective_failed: bool = False
) -> tuple[Verdict | None, tuple[int, ...]]:
    """The verdict on a hung attempt's `ranks` (or one where a collective failed) from what was collected, and the
    ranks blocked behind its culprit."""
    verdict = name_culprit(
        ranks,
        flights={r: parse_flight(f) for r, f in dumps.flights.items()},
        expected=ranks if collective_failed else dumps.expected,
        stacks=dumps.by_rank,
        states=dumps.states,
        collective_failed=collective_failed,
    )
    return verdict, blocked_behind(dumps.by_rank, None if verdict is None else verdict.rank)


def collect_stacks(
    layout: RunLayout,
    attempt: int,
    pids: dict[int, int],
    faulthandler_ranks: tuple[int, ...],
    *,
    ranks: tuple[int, ...] = (),
) -> StackDumps:
    """Dump the stacks of `pids` (rank -> leader pid, on this machine): faulthandler, then py-spy if installed; and
    read the flight recorders of `ranks` and `pids`: the ones faulthandler ranks write now, and older ones."""
    states = {rank: _state(pid) for rank, pid in pids.items()}  # before any signal wakes a frozen one
    dumps: dict[str, str] = {}  # path -> the text this collection added
    before = {rank: _size(layout.stack_dump(rank, attempt)) for rank in faulthandler_ranks}
    for rank in faulthandler_ranks:
        _request_dump(pids[rank])
    pyspy = find_pyspy()
    if pyspy is not None:  # one py-spy per rank at once: each takes a while to attach
        with ThreadPoolExecutor(max_workers=min(8, len(pids) or 1)) as pool:
            texts = pool.map(
                lambda item: (item[0], _pyspy_dump(pyspy, item[1], layout.pyspy_dump(item[0], attempt), layout.root)),
                pids.items(),
            )
            dumps.update({str(layout.pyspy_dump(rank, attempt)): text for rank, text in texts if text})
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    for rank, size in before.items():
        path, flight_path = layout.stack_dump(rank, attempt), layout.flight_dump(rank, attempt)
        # One collection per attempt: a record there already was written as its rank raised (it is on its way out).
        while (
            (_size(path) <= size or _mtime(flight_path) is None)
            and time.monotonic() < deadline
            and _state(pids[rank]) not in ("zombie", "gone")
        ):  # a rank that exited will write nothing more
            time.sleep(0.05)
        if _size(path) > size:
            dumps[str(path)] = _read_from(path, size)
    by_rank = {rank: "".join(t for p, t in dumps.items() if Path(p).parent.name == f"rank_{rank}") for rank in pids}
    last_steps = tuple((rank, step) for rank in pids if (step := last_step(layout, rank, attempt)) is not None)
    flights = {
        rank: flight
        for rank in sorted({*pids, *ranks})
        if (flight := _read_flight(layout.flight_dump(rank, attempt))) is not None
    }
    # Uninterruptible sleep counts only if it lasted the whole collection: a rank writing a file passes through it.
    states = {
        rank: state if state != "disk-sleep" or _state(pids[rank]) == state else "was-disk-sleep"
        for rank, state in states.items()
    }
    return StackDumps(tuple(sorted(dumps)), by_rank, last_steps, flights, states, tuple(sorted(faulthandler_ranks)))


def _read_flight(path: Path) -> dict | None:
    """A rank's flight recorder dump, trimmed; None when there is none or it is not JSON."""
    try:
        return trim_flight(read_json(path, MAX_FLIGHT_BYTES))
    except (OSError, ValueError):
        return None


def _state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


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
        result = subprocess.run(
            [pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S
        )
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


def _mtime(path: Path) -> int | None:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None


def _size(path: Path) -> int:
    """The size of a regular file (not followed if a symlink); 0 for anything else."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0
