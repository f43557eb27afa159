"""Rank processes: launch with a torchrun-compatible environment, one process group each, and signal them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.config import JobConfig
from supervisor.trees import die_with_parent
from worker.contract import (
    ENV_ATTEMPT,
    ENV_RESUME_DIR,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_SKIP_TO_BATCH,
    ENV_WORKER_CONFIG,
    RunLayout,
)
from worker.files import open_append

__all__ = ["Ranks", "free_port", "launch_ranks", "rank_argv"]

# Never handed to ranks: a rank must not talk to systemd as if it were the service.
_WITHHELD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass
class Ranks:
    """The rank processes of one attempt."""

    attempt: int
    procs: list[subprocess.Popen]

    def signal(self, signum: int, only: Callable[[int], bool]) -> list[int]:
        """Send `signum` to the process group of each rank for which `only(rank)` holds; returns those ranks."""
        sent = []
        for rank, proc in enumerate(self.procs):
            if not only(rank):
                continue
            try:
                os.killpg(proc.pid, signum)  # the rank leader's pid is its group id
                if signum == signal.SIGTERM:
                    os.killpg(proc.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) rank must be able to act on it
                sent.append(rank)
            except ProcessLookupError:
                pass
        return sent

    @property
    def pids(self) -> set[int]:
        return {proc.pid for proc in self.procs}


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_argv(config: JobConfig) -> list[str]:
    if config.script is not None:
        return [sys.executable, "-u", config.script, *config.args]
    assert config.command is not None
    return [*config.command, *config.args]


def rank_env(config: JobConfig, layout: RunLayout, *, rank: int, attempt: int, port: int,
             resume_step: int | None, resume_dir: Path | None = None,
             skip_to_batch: int | None = None) -> dict[str, str]:
    """The environment torchrun would give this rank, plus trainwarden's contract variables."""
    env = {k: v for k, v in os.environ.items() if k not in _WITHHELD_ENV}
    env.update(config.env)
    n = config.nproc_per_node
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "ROLE_WORLD_SIZE": str(n),
        "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(config.restart.max_restarts),
        ENV_RUN_DIR: str(layout.root), ENV_ATTEMPT: str(attempt),
        ENV_RESUME_STEP: "" if resume_step is None else str(resume_step),
        ENV_RESUME_DIR: "" if resume_dir is None else str(resume_dir),
        ENV_WORKER_CONFIG: config.worker.to_env(),
        ENV_SKIP_TO_BATCH: "" if skip_to_batch is None else str(skip_to_batch),
    })
    return env


def launch_ranks(config: JobConfig, layout: RunLayout, *, attempt: int, resume_step: int | None,
                 resume_dir: Path | None, skip_to_batch: int | None,
                 on_exit: Callable[[int, int, int], None]) -> Ranks:
    """Start every rank in its own session; a waiter thread per rank reports `on_exit(attempt, rank, code)`.

    If any rank fails to start, the ones already started are killed and the error is raised.
    """
    port = free_port(config.master_addr)
    argv = rank_argv(config)
    ranks = Ranks(attempt, [])
    try:
        for rank in range(config.nproc_per_node):
            env = rank_env(config, layout, rank=rank, attempt=attempt, port=port, resume_step=resume_step,
                           resume_dir=resume_dir, skip_to_batch=skip_to_batch)
            ranks.procs.append(_spawn(argv, env, layout, attempt, rank))
    except BaseException:
        ranks.signal(signal.SIGKILL, only=lambda _: True)
        for proc in ranks.procs:
            proc.wait(timeout=10)
        raise
    for rank, proc in enumerate(ranks.procs):
        threading.Thread(target=_wait, args=(proc, attempt, rank, on_exit), daemon=True,
                         name=f"wait-a{attempt}-r{rank}").start()
    return ranks


def _spawn(argv: list[str], env: dict[str, str], layout: RunLayout, attempt: int, rank: int) -> subprocess.Popen:
    with contextlib.ExitStack() as logs:
        out, err = (logs.enter_context(os.fdopen(open_append(layout.attempt_log(attempt, rank, stream),
                                                             root=layout.root), "ab")) for stream in ("out", "err"))
        # start_new_session: the rank leads its own process group, so killpg reaches its whole tree;
        # die_with_parent: a SIGKILLed supervisor takes its ranks along.
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, preexec_fn=die_with_parent)


def _wait(proc: subprocess.Popen, attempt: int, rank: int, on_exit: Callable[[int, int, int], None]) -> None:
    on_exit(attempt, rank, proc.wait())
