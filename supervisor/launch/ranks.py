"""Rank processes: launch with a torchrun-compatible environment, one process group each, and signal them."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from supervisor.config import JobConfig
from supervisor.launch.standby import PER_ATTEMPT, Process, Standby
from supervisor.launch.trees import die_with_parent
from worker.contract import (
    ENV_ATTEMPT,
    ENV_FAILURES,
    ENV_IN_PLACE,
    ENV_JOIN_AFTER,
    ENV_MEMORY_DIR,
    ENV_RESUME_DIR,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_SKIP_TO_BATCH,
    ENV_WORKER_CONFIG,
    RunLayout,
    failures_env,
)
from worker.files import atomic_write_json, open_append, unlink_quietly

__all__ = [
    "Attempt",
    "Placement",
    "Ranks",
    "contract_env",
    "join_early",
    "free_port",
    "launch_ranks",
    "local_env",
    "publish_next",
    "publish_unwind",
    "rank_argv",
    "rank_envs",
    "signal_group",
    "spawn_ranks",
]

# Never handed to ranks: a rank must not talk to systemd as if it were the service.
_WITHHELD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True)
class Attempt:
    """What every rank of one attempt is told: which attempt, and where to resume from."""

    number: int
    resume_step: int | None = None
    resume_dir: Path | None = None
    skip_to_batch: int | None = None
    failures: tuple[int, float] | None = None  # the run's failures so far and its wall time (worker.cadence)
    keep: tuple[int, ...] = ()  # ranks whose processes recover in place into this attempt (worker.recovery)


@dataclass(frozen=True)
class Placement:
    """Where one rank sits in the job, in torchrun's numbering: GROUP_RANK is the node's index."""

    rank: int
    local_rank: int
    group_rank: int
    world_size: int
    local_world_size: int


@dataclass
class Ranks:
    """The rank processes of one attempt on this machine, by global rank."""

    attempt: int
    procs: dict[int, Process]

    def signal(self, signum: int, only: Callable[[int], bool]) -> list[int]:
        """Send `signum` to the process group of each rank for which `only(rank)` holds; returns those ranks."""
        return [rank for rank, proc in self.procs.items() if only(rank) and signal_group(proc.pid, signum)]

    @property
    def pids(self) -> set[int]:
        return {proc.pid for proc in self.procs.values()}

    def keep(self, ranks: Collection[int]) -> Ranks | None:
        """These ranks, of those still alive, to go on in place into the next attempt (one that died since starts
        anew with the others): self, holding only them; None when none is left."""
        alive = {rank: proc for rank, proc in self.procs.items() if rank in ranks and proc.poll() is None}
        if not alive:
            return None
        self.procs = alive
        return self


def signal_group(leader: int, signum: int) -> bool:
    """Signal a rank's process group (the leader's pid is its id); False when it is gone."""
    try:
        os.killpg(leader, signum)
        if signum == signal.SIGTERM:
            os.killpg(leader, signal.SIGCONT)  # a frozen (SIGSTOPped) rank must be able to act on it
        return True
    except ProcessLookupError:
        return False


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


def contract_env(
    config: JobConfig, layout: RunLayout, place: Placement, attempt: Attempt, *, master_addr: str, port: int
) -> dict[str, str]:
    """The variables torchrun would set for this rank, trainwarden's contract variables, the config's `env:`, and
    the collective settings (`collective_env`)."""
    return {
        **collective_env(config, layout, place.rank, attempt.number),
        **config.env,
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "GROUP_RANK": str(place.group_rank),
        "ROLE_RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt.number),
        "TORCHELASTIC_MAX_RESTARTS": str(config.restart.max_restarts),
        # torchrun's too: frameworks take it as "launched for us" (Lightning then reads the ranks from these variables,
        # not from SLURM_PROCID, and leaves Slurm's signals and requeueing to the supervisor).
        "TORCHELASTIC_RUN_ID": f"trainwarden-{layout.root.name}",
        ENV_RUN_DIR: str(layout.root),
        ENV_ATTEMPT: str(attempt.number),
        ENV_RESUME_STEP: "" if attempt.resume_step is None else str(attempt.resume_step),
        ENV_RESUME_DIR: "" if attempt.resume_dir is None else str(attempt.resume_dir),
        ENV_WORKER_CONFIG: config.worker.to_env(),
        ENV_SKIP_TO_BATCH: "" if attempt.skip_to_batch is None else str(attempt.skip_to_batch),
        ENV_FAILURES: "" if attempt.failures is None else failures_env(*attempt.failures),
        # Empty without a memory tier here (a node's agent sets its own): nothing inherited passes for ours.
        ENV_MEMORY_DIR: "" if layout.memory is None else str(layout.memory),
        ENV_IN_PLACE: "1" if config.in_place is None else "",  # worker.run recovers in place
    }


def collective_env(config: JobConfig, layout: RunLayout, rank: int, attempt: int) -> dict[str, str]:
    """PyTorch's flight recorder and NCCL's error handling, where this machine's environment does not set them (the
    config's `env:` overrides both). Why each: docs/hangs.md."""
    hang = config.hang
    longest = max([*hang.phase_timeouts_s.values(), hang.default_timeout_s, hang.first_heartbeat_s])
    settings = {
        "TORCH_FR_BUFFER_SIZE": str(hang.flight_recorder),  # what the culprit is named from
        # A failed or timed-out collective ends the process, no cleanup; recovering in place, it aborts the
        # communicator and raises, so the process can unwind (worker.recovery).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2" if config.in_place is None else "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1" if hang.flight_recorder else "0",  # NCCL's own dump at its timeout
        "TORCH_NCCL_ENABLE_TIMING": "1" if hang.flight_recorder else "0",  # start states: a stuck device's rank
        "TORCH_FR_DUMP_TEMP_FILE": str(layout.rank_dir(rank) / f"nccl_trace_attempt_{attempt}_rank_"),
        # NCCL's watchdog monitor must not end a rank before trainwarden has declared the hang and taken evidence.
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(math.ceil(longest + hang.stacks_timeout_s + config.stop.kill_grace_s)),
    }
    return {key: value for key, value in settings.items() if key not in os.environ}


def local_env(contract: dict[str, str]) -> dict[str, str]:
    """This machine's environment (less what is only the service's) with the contract variables over it."""
    return {**{k: v for k, v in os.environ.items() if k not in _WITHHELD_ENV}, **contract}


def rank_envs(config: JobConfig, layout: RunLayout, attempt: Attempt, port: int) -> dict[int, dict[str, str]]:
    """Every rank's environment on this machine, by rank."""
    n = config.nproc_per_node
    return {
        rank: local_env(
            contract_env(
                config, layout, Placement(rank, rank, 0, n, n), attempt, master_addr=config.master_addr, port=port
            )
        )
        for rank in range(n)
    }


def launch_ranks(
    config: JobConfig,
    layout: RunLayout,
    attempt: Attempt,
    on_exit: Callable[[int, int, int], None],
    standbys: Mapping[int, Standby] | None = None,
    kept: Ranks | None = None,
    joined: Mapping[int, Process] | None = None,
) -> Ranks:
    """Start every rank on this machine in its own session (in `standbys`' processes where given); a waiter thread
    per rank reports `on_exit(attempt, rank, code)`. If any rank fails to start, the ones started are killed and the
    error raised. `kept`: the failed attempt's ranks whose processes recover in place (those alive of
    `attempt.keep`) are told the new attempt's variables instead, and go on in it; so are the replacements that
    `joined` it while they unwound (`join_early`)."""
    envs = rank_envs(config, layout, attempt, free_port(config.master_addr))
    if kept is None:
        unlink_quietly(layout.recovery)
    else:
        publish_next(layout, kept.attempt, attempt.number, envs[min(kept.procs)])
        envs = {rank: env for rank, env in envs.items() if rank not in kept.procs and rank not in (joined or {})}
    return spawn_ranks(rank_argv(config), envs, layout, attempt.number, on_exit, standbys, kept, joined)


def join_early(config: JobConfig, layout: RunLayout, failed: int, rank: int, standby: Standby) -> bool:
    """Run the script in `standby` for `rank`, lost in attempt `failed`, while the survivors unwind: like them it
    waits for the next attempt's variables (worker.recovery) and then trains; False when the standby is gone."""
    env = {k: v for k, v in rank_envs(config, layout, Attempt(failed), port=0)[rank].items() if k not in PER_ATTEMPT}
    return _activate(standby, {**env, ENV_JOIN_AFTER: str(failed)}, layout, failed + 1, rank)


def publish_unwind(layout: RunLayout, attempt: int) -> None:
    """Tell the ranks that `attempt` unwinds (worker.recovery: with NCCL, each aborts its communicators)."""
    atomic_write_json(layout.recovery, {"unwind": attempt}, root=layout.root, durable=False)


def publish_next(layout: RunLayout, unwound: int, attempt: int, env: Mapping[str, str]) -> None:
    """The next attempt's number and its variables, for the ranks that recover in place."""
    order = {"unwind": unwound, "next": attempt, "env": {key: env[key] for key in PER_ATTEMPT if key in env}}
    atomic_write_json(layout.recovery, order, root=layout.root, durable=False)


def spawn_ranks(
    argv: list[str],
    envs: dict[int, dict[str, str]],
    layout: RunLayout,
    attempt: int,
    on_exit: Callable[[int, int, int], None],
    standbys: Mapping[int, Standby] | None = None,
    kept: Ranks | None = None,
    joined: Mapping[int, Process] | None = None,
) -> Ranks:
    """Start one process per rank (`envs`: global rank -> its environment), then a waiter thread for each; the
    `kept` ranks' processes go on into `attempt` beside them (their waiters report its number from now on), and
    the `joined` ones (already started) get their waiters."""
    ranks = Ranks(attempt, {}) if kept is None else kept
    ranks.attempt = attempt
    ranks.procs.update(joined or {})
    started: list[int] = list(joined or {})
    try:
        for rank, env in envs.items():
            ranks.procs[rank] = _spawn(argv, env, layout, attempt, rank, (standbys or {}).get(rank))
            started.append(rank)
    except BaseException:
        ranks.signal(signal.SIGKILL, only=lambda _: True)
        for proc in ranks.procs.values():
            proc.wait(timeout=10)
        raise
    for rank in started:
        threading.Thread(
            target=_wait, args=(ranks, rank, on_exit), daemon=True, name=f"wait-a{attempt}-r{rank}"
        ).start()
    return ranks


@contextlib.contextmanager
def _attempt_logs(layout: RunLayout, attempt: int, rank: int) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """The rank's stdout and stderr files of the attempt, open for appending (closed here once handed over)."""
    with contextlib.ExitStack() as logs:
        out, err = (
            logs.enter_context(os.fdopen(open_append(layout.attempt_log(attempt, rank, name), root=layout.root), "ab"))
            for name in ("out", "err")
        )
        yield out, err


def _activate(standby: Standby, env: dict[str, str], layout: RunLayout, attempt: int, rank: int) -> bool:
    with _attempt_logs(layout, attempt, rank) as (out, err):
        return standby.activate(env, out.fileno(), err.fileno())


def _spawn(
    argv: list[str], env: dict[str, str], layout: RunLayout, attempt: int, rank: int, standby: Standby | None
) -> Process:
    if standby is not None and _activate(standby, env, layout, attempt, rank):
        return standby.proc
    with _attempt_logs(layout, attempt, rank) as (out, err):
        # start_new_session: the rank leads its own process group, so killpg reaches its whole tree;
        # die_with_parent: a SIGKILLed supervisor (or node agent) takes its ranks along.
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _wait(ranks: Ranks, rank: int, on_exit: Callable[[int, int, int], None]) -> None:
    """Report the rank's exit, in the attempt it is in when it exits (recovering in place, a later one)."""
    proc, started_in = ranks.procs[rank], ranks.attempt
    code = proc.wait()
    on_exit(ranks.attempt if ranks.procs.get(rank) is proc else started_in, rank, code)
