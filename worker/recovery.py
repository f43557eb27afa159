"""Recovery in place: when a peer rank fails, this process stays and runs the training function again.

A script hands its training function over once, at the bottom:

    if __name__ == "__main__":
        worker.run(main)

Under a supervisor with `restart.in_place` on (the default), a rank leaves `main` by an exception once a peer
failed: PeerFailed, raised by UNWIND_SIGNAL's handler as soon as the supervisor says the attempt unwinds (between
two Python bytecodes, as KeyboardInterrupt is; never inside a checkpoint save, which finishes first), or the one
its next collective raises (gloo: the peer's connection closed; with NCCL this module's watchdog aborts the
communicator on the supervisor's word). Then, in this process:

1. its Warden says `peer_failed` and closes (a background save in flight is let finish or fail first);
2. once the threads that ended its collectives have run, the process group is released (destroyed; for NCCL
   aborted, as destroying after a failure can hang); a release that blocks past RELEASE_TIMEOUT_S (a gloo
   collective still waiting on a live peer) ends the process, which is then replaced;
3. a CUDA context that no longer synchronizes ends the process here: a poisoned context never restarts in place;
4. its heartbeat says `recovering`; while the supervisor chooses the next attempt, what `main` held is collected
   (a DataLoader's worker processes end with their iterator; bounded like the release); then it waits for the
   next attempt (`RunLayout.recovery`): its number and variables (a new MASTER_PORT, so rank 0 hosts a new store;
   the resume point);
5. its output goes to the new attempt's log files, and `main()` runs again, resuming as a new process would.

A failed peer is replaced by a warm standby, which runs the script as soon as the failure is seen and, given
ENV_JOIN_AFTER, waits for the next attempt beside the survivors before it calls `main`; every rank, survivors
included, loads the resume point the supervisor chose (the newest snapshot every rank completed), so no rank goes
on with a step only some ranks applied.

Any other exception (the rank's own error, a CUDA error) ends the process as it always did; so does a plain
torchrun, where `run(main)` is just `main()`. What this asks of `main`, since it may run more than once in a
process: build everything it trains with inside it (process group, model, optimizer, data loaders, Warden); keep
nothing of an attempt in globals; leave things it registers once per process (signal handlers, atexit hooks,
`torch.compile` caches) safe to meet twice.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from worker.contract import (
    ENV_ATTEMPT,
    ENV_IN_PLACE,
    ENV_JOIN_AFTER,
    ENV_RUN_DIR,
    RECOVERING_PHASE,
    UNWIND_SIGNAL,
    RunLayout,
)
from worker.files import open_append, read_json
from worker.heartbeat import Heartbeat

__all__ = [
    "ORDER_WAIT_S",
    "PeerFailed",
    "attach",
    "attempt_started_ns",
    "in_place",
    "let_threads_run",
    "peer_failure",
    "run",
    "watch_for_unwind",
]

T = TypeVar("T")

ORDER_WAIT_S = 600.0  # a survivor waits this long for its next attempt; the supervisor decides far sooner
_ORDER_POLL_S = 0.002  # a read of one small file: the survivors' wait adds at most this to a recovery
_SLOW_POLL_AFTER_S, _SLOW_POLL_S = 1.0, 0.05  # past a second (a backoff), a look every 50 ms is soon enough
_WATCH_POLL_S = 0.05  # the NCCL watchdog's look at the supervisor's word
_GLOO_WATCH_POLL_S = 0.25  # with gloo only a rank stuck past STUCK_S is looked for: seconds, not milliseconds
# A rank still inside the failed attempt's training function this long after the word to unwind waits in a C++
# collective that will not end (gloo, on a peer that unwound but whose connection stays open; NCCL, an abort that did
# not take) and never runs the signal's handler: it exits, its stacks in its log, and is replaced; its exit closes its
# own connections, so no peer waits on it in turn. A save in flight finishes first.
STUCK_S = 3.0
_CUDA_CHECK_S = 30.0  # a synchronize that takes longer means a wedged device
# A gloo work thread that just failed a collective may still hold the last reference to its tensors, which it frees
# under the GIL; a process group destroyed under the GIL meanwhile (by a collection) joins that thread: both wait.
SETTLE_S, _SETTLE_POLL_S = 0.1, 0.001
# Releasing the attempt's process group and collecting what held it takes milliseconds; a gloo group whose collective
# still waits on a live peer that left it blocks its destructor until its timeout. Past this, the rank exits (its
# stacks in its log) and is replaced like the failed one.
RELEASE_TIMEOUT_S = 5.0
MAX_ERROR_CHARS = 300
# What gloo and NCCL say when a peer went or the communicator was aborted (PyTorch raises plain RuntimeErrors); a
# desync ("Received data size doesn't match") or a timeout is not a peer gone: the rank fails as it always did.
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ProcessGroupNCCL is aborted",
    "a peer rank failed (the supervisor's word)",  # PeerFailed's, wrapped (raised in a communication hook)
)
_CUDA_ERRORS = ("CUDA error", "cudaError", "AcceleratorError", "device-side assert")

# The live Warden's unwinding (its error line; whether to leave evidence) and its "inside a save", newest last.
_unwind: list[tuple[Callable[[str, bool], Heartbeat | None], Callable[[], bool]]] = []
_active = False
_in_main = False  # the training function runs: UNWIND_SIGNAL may end it
_started_ns: int | None = None  # when the training function last began (epoch ns), under `run` with in place on


class PeerFailed(RuntimeError):
    """The supervisor said this rank's attempt unwinds (a peer failed): raised in the training function."""


def in_place() -> bool:
    """This process runs its training function through `run` under a supervisor that recovers in place."""
    return _active


def attempt_started_ns() -> int | None:
    """When this attempt's training function began (time.time_ns), recovering in place; None otherwise."""
    return _started_ns


def attach(unwind: Callable[[str, bool], Heartbeat | None], saving: Callable[[], bool]) -> Callable[[], None]:
    """A Warden registers how it unwinds (say why, leave the evidence of a failed collective if asked, close, hand
    back its heartbeat) and whether it is inside a checkpoint save (UNWIND_SIGNAL waits for it); returns its
    detach."""
    entry = (unwind, saving)
    _unwind.append(entry)

    def detach() -> None:
        with contextlib.suppress(ValueError):
            _unwind.remove(entry)

    return detach


def run(main: Callable[[], T]) -> T:
    """Run the training function; under a supervisor that recovers in place, run it again after a peer failed."""
    global _active, _in_main, _started_ns
    if os.environ.get(ENV_IN_PLACE) != "1":
        return main()
    _active = True
    gc.freeze()  # what imports made lives on: a recovery's collection walks only what an attempt made (ms, not 0.2 s)
    with contextlib.suppress(ValueError):  # not the main thread: the next collective's exception is the word
        signal.signal(UNWIND_SIGNAL, _on_unwind_signal)
    watch_for_unwind()
    if (joins := os.environ.pop(ENV_JOIN_AFTER, "")).isdigit():  # a replacement, started while its peers unwind
        print(f"trainwarden: replacing rank {_rank()}, lost in attempt {joins}", file=sys.stderr, flush=True)
        _take_next_attempt(_layout(), int(joins), _rank())
    while True:
        try:
            _in_main, _started_ns = True, time.time_ns()
            return main()
        except BaseException as exc:  # noqa: BLE001 - only a peer's failure is kept; anything else goes on up
            _in_main, failed = False, time.monotonic()
            error = peer_failure(exc)
            if error is None:
                raise
            # Told by the supervisor, it recovers in place: no culprit to name from this rank's flight recorder.
            told = isinstance(exc, PeerFailed)
            let_threads_run()  # before the traceback lets go of the attempt's objects, and their process group
        finally:
            _in_main = False
        _recover(error, evidence=not told, failed=failed)


def _on_unwind_signal(signum: int, frame: Any) -> None:
    """The supervisor's word that this attempt unwinds: leave the training function now (not inside a save)."""
    if not _in_main or any(saving() for _, saving in _unwind):
        return
    attempt = int(os.environ.get(ENV_ATTEMPT) or 0)
    root = os.environ.get(ENV_RUN_DIR)
    if root is not None and unwinding_attempt(RunLayout(Path(root)).recovery) == attempt:  # not a late word
        raise PeerFailed(f"attempt {attempt} unwinds: a peer rank failed (the supervisor's word)")


def peer_failure(exc: BaseException) -> str | None:
    """The exception's line when it is a collective failing for a peer (or an abort), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, PeerFailed):
            return f"PeerFailed: {text}"[:MAX_ERROR_CHARS]
        if _distributed_error(current) and not any(marker in text for marker in _CUDA_ERRORS):
            return f"{type(current).__name__}: {text}".splitlines()[0][:MAX_ERROR_CHARS]
        current = current.__cause__ or current.__context__
    return None


def _distributed_error(exc: BaseException) -> bool:
    """A peer's connection or the store went away, or the communicator was aborted."""
    dist = sys.modules.get("torch.distributed")
    gone = tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None)) if t)
    if gone and isinstance(exc, gone):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _PEER_GONE)


def _recover(error: str, *, evidence: bool, failed: float) -> None:
    """Unwind from the failed attempt (leaving its flight recorder if `evidence`), wait for the next one, and take
    over its environment and logs. `failed`: when its collective failed (time.monotonic())."""
    layout, rank, attempt = _layout(), _rank(), int(os.environ.get(ENV_ATTEMPT) or 0)
    heartbeat = _unwind[-1][0](error, evidence) if _unwind else None
    with _exit_if_blocked():
        _release_process_group()
    _check_cuda()
    if heartbeat is None:  # it failed before its Warden was made
        heartbeat = Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=attempt, interval_s=1.0)
        print(f"trainwarden: recovering in place after: {error}", file=sys.stderr, flush=True)
    # Written once the group is gone, so a peer's may come first: `failed_s` tells whose collective failed first.
    heartbeat.beat(heartbeat.last_step, RECOVERING_PHASE, force=True, failed_s=time.monotonic() - failed)
    with _exit_if_blocked():  # while the supervisor chooses the next attempt, not before it is told this one is ready
        gc.collect()  # what the attempt held: tensors, and a DataLoader's worker processes with their iterator
    _take_next_attempt(layout, attempt, rank)


@contextlib.contextmanager
def _exit_if_blocked() -> Iterator[None]:
    """Past RELEASE_TIMEOUT_S, end the process with its stacks in its log: from C, as a destructor may hold the
    GIL."""
    faulthandler.dump_traceback_later(RELEASE_TIMEOUT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _layout() -> RunLayout:
    return RunLayout(Path(os.environ.get(ENV_RUN_DIR, "runs/local")))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _take_next_attempt(layout: RunLayout, after: int, rank: int) -> None:
    """Wait for the attempt after `after`; take over its variables and logs."""
    number, variables = _await_next(layout, after)
    os.environ.update(variables)
    os.environ[ENV_ATTEMPT] = str(number)
    _reopen_output(layout, number, rank)


def let_threads_run(limit_s: float = SETTLE_S) -> None:
    """Sleep, the GIL released, until no other thread of this process is runnable at two looks in a row (Linux), for
    at most `limit_s`: a thread waiting for the GIL at the first look (this one held it to look) ran in the sleep."""
    deadline, quiet = time.monotonic() + limit_s, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL_S)
        quiet = 0 if _other_threads_runnable() else quiet + 1


def _other_threads_runnable() -> bool:
    """Another thread of this process is running or waiting for a CPU (False where /proc cannot tell)."""
    own = str(threading.get_native_id())
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            if task.name == own:
                continue
            with contextlib.suppress(OSError), open(f"{task.path}/stat", "rb") as stat:
                if stat.read(512).rpartition(b")")[2].split()[:1] == [b"R"]:  # after "(comm)", which may hold spaces
                    return True
    return False


def _release_process_group() -> None:
    """Destroy the process group (for NCCL abort it: a destroy flushes, and hangs after a failure)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def _check_cuda() -> None:
    """A CUDA context that cannot synchronize is poisoned: end the process (the supervisor relaunches)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    failed: list[BaseException] = []

    def synchronize() -> None:
        try:
            torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below, on the main thread
            failed.append(exc)

    checker = threading.Thread(target=synchronize, daemon=True, name="tw-cuda-check")
    checker.start()
    checker.join(_CUDA_CHECK_S)
    if checker.is_alive() or failed:
        why = f"did not synchronize in {_CUDA_CHECK_S:g} s" if checker.is_alive() else repr(failed[0])
        print(f"trainwarden: CUDA context unusable after the failure ({why}); not recovering in place", file=sys.stderr)
        os._exit(1)


def _await_next(layout: RunLayout, attempt: int) -> tuple[int, dict[str, str]]:
    """The next attempt's number and variables, once the supervisor names one after `attempt`."""
    started = time.monotonic()
    while (waited := time.monotonic() - started) < ORDER_WAIT_S:
        order = _read_order(layout.recovery)
        if order is not None and order[0] > attempt:
            return order
        time.sleep(_ORDER_POLL_S if waited < _SLOW_POLL_AFTER_S else _SLOW_POLL_S)
    print(f"trainwarden: no next attempt in {ORDER_WAIT_S:g} s; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _read_order(path: Path) -> tuple[int, dict[str, str]] | None:
    try:
        order = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(order, dict):
        return None
    number, variables = order.get("next"), order.get("env")
    if type(number) is not int or not isinstance(variables, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v for k, v in variables.items()):
        return None
    return number, variables


def _reopen_output(layout: RunLayout, attempt: int, rank: int) -> None:
    """stdout and stderr to the new attempt's log files, where the supervisor reads a rank's output."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target, stream in ((1, "out"), (2, "err")):
        fd = open_append(layout.attempt_log(attempt, rank, stream), root=layout.root)
        os.dup2(fd, target)
        os.close(fd)


def unwinding_attempt(path: Path) -> int | None:
    """The attempt the supervisor says is unwinding, from its recovery file, or None."""
    try:
        order = read_json(path)
    except (OSError, ValueError):
        return None
    number = order.get("unwind") if isinstance(order, dict) else None
    return number if type(number) is int else None


def watch_for_unwind(abort: Callable[[], Any] | None = None) -> threading.Thread:
    """The NCCL watchdog: once the supervisor says this process's attempt unwinds, abort its NCCL communicators,
    so a collective blocked on the failed peer raises now (gloo raises on its own); then, still stuck in the
    training function STUCK_S later, exit. `abort`: for tests."""

    def watch() -> None:
        while True:
            nccl = abort is not None or _nccl_in_use()
            time.sleep(_WATCH_POLL_S if nccl else _GLOO_WATCH_POLL_S)
            attempt = int(os.environ.get(ENV_ATTEMPT) or 0)  # the current one: it moves on with each recovery
            root = os.environ.get(ENV_RUN_DIR)
            if root is None or unwinding_attempt(RunLayout(Path(root)).recovery) != attempt:
                continue
            if nccl:
                (abort or _abort_nccl)()
            _leave_if_stuck(attempt)

    watcher = threading.Thread(target=watch, daemon=True, name="tw-unwind-watch")
    watcher.start()
    return watcher


def _leave_if_stuck(attempt: int) -> None:
    """Until this process moves on from `attempt`: exit if its training function has not let go STUCK_S after the
    word (the clock restarts while a save is in flight)."""
    stuck_s = STUCK_S
    deadline = time.monotonic() + stuck_s
    while int(os.environ.get(ENV_ATTEMPT) or 0) == attempt:
        if any(saving() for _, saving in _unwind):
            deadline = time.monotonic() + stuck_s
        elif _in_main and time.monotonic() >= deadline:
            print(
                f"trainwarden: still in attempt {attempt}'s training function {stuck_s:g} s after the word to unwind "
                "(a collective that will not end); exiting, to be replaced",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)
        time.sleep(_WATCH_POLL_S)


def _nccl_in_use() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def _abort_nccl() -> None:
    dist = sys.modules["torch.distributed"]
    with contextlib.suppress(Exception):  # the main thread's collective raises; a failed abort leaves NCCL's timeout
        dist.distributed_c10d._abort_process_group()
