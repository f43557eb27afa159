"""Warm standby ranks: one waiting process per local rank, so a relaunch skips Python's start and `import torch`.

A standby (worker/standby.py) is spawned like a rank (its own session, killed with the supervisor, pids recorded
for a successor), never forked from a process that has started torch's threads. It gets the rank's environment
less the variables only an attempt knows (`PER_ATTEMPT`), imports torch and the configured modules, then waits on
a socket. A relaunch hands each rank's standby the attempt's environment and the rank's log files; a rank whose
standby is gone starts cold. The pool is refilled once the new attempt trains, so standbys never compete with the
ranks' own start-up; and they import at idle CPU priority, so a refill never slows the training ranks either (on 2
cores two standbys' imports slowed the demo's steps 2-3x for 4 s after every relaunch): every thread SCHED_IDLE (only
cycles nobody else wants, among the processes of one CPU group), and the standby's session, its own autogroup where
the kernel groups by session, at autogroup nice 19 (else the group would get its fair share whatever its threads'
policy). A standby returns to normal priority when it is taken for a rank, or once it has been importing for
IDLE_IMPORT_S (a busy machine must not starve it for good). Threads go to SCHED_IDLE only where this user may take
them back (root, CAP_SYS_NICE or an RLIMIT_NICE of 20); any user may move an autogroup's nice between 0 and 19.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from supervisor.config import JobConfig
from supervisor.launch.trees import die_with_parent
from worker.contract import ENV_ATTEMPT, ENV_FAILURES, ENV_RESUME_DIR, ENV_RESUME_STEP, ENV_SKIP_TO_BATCH, RunLayout
from worker.files import open_append
from worker.standby import ENV_PREWARM, ENV_SCRIPT, ENV_STANDBY_FD, READY, activate_message

__all__ = ["IDLE_IMPORT_S", "PER_ATTEMPT", "Standby", "Standbys", "idle_priority_allowed"]

# Set only when an attempt starts: a standby waits without them and must not read them at import time.
PER_ATTEMPT = (
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    ENV_ATTEMPT,
    ENV_RESUME_STEP,
    ENV_RESUME_DIR,
    ENV_SKIP_TO_BATCH,
    ENV_FAILURES,
)
FILL_AFTER_S = 30.0  # without training heartbeats to go by, refill this long after a launch
IDLE_IMPORT_S = 30.0  # a standby still importing this long after its spawn goes on at normal priority
GROUP_NICE = 19  # the autogroup nice of a standby's session while it imports
GROUP_NICE_TRIES = 5  # attempts to put a taken standby's autogroup back to nice 0, a tenth of a second apart
_ORDER = b"A"


@dataclass
class Standby:
    """One waiting process and the supervisor's end of its socket."""

    rank: int
    proc: subprocess.Popen
    sock: socket.socket
    argv: list[str]  # the script and its arguments
    ready: bool = False
    background: bool = True  # spawned to wait while the run trains (idle priority), not for a launch now
    idle: bool = False  # its threads at idle CPU priority, not yet returned to normal
    group_nice: int = 0  # its autogroup's nice: 19 once lowered (a write may have to wait for the kernel's rate limit)
    spawned_at: float = field(default_factory=time.monotonic)

    def is_ready(self) -> bool:
        """Alive and done importing (it said so on its socket)."""
        if self.proc.poll() is not None:
            return False
        if not self.ready:
            try:
                self.ready = self.sock.recv(1) == READY
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return False
        return self.ready

    def lower_group(self) -> None:
        """Its autogroup to nice 19, if not done yet (unprivileged, the kernel takes one such change a tenth of a
        second: a refused one is tried again at the next fill)."""
        if self.background and self.group_nice == 0 and _set_group_nice(self.proc.pid, GROUP_NICE):
            self.group_nice = GROUP_NICE

    def normal_priority(self) -> None:
        """Return it to normal CPU priority (it is to be a rank, or has waited for idle CPU long enough): its
        autogroup first, then every thread, the main thread first, so that threads it starts meanwhile are born
        normal."""
        if self.group_nice:
            for _ in range(GROUP_NICE_TRIES):
                if _set_group_nice(self.proc.pid, 0):
                    break
                time.sleep(0.1)  # the kernel's rate limit on autogroup changes by unprivileged processes
            self.group_nice = 0
        if not self.idle:
            return
        self.idle = False
        for _ in range(3):  # a thread started by another idle thread during a pass is caught by the next
            if not _leave_idle_policy(self.proc.pid):
                return

    def activate(self, env: dict[str, str], out: int, err: int) -> bool:
        """Hand over the attempt's environment and the rank's log files; False when the standby is gone."""
        try:
            self.sock.setblocking(True)
            socket.send_fds(self.sock, [_ORDER], [out, err])
            self.sock.sendall(activate_message(self.argv, env))
            return True
        except OSError:
            return False
        finally:
            self.sock.close()

    def retire(self) -> None:
        """Kill it (its own session: nothing of it stays) and collect its exit status."""
        self.sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it died meanwhile
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Standbys:
    """At most one standby per local rank of this machine."""

    def __init__(self, config: JobConfig, layout: RunLayout, envs: dict[int, dict[str, str]], log: Any) -> None:
        assert config.script is not None
        self._argv = [config.script, *config.args]
        self._layout = layout
        self._log = log
        self._prewarm = "auto" if config.standby.prewarm_imports is None else ",".join(config.standby.prewarm_imports)
        self._envs = {rank: {k: v for k, v in env.items() if k not in PER_ATTEMPT} for rank, env in envs.items()}
        self._pool: dict[int, Standby] = {}
        self.failed = False  # a standby died unused: from then on every rank starts cold

    @property
    def pids(self) -> set[int]:
        return {standby.proc.pid for standby in self._pool.values()}

    def ready(self) -> int:
        return sum(standby.is_ready() for standby in self._pool.values())

    def fill(self, *, background: bool = True) -> None:
        """Spawn the missing standbys (`background`: to wait while the run trains, at idle priority; else for a
        launch about to happen, at normal priority), and return to normal priority those importing for IDLE_IMPORT_S
        already. Call from the main thread: a child's parent-death signal is tied to the thread that spawned it."""
        self._drop_dead()
        for standby in self._pool.values():
            if standby.is_ready():
                continue  # waiting on its socket: it takes no CPU at any priority
            if time.monotonic() - standby.spawned_at > IDLE_IMPORT_S:
                standby.normal_priority()
            else:
                standby.lower_group()
        for rank in self._envs:
            if rank not in self._pool and not self.failed:
                try:
                    self._pool[rank] = self._spawn(rank, background=background)
                except OSError as exc:
                    self._fail(f"cannot start a standby for rank {rank}: {exc}")

    def take(self, rank: int) -> Standby | None:
        """The rank's standby while it lives (it leaves the pool). One still importing is taken too: it runs the
        script as soon as its imports are done, still ahead of a process started now."""
        standby = self._pool.pop(rank, None)
        if standby is None:
            return None
        if standby.proc.poll() is None:
            standby.normal_priority()  # a rank now: its imports, if not done, and its training at full speed
            return standby
        self._check_exit(standby)
        standby.retire()
        return None

    def close(self) -> None:
        for standby in self._pool.values():
            standby.retire()
        self._pool.clear()

    def _spawn(self, rank: int, *, background: bool) -> Standby:
        idle = background and idle_priority_allowed()
        ours, theirs = socket.socketpair()
        log = open_append(self._layout.root / "logs" / f"standby_rank_{rank}.log", root=self._layout.root)
        env = {
            **self._envs[rank],
            ENV_STANDBY_FD: str(theirs.fileno()),
            ENV_SCRIPT: self._argv[0],
            ENV_PREWARM: self._prewarm,
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "worker.standby"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=_idle_standby if idle else die_with_parent,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(log)
        ours.setblocking(False)
        standby = Standby(rank, proc, ours, self._argv, background=background, idle=idle)
        standby.lower_group()
        return standby

    def _drop_dead(self) -> None:
        for rank, standby in list(self._pool.items()):
            if standby.proc.poll() is not None:
                del self._pool[rank]
                self._check_exit(standby)
                standby.retire()

    def _check_exit(self, standby: Standby) -> None:
        code = standby.proc.poll()
        if code is not None:
            self._fail(
                f"the standby of rank {standby.rank} exited with {code} before it was used "
                f"(see {self._layout.root / 'logs' / f'standby_rank_{standby.rank}.log'})"
            )

    def _fail(self, reason: str) -> None:
        if not self.failed:
            self._log.warning("standbys_off", reason=reason)
        self.failed = True


@cache
def idle_priority_allowed() -> bool:
    """Whether this process may put a thread at idle CPU priority and take it back to normal (root, CAP_SYS_NICE,
    or an RLIMIT_NICE of 20): tried once, on a thread of its own that then ends."""
    if not hasattr(os, "SCHED_IDLE"):  # not Linux
        return False
    allowed: list[bool] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread alone
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    trial = threading.Thread(target=attempt, name="idle-priority-trial")
    trial.start()
    trial.join()
    return allowed == [True]


def _idle_standby() -> None:
    """preexec_fn for a standby: die with the supervisor, and import at idle CPU priority (its threads inherit it)."""
    die_with_parent()
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _leave_idle_policy(pid: int) -> bool:
    """Put every thread of process `pid` at idle priority back to normal; whether any was."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        tids = [int(name) for name in os.listdir(tasks) if name.isdigit()]
    except OSError:  # gone
        return False
    changed = False
    for tid in sorted(tids, key=lambda tid: tid != pid):  # the main thread first
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                changed = True
    return changed


def _set_group_nice(pid: int, nice: int) -> bool:
    """Set the nice of the autogroup of process `pid` (its session's, where the kernel groups by session); False
    only when the kernel asks to try again later (its rate limit), True when done or not possible at all (no
    autogroups: the threads' policy is what counts there)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as file:
            file.write(str(nice))
    except BlockingIOError:  # EAGAIN: another autogroup change within the last 0.1 s
        return False
    except OSError:  # no autogroup support, or the process is gone
        pass
    return True
