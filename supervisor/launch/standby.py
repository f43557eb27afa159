"""Warm standby ranks: one waiting process per local rank, so a relaunch skips Python's start and `import torch`.

A standby (worker/standby.py) is spawned like a rank (its own session, killed with the supervisor, pids recorded
for a successor), never forked from a process that has started torch's threads. It gets the rank's environment
less the variables only an attempt knows (`PER_ATTEMPT`), imports torch and the configured modules, then waits on
a socket. A relaunch hands each rank's standby the attempt's environment and the rank's log files; a rank whose
standby is gone starts cold. The pool is refilled once the new attempt trains, so standbys never compete with the
ranks' own start-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from supervisor.config import JobConfig
from supervisor.launch.trees import die_with_parent
from worker.contract import ENV_ATTEMPT, ENV_FAILURES, ENV_RESUME_DIR, ENV_RESUME_STEP, ENV_SKIP_TO_BATCH, RunLayout
from worker.files import open_append
from worker.standby import ENV_PREWARM, ENV_SCRIPT, ENV_STANDBY_FD, READY, activate_message

__all__ = ["PER_ATTEMPT", "Standby", "Standbys"]

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
_ORDER = b"A"


@dataclass
class Standby:
    """One waiting process and the supervisor's end of its socket."""

    rank: int
    proc: subprocess.Popen
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

    def fill(self) -> None:
        """Spawn the missing standbys. Call from the main thread: a child's parent-death signal is tied to the
        thread that spawned it."""
        self._drop_dead()
        for rank in self._envs:
            if rank not in self._pool and not self.failed:
                try:
                    self._pool[rank] = self._spawn(rank)
                except OSError as exc:
                    self._fail(f"cannot start a standby for rank {rank}: {exc}")

    def take(self, rank: int) -> Standby | None:
        """The rank's standby while it lives (it leaves the pool). One still importing is taken too: it runs the
        script as soon as its imports are done, still ahead of a process started now."""
        standby = self._pool.pop(rank, None)
        if standby is None:
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

    def _spawn(self, rank: int) -> Standby:
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
                preexec_fn=die_with_parent,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(log)
        ours.setblocking(False)
        return Standby(rank, proc, ours, self._argv)

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
