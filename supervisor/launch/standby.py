"""Warm standby ranks: one waiting process per local rank, so a relaunch skips Python's start and `import torch`.

A standby (worker/standby.py) lives like a rank (its own session, killed with the supervisor, pids recorded for a
successor). It has the rank's environment less the variables only an attempt knows (`PER_ATTEMPT`), torch and the
configured modules imported, and waits on a socket. A relaunch hands each rank's standby the attempt's environment
and the rank's log files; a rank whose standby is gone starts cold. The pool is refilled once the new attempt
trains, so standbys never compete with the ranks' own start-up.

Where standbys are kept warm, they are forked from a fork server (`standby.fork_server`) that imported once, never
from a process that has started torch's threads: refilling the pool after a relaunch then costs a fork, not the
seconds of CPU of every standby's own `import torch` beside the training ranks. The supervisor, a child subreaper,
adopts each and waits for it as for a process it spawned (`Adopted`). The server starts with the run and the first
launch waits for its imports (SERVER_WAIT_S at most), so that launch's ranks are forked from one import too, not
each started with its own. A server that finds its imports unsafe to fork, or that dies, says why
(`fork_server_off`), and standbys are spawned one by one instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.config import JobConfig
from supervisor.launch.trees import die_with_parent, is_subreaper
from worker.contract import ENV_ATTEMPT, ENV_FAILURES, ENV_RESUME_DIR, ENV_RESUME_STEP, ENV_SKIP_TO_BATCH, RunLayout
from worker.files import open_append
from worker.standby import (
    ENV_DEVICE,
    ENV_PREWARM,
    ENV_SCRIPT,
    ENV_STANDBY_FD,
    FORK,
    FORK_SERVER_FLAG,
    READY,
    REFUSED,
    activate_message,
)

__all__ = ["PER_ATTEMPT", "Adopted", "ForkServer", "Process", "Standby", "Standbys"]

# Set only when an attempt starts: a standby waits without them and must not read them at import time.
PER_ATTEMPT = (
    "MASTER_ADDR",  # across nodes, a spare may take the lost first node's place
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    ENV_ATTEMPT,
    ENV_RESUME_STEP,
    ENV_RESUME_DIR,
    ENV_SKIP_TO_BATCH,
    ENV_FAILURES,
)
FILL_AFTER_S = 30.0  # without training heartbeats to go by, refill this long after a launch
FORK_TIMEOUT_S = 5.0  # a fork and the forked standby's first word take milliseconds
# A launch waits this long for the fork server's imports (a cold rank would import as long); then it starts cold.
SERVER_WAIT_S = 120.0
UNKNOWN_EXIT = 255  # a process reaped by someone else: its status is lost
_ORDER = b"A"
_PID = struct.Struct("!i")


class Adopted:
    """A process the supervisor did not spawn but adopted (a forked standby): polled and waited for as a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):  # another thread waits: it will know
            try:
                self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            with self._lock:
                self._reap(0)
        deadline = time.monotonic() + (timeout or 0.0)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, flags: int) -> None:
        if self.returncode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            self.returncode = UNKNOWN_EXIT
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)


Process = subprocess.Popen | Adopted


@dataclass
class Standby:
    """One waiting process and the supervisor's end of its socket."""

    rank: int
    proc: Process
    sock: socket.socket
    argv: list[str]  # the script and its arguments
    ready: bool = False

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
        _end(self.proc)


class ForkServer:
    """The process that imported once and forks a standby per request (worker/standby.py --fork-server)."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.started = time.monotonic()
        self.ready = False
        self.refused = ""  # why it will not fork, once it said so or died

    def check(self) -> bool | None:
        """True once it is ready to fork, None while it imports, False when it refused or died (see `refused`)."""
        if self.ready and self.proc.poll() is not None:
            self.ready, self.refused = False, f"it exited with {self.proc.returncode}"
        if self.ready or self.refused:
            return self.ready
        try:
            said = self.sock.recv(1024)
        except (BlockingIOError, InterruptedError):
            if self.proc.poll() is None:
                return None
            said = b""
        except OSError:
            said = b""
        if said[:1] == READY:
            self.ready = True
            return True
        self.refused = said[1:].decode(errors="replace") if said[:1] == REFUSED else "it exited while importing"
        return False

    def fork(self, log: int, local_rank: int) -> tuple[Adopted, socket.socket]:
        """A standby for `local_rank` forked, adopted and ready, with the supervisor's end of its socket; OSError if
        not."""
        ours, theirs = socket.socketpair()
        try:
            self.sock.settimeout(FORK_TIMEOUT_S)
            socket.send_fds(self.sock, [FORK], [theirs.fileno(), log])
            self.sock.sendall(_PID.pack(local_rank))
            answer = self.sock.recv(_PID.size, socket.MSG_WAITALL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        pid = _PID.unpack(answer)[0] if len(answer) == _PID.size else -1
        if pid <= 0:
            ours.close()
            self.refused = "it could not fork" if answer else "it exited"
            raise OSError(f"the fork server failed: {self.refused}")
        proc = Adopted(pid)
        ours.settimeout(FORK_TIMEOUT_S)
        try:
            said = ours.recv(1)
        except OSError:
            said = b""
        if said != READY:  # it was not adopted, or died settling
            ours.close()
            _end(proc)
            raise OSError(f"the forked standby {pid} did not start (exit {proc.returncode})")
        ours.setblocking(False)
        return proc, ours

    def retire(self) -> None:
        self.sock.close()  # it exits at the end of its stream
        _end(self.proc)


def _end(proc: Process) -> None:
    """SIGKILL the process's session (nothing of it stays) and collect its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it died meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Standbys:
    """At most one standby per local rank of this machine."""

    def __init__(self, config: JobConfig, layout: RunLayout, envs: dict[int, dict[str, str]], log: Any) -> None:
        assert config.script is not None
        self._argv = [config.script, *config.args]
        self._layout = layout
        self._log = log
        self._prewarm = "auto" if config.standby.prewarm_imports is None else ",".join(config.standby.prewarm_imports)
        self._device = config.device  # cuda: each standby warms its GPU
        self._envs = {rank: {k: v for k, v in env.items() if k not in PER_ATTEMPT} for rank, env in envs.items()}
        self._pool: dict[int, Standby] = {}
        self._forking = config.standby.fork_server and config.standby.keep_warm  # where it pays: a pool kept warm
        self._server: ForkServer | None = None
        self.failed = False  # a standby died unused: from then on every rank starts cold

    @property
    def pids(self) -> set[int]:
        server = {self._server.proc.pid} if self._server else set()
        return server | {standby.proc.pid for standby in self._pool.values()}

    def ready(self) -> int:
        return sum(standby.is_ready() for standby in self._pool.values())

    def fill(self) -> None:
        """Spawn (or fork) the missing standbys. Call from the main thread: a child's parent-death signal is tied
        to the thread that spawned it."""
        self._drop_dead()
        missing = [rank for rank in self._envs if rank not in self._pool]
        if self.failed or not missing:
            return
        server = self._ready_server()
        if self._forking and server is None:
            return  # still importing: the standbys are forked at a later fill
        for rank in missing:
            try:
                self._pool[rank] = self._fork(server, rank) if server else self._spawn(rank)
            except OSError as exc:
                self._fail(f"cannot start a standby for rank {rank}: {exc}")

    def start_server(self) -> None:
        """Start the fork server, if standbys are forked (main thread: its parent-death signal is tied to it)."""
        if not self.failed:
            self._ready_server()

    def await_server(self) -> None:
        """Wait, from any thread, until the fork server has said whether it is ready, or died, or it has imported
        for SERVER_WAIT_S (then the launch starts cold). Reads nothing: `take` hears what it said."""
        server = self._server
        if server is None or server.ready or server.refused:
            return
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile: the run is ending
            select.select([server.sock], [], [], max(0.0, server.started + SERVER_WAIT_S - time.monotonic()))

    def take(self, rank: int) -> Standby | None:
        """The rank's standby while it lives (it leaves the pool), or one forked now. One still importing is taken
        too: it runs the script as soon as its imports are done, still ahead of a process started now."""
        standby = self._pool.pop(rank, None)
        if standby is None:
            server = None if self.failed else self._ready_server(start=False)
            with contextlib.suppress(OSError):  # then it starts cold
                return self._fork(server, rank) if server else None
            return None
        if standby.proc.poll() is None:
            return standby
        self._check_exit(standby)
        standby.retire()
        return None

    def close(self) -> None:
        for standby in self._pool.values():
            standby.retire()
        self._pool.clear()
        if self._server is not None:
            self._server.retire()
            self._server = None

    def _ready_server(self, *, start: bool = True) -> ForkServer | None:
        """The fork server once it can fork (started at the first call that may `start` it); None while it
        imports, before it is started, or when off."""
        if not self._forking or (self._server is None and not start):
            return None
        if self._server is None:
            if not is_subreaper():
                self._fork_server_off("the supervisor cannot adopt forked processes (not a child subreaper)")
                return None
            try:
                self._server = self._spawn_server()
            except OSError as exc:
                self._fork_server_off(f"cannot start it: {exc}")
                return None
        state = self._server.check()
        if state is False:
            self._fork_server_off(self._server.refused)
        return self._server if state else None

    def _fork_server_off(self, reason: str) -> None:
        self._log.warning("fork_server_off", reason=reason, log=str(self._log_path("fork_server")))
        self._forking = False
        if self._server is not None:
            self._server.retire()
            self._server = None

    def _fork(self, server: ForkServer, rank: int) -> Standby:
        log = self._open_log(f"rank_{rank}")
        try:
            proc, sock = server.fork(log, rank % len(self._envs))
        except OSError:
            if server.refused:
                self._fork_server_off(server.refused)
            raise
        finally:
            os.close(log)
        return Standby(rank, proc, sock, self._argv, ready=True)

    def _spawn_server(self) -> ForkServer:
        first, *others = self._envs.values()
        alike = {key: value for key, value in first.items() if all(env.get(key) == value for env in others)}
        proc, sock = self._popen("fork_server", alike, [FORK_SERVER_FLAG])  # imports see what every rank has
        return ForkServer(proc, sock)

    def _spawn(self, rank: int) -> Standby:
        proc, sock = self._popen(f"rank_{rank}", self._envs[rank], [])
        return Standby(rank, proc, sock, self._argv)

    def _popen(self, name: str, env: dict[str, str], flags: list[str]) -> tuple[subprocess.Popen, socket.socket]:
        ours, theirs = socket.socketpair()
        log = self._open_log(name)
        env = {
            **env,
            ENV_STANDBY_FD: str(theirs.fileno()),
            ENV_SCRIPT: self._argv[0],
            ENV_PREWARM: self._prewarm,
            ENV_DEVICE: self._device,
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "worker.standby", *flags],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(log)
        ours.setblocking(False)
        return proc, ours

    def _open_log(self, name: str) -> int:
        return open_append(self._log_path(name), root=self._layout.root)

    def _log_path(self, name: str) -> Path:
        return self._layout.root / "logs" / f"standby_{name}.log"

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
                f"(see {self._log_path(f'rank_{standby.rank}')})"
            )

    def _fail(self, reason: str) -> None:
        if not self.failed:
            self._log.warning("standbys_off", reason=reason)
        self.failed = True
