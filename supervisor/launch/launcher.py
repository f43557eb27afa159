"""How an attempt's ranks are started, signalled and watched, behind one small interface.

The runner drives a Launcher and the decision core never learns which: `LocalLauncher` runs the ranks as
children of the supervisor on this machine and reads their heartbeat files; `SlurmLauncher` (slurm.py) runs
one node agent per node in a Slurm job step, which does the same on its node and reports over TCP.
Everything a launcher learns reaches the main loop through `post` (the supervisor's inbox).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from supervisor.config import JobConfig
from supervisor.core import (
    ChildExited,
    DeviceVerdict,
    Event,
    Heartbeats,
    HeartbeatSeen,
    LaunchFailed,
    RankState,
    StacksCollected,
)
from supervisor.core.causes import oom_kill_count
from supervisor.launch.gpu_health import gpu_problems, preflight
from supervisor.launch.node_memory import MemoryChoice
from supervisor.launch.nodes import Ledger, device_fault, update_ledger
from supervisor.launch.ranks import Attempt, Ranks, join_early, launch_ranks, publish_unwind, rank_envs
from supervisor.launch.stacks import start_stack_collection
from supervisor.launch.standby import FILL_AFTER_S, Process, Standby, Standbys
from supervisor.launch.trees import descendants, reap_orphans, record_pids, sigkill
from supervisor.rundir.watch import HeartbeatFiles, HeartbeatsChanged, HeartbeatUnreadable, HeartbeatWatcher
from worker.contract import EXIT_FAILED, EXIT_REQUEUE, UNWIND_SIGNAL, RunLayout, StopOrder
from worker.files import atomic_write_json, read_bytes, unlink_quietly

__all__ = ["Isolated", "Launcher", "LocalLauncher", "Spawned", "publish_order"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A launch that failed with one of these may succeed on the next attempt; any other OSError (no such program, not
# executable) fails the run at once.
PASSING_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})
TRACK_INTERVAL_S = 5.0  # the run's processes are recorded (for a successor) and orphans reaped this often
# While an attempt unwinds, its survivors' heartbeats are looked at this often: the watcher's batching (a quarter
# second) would otherwise be most of a recovery in place.
UNWIND_POLL_S = 0.002


@dataclass(frozen=True)
class Spawned:
    """Every rank of `attempt` was started; `pids` in rank order (on another node, as that node sees them)."""

    attempt: int
    pids: tuple[int, ...]
    kept: tuple[int, ...] | None = None  # recovering in place, the ranks whose processes went on
    not_kept: str | None = None  # why the ranks to keep were relaunched after all


@dataclass(frozen=True)
class Isolated:
    """The launcher found the supervisor's own link broken (every remote node silent, the Slurm controller out of
    reach): the supervisor must stop acting and hand over, charging no node."""

    why: str


class Launcher(Protocol):
    """Starts, signals and watches the ranks of one attempt at a time."""

    def start(self) -> None:
        """Begin watching (before the first launch)."""

    def close(self) -> None:
        """Kill whatever is left of the run, ranks included: nothing outlives the supervisor."""

    def hand_over(self) -> None:
        """Stop without killing what a successor may live in: the ranks are fenced by their agents."""

    def prestart(self, attempt: int) -> None:
        """A launch is decided: start what can start before its resume point is chosen (on the main thread)."""

    def await_prestarted(self) -> None:
        """Off the main thread, once the resume point is chosen: wait (bounded) for what `prestart` started and
        the launch will use."""

    def launch(self, attempt: Attempt) -> Spawned | LaunchFailed | None:
        """Start every rank; the outcome now, or None when it will be posted."""

    def signal(self, attempt: int, signum: int, ranks: Collection[int]) -> list[int]:
        """Signal the process group of each of `ranks`; returns those reached."""

    def dump_stacks(
        self,
        attempt: int,
        ranks: tuple[int, ...],
        faulthandler_ranks: tuple[int, ...],
        *,
        collective_failed: bool = False,
    ) -> None:
        """Collect the ranks' stacks and flight recorders; posts StacksCollected with the verdict."""

    def kill_leftovers(self, attempt: int, survivors: Iterable[RankState]) -> None:
        """SIGKILL what is left of an attempt whose ranks exited (their grandchildren)."""

    def publish(self, order: StopOrder | None) -> None:
        """Make the stop order visible to every rank (None: withdraw it)."""

    def unwind(self, attempt: int) -> None:
        """Tell the ranks of `attempt` that it unwinds: its survivors recover in place (worker.recovery)."""

    def translate(self, item: object) -> Sequence[Event | Spawned | Isolated] | None:
        """Core events (or Spawned, or Isolated) for one of this launcher's own inbox items; None when `item` is not
        one."""

    def last_heartbeat(self, rank: int) -> list[Event]:
        """The rank's newest heartbeat, read now (a failed rank's step, fresh)."""

    def poll(self) -> Sequence[Event | Isolated]:
        """Once a second and at `next_deadline`: what the hints may have missed (heartbeats), and liveness."""

    def next_deadline(self) -> float:
        """When (monotonic) `poll` must run next at the latest to keep a deadline of the launcher's own."""

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer struck the ranks since the launch."""

    def details(self) -> dict[str, Any]:
        """Launcher-specific facts for the status file."""

    def charge_device(self, verdict: DeviceVerdict) -> str | None:
        """Charge the node of `verdict`'s rank in the node ledger; why that node is excluded now (None: it is not)."""

    def memory_choice(
        self, world_size: int, *, newer_than: int | None, at_most: int | None, refused: Mapping[int, str]
    ) -> MemoryChoice | None:
        """A memory snapshot newer than disk that the launcher's nodes hold (multi-node runs, node_memory.py); None
        where the supervisor's own resume stores say it all (one machine)."""

    @property
    def launched(self) -> bool:
        """Some attempt's ranks were started (systemd's watchdog waits for that)."""


def publish_order(layout: RunLayout, order: StopOrder | None, log: Any) -> None:
    """Write (or remove) the stop order file every rank polls."""
    if order is None:
        unlink_quietly(layout.stop_order)
        return
    try:
        atomic_write_json(layout.stop_order, asdict(order), root=layout.root)
    except OSError as exc:  # the ranks never hear of it: the stop timeout escalates
        log.error("stop_order_write_failed", error=str(exc))


@dataclass(frozen=True)
class _LeftoversSurvived:
    """Processes still alive `sigkill_wait_s` after SIGKILL (uninterruptible sleep)."""

    attempt: int
    processes: tuple[dict[str, Any], ...]


class LocalLauncher:
    """Ranks as child processes of the supervisor on this machine; heartbeats read from their files."""

    def __init__(self, config: JobConfig, layout: RunLayout, post: Callable[[object], None], log: Any) -> None:
        self._config = config
        self._layout = layout
        self._post = post
        self._log = log
        self._ranks: Ranks | None = None
        self._watcher = HeartbeatWatcher(layout, config.nproc_per_node, post)
        self._beats = HeartbeatFiles(layout)
        self._next_track = 0.0  # when the run's processes are next recorded and orphans reaped
        self._unreadable: set[int] = set()
        self._recorded_pids: set[int] = set()
        self._oom_kills_at_launch: int | None = None  # the cgroup's OOM-kill count when the attempt started
        self._standbys = _standbys(config, layout, log)
        self._launched_at = 0.0
        self._training: set[int] = set()  # ranks of the current attempt that reported a training step
        self._unwinding = False  # the attempt's survivors unwind to recover in place: their beats are looked for
        self._joining: dict[int, Standby] = {}  # replacements started while the survivors unwind, by rank

    def start(self) -> None:
        self._watcher.start()
        self._say_if_excluded()

    def _say_if_excluded(self) -> None:
        """One machine cannot move off itself: a host the run's ledger excludes (a GPU found corrupting results) is
        used anyway, and the journal says so, with how to clear it."""
        host = socket.gethostname()
        with contextlib.suppress(OSError, ValueError):  # an unreadable ledger is the charge's to report
            why = Ledger.load(self._layout).excluded(time.time(), **self._config.slurm.ledger_rules).get(host)
            if why is not None:
                forget = f"trainwarden nodes {self._layout.root} --forget {host}"
                self._log.warning(
                    "host_excluded", node=host, why=why, action=f"running here anyway; once fixed: {forget}"
                )

    def close(self) -> None:
        if self._ranks is not None:
            ranks = self._ranks
            ranks.signal(signal.SIGKILL, only=lambda rank: ranks.procs[rank].poll() is None)
        self._retire_joining()
        if self._standbys is not None:
            self._standbys.close()
        sigkill(descendants())
        self._watcher.stop()

    def hand_over(self) -> None:
        self.close()  # on one machine there is nobody to hand over to

    def prestart(self, attempt: int) -> None:
        """A standby for each rank that has none waiting, spawned now: its Python and imports overlap the choice of
        the resume point (checksums read) and the clean-up of torn saves, which torchrun's restart has not to do.
        Before the first launch, only the fork server: its ranks are forked from its one import."""
        if self._standbys is None or self._unwinding:  # in place: the lost ranks' standbys joined already
            return
        if attempt == 0:
            self._standbys.start_server()
        else:
            self._standbys.fill()

    def await_prestarted(self) -> None:
        if self._standbys is not None:
            self._standbys.await_server()

    def launch(self, attempt: Attempt) -> Spawned | LaunchFailed:
        def on_exit(number: int, rank: int, code: int) -> None:
            self._post(ChildExited(number, rank, code))

        if short := preflight(self._config):  # before every attempt: a GPU may have gone since the last one
            return LaunchFailed(attempt.number, short, retryable=False)
        if problems := gpu_problems():  # relaunching on a GPU that needs a reset fails again: another machine
            self._log.error("gpu_unhealthy", attempt=attempt.number, problems=problems)
            return LaunchFailed(
                attempt.number,
                f"unhealthy GPU on this machine: {'; '.join(problems)}",
                retryable=False,
                exit_code=EXIT_REQUEUE,
            )
        self._unwinding = False
        kept = self._kept(attempt.keep)
        went_on = tuple(sorted(kept.procs)) if kept else ()
        joined = self._joined() if kept else {}
        self._retire_joining()  # a full relaunch: the replacements started for one in place go
        warm = self._take_standbys(skip={*kept.procs, *joined} if kept else set())
        try:
            self._ranks = launch_ranks(self._config, self._layout, attempt, on_exit, warm, kept, joined)
        except OSError as exc:
            for standby in warm.values():  # those not handed a rank yet (the others were killed with the ranks)
                standby.retire()
            passing = exc.errno in PASSING_ERRNOS  # out of processes or memory for now; a missing program stays so
            return LaunchFailed(
                attempt.number,
                f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
                retryable=passing,
                exit_code=None if passing else EXIT_FAILED,
            )
        used = sorted([*joined, *(rank for rank, standby in warm.items() if self._ranks.procs[rank] is standby.proc)])
        if used:
            self._log.info("standbys_used", attempt=attempt.number, ranks=used)
        self._oom_kills_at_launch = _oom_kills()
        self._launched_at, self._training = time.monotonic(), set()
        self._next_track = 0.0  # the new ranks are recorded at the next poll
        pids = tuple(self._ranks.procs[rank].pid for rank in sorted(self._ranks.procs))
        if not attempt.keep:
            return Spawned(attempt.number, pids)
        return Spawned(attempt.number, pids, went_on, None if kept else "the ranks to keep died before the launch")

    @property
    def launched(self) -> bool:
        return self._ranks is not None

    def signal(self, attempt: int, signum: int, ranks: Collection[int]) -> list[int]:
        if signum == signal.SIGTERM:  # the attempt is stopped (an unwind timed out, a stop): no recovery in place
            self._unwinding = False
        if self._ranks is None or self._ranks.attempt != attempt:
            return []
        return self._ranks.signal(signum, only=ranks.__contains__)

    def dump_stacks(
        self,
        attempt: int,
        ranks: tuple[int, ...],
        faulthandler_ranks: tuple[int, ...],
        *,
        collective_failed: bool = False,
    ) -> None:
        if self._ranks is None or self._ranks.attempt != attempt:
            self._post(StacksCollected(attempt, ()))
            return
        pids = {rank: self._ranks.procs[rank].pid for rank in ranks}
        start_stack_collection(
            self._layout,
            attempt,
            pids,
            faulthandler_ranks,
            self._post,
            ranks=tuple(self._ranks.procs),
            collective_failed=collective_failed,
        )

    def kill_leftovers(self, attempt: int, survivors: Iterable[RankState]) -> None:
        """SIGKILL every descendant that is not a rank leader or a standby; report (from a thread) any that survives."""
        managed = self._managed()
        for rank in survivors:  # survived SIGKILL
            with contextlib.suppress(psutil.Error):
                status = psutil.Process(rank.pid).status()
                self._log.error("rank_unkillable", rank=rank.rank, pid=rank.pid, status=status)
        hit = sigkill(p for p in descendants() if p.pid not in managed)
        if hit:
            self._log.warning("leftovers_killed", attempt=attempt, pids=[p.pid for p in hit])
            threading.Thread(target=self._await_leftovers, args=(attempt, hit), daemon=True).start()

    def _await_leftovers(self, attempt: int, procs: list[psutil.Process]) -> None:
        _, alive = psutil.wait_procs(procs, timeout=self._config.stop.sigkill_wait_s)
        survivors = []
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                survivors.append({"pid": proc.pid, "name": proc.name(), "status": proc.status()})
        if survivors:
            self._post(_LeftoversSurvived(attempt, tuple(survivors)))

    def publish(self, order: StopOrder | None) -> None:
        publish_order(self._layout, order, self._log)

    def unwind(self, attempt: int) -> None:
        """The word in the run dir, then UNWIND_SIGNAL to each survivor's leader (not its group: a DataLoader's
        workers are not the training function); a standby starts the script for each rank that is gone, to wait for
        the next attempt beside the survivors."""
        publish_unwind(self._layout, attempt)
        self._unwinding = True
        if self._ranks is None or self._ranks.attempt != attempt:
            return
        for rank, proc in self._ranks.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, UNWIND_SIGNAL)
            elif rank not in self._joining:
                self._join_early(attempt, rank)

    def translate(self, item: object) -> list[Event] | None:
        if isinstance(item, HeartbeatsChanged):
            return self._read_heartbeats(sorted(self._watcher.take()))
        if isinstance(item, _LeftoversSurvived):
            self._log.error("process_unkillable", attempt=item.attempt, processes=item.processes)
            return []
        return None

    def last_heartbeat(self, rank: int) -> list[Event]:
        return self._read_heartbeats([rank])

    def poll(self) -> list[Event]:
        if self._unwinding:  # every few ms, and on the way to the next attempt: the survivors' beats only
            return self._read_heartbeats(range(self._config.nproc_per_node))
        if time.monotonic() >= self._next_track:
            self._next_track = time.monotonic() + TRACK_INTERVAL_S
            self._track_processes()
        events = self._read_heartbeats(range(self._config.nproc_per_node))
        self._refill_standbys()
        return events

    def next_deadline(self) -> float:
        return time.monotonic() + UNWIND_POLL_S if self._unwinding else math.inf  # heartbeat deadlines: the core's

    def oom_killed(self) -> bool:
        before, now = self._oom_kills_at_launch, _oom_kills()
        return before is not None and now is not None and now > before

    def details(self) -> dict[str, Any]:
        policy = {"node_policy": dict(self._config.slurm.ledger_rules)}  # for `trainwarden nodes` (verdicts here)
        if self._standbys is None:
            return policy
        return {**policy, "standbys_ready": 0 if self._standbys.failed else self._standbys.ready()}

    def memory_choice(
        self, world_size: int, *, newer_than: int | None, at_most: int | None, refused: Mapping[int, str]
    ) -> MemoryChoice | None:
        return None  # one machine: the supervisor's resume stores include the memory tier

    def charge_device(self, verdict: DeviceVerdict) -> str | None:
        """This machine's entry in the node ledger: kept for `trainwarden nodes`, `status` and the next start."""
        node = verdict.node or socket.gethostname()
        fault = device_fault(verdict, node, time.time())
        try:
            ledger = update_ledger(self._layout, lambda ledger: ledger.charged(fault))
        except (OSError, ValueError) as exc:
            self._log.error("node_ledger_write_failed", error=str(exc))
            ledger = Ledger((fault,))  # the verdict still holds for this run
        return ledger.excluded(time.time(), **self._config.slurm.ledger_rules).get(node)

    def _kept(self, keep: tuple[int, ...]) -> Ranks | None:
        """The failed attempt's ranks to go on in place: those of `keep` still alive (one that died since is
        started anew with the others)."""
        return None if not keep or self._ranks is None else self._ranks.keep(keep)

    def _join_early(self, attempt: int, rank: int) -> None:
        standby = self._standbys.take(rank) if self._standbys is not None else None
        if standby is not None and join_early(self._config, self._layout, attempt, rank, standby):
            self._joining[rank] = standby
            self._log.info("replacement_started", attempt=attempt, rank=rank, pid=standby.proc.pid)

    def _joined(self) -> dict[int, Process]:
        """The replacements started while the survivors unwound that are still alive (they join the new attempt)."""
        alive = {rank: standby for rank, standby in self._joining.items() if standby.proc.poll() is None}
        for rank in alive:
            del self._joining[rank]
        return {rank: standby.proc for rank, standby in alive.items()}

    def _retire_joining(self) -> None:
        for standby in self._joining.values():
            standby.retire()
        self._joining.clear()

    def _take_standbys(self, skip: Collection[int]) -> dict[int, Standby]:
        if self._standbys is None:
            return {}
        taken = {rank: self._standbys.take(rank) for rank in range(self._config.nproc_per_node) if rank not in skip}
        return {rank: standby for rank, standby in taken.items() if standby is not None}

    def _refill_standbys(self) -> None:
        """Once the attempt trains (every rank past a step, or FILL_AFTER_S), so standbys never slow its start."""
        if self._standbys is None or self._ranks is None or not self._config.standby.keep_warm:
            return
        if len(self._training) == self._config.nproc_per_node or time.monotonic() - self._launched_at > FILL_AFTER_S:
            self._standbys.fill()

    def _managed(self) -> set[int]:
        """Processes with an owner of their own: rank leaders (their waiters) and standbys (the pool)."""
        ranks = self._ranks.pids if self._ranks else set()
        joining = {standby.proc.pid for standby in self._joining.values()}
        return ranks | joining | (self._standbys.pids if self._standbys else set())

    def _track_processes(self) -> None:
        """Record the run's processes for a successor, and reap adopted orphans."""
        procs = descendants()  # one look through /proc serves both
        reap_orphans(procs, self._managed())
        pids = {proc.pid for proc in procs}
        if pids != self._recorded_pids:
            self._recorded_pids = pids
            try:
                record_pids(self._layout, procs)
            except OSError as exc:
                self._log.error("pids_write_failed", error=str(exc))

    def _read_heartbeats(self, ranks: Iterable[int]) -> list[Event]:
        """One Heartbeats event for the ranks' new records (none when there is none)."""
        beats: list[HeartbeatSeen] = []
        for rank in ranks:
            try:
                seen = self._beats.read(rank)
            except HeartbeatUnreadable as exc:
                if rank not in self._unreadable:  # say it once per streak, not every second
                    self._log.warning("heartbeat_unreadable", rank=rank, error=str(exc))
                self._unreadable.add(rank)
                continue
            self._unreadable.discard(rank)
            if seen is not None:
                beats.append(seen)
                if self._ranks is not None and seen.attempt == self._ranks.attempt and seen.phase == "train":
                    self._training.add(rank)
        return [Heartbeats(tuple(beats))] if beats else []


def _standbys(config: JobConfig, layout: RunLayout, log: Any) -> Standbys | None:
    """A pool of standby ranks where they can be used: a `script:` job, standbys enabled."""
    if not config.standby.enabled or config.script is None:
        return None
    placeholder = Attempt(0)  # the per-attempt variables are left out of a standby's environment anyway
    return Standbys(config, layout, rank_envs(config, layout, placeholder, port=0), log)


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in our cgroup (the ranks are in it): cgroup v2's
    memory.events or v1's memory.oom_control; None where neither can be read (then no kill is called OOM)."""
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for entry in entries:  # "ID:CONTROLLERS:PATH"; v2 is "0::PATH"
        parts = entry.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, relative = parts[1], parts[2].lstrip("/")
        if controllers == "":
            candidates += [CGROUP_ROOT / base / relative / "memory.events" for base in ("", "unified")]
        elif "memory" in controllers.split(","):
            candidates.append(CGROUP_ROOT / "memory" / relative / "memory.oom_control")
    for candidate in candidates:
        try:
            kills = oom_kill_count(read_bytes(candidate, 4096).decode("ascii", errors="replace"))
        except OSError:
            continue
        if kills is not None:
            return kills
    return None
