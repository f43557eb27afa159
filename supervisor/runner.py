"""The supervisor's main loop: one thread owns the state; waiters, the file observer and signals only enqueue."""

from __future__ import annotations

import fcntl
import math
import os
import queue
import signal
import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import psutil

from supervisor.config import JobConfig
from supervisor.core import (
    Action,
    ChargeDevice,
    CheckpointRefusal,
    ChildExited,
    DeviceExcluded,
    DeviceVerdictSeen,
    DumpStacks,
    Event,
    Heartbeats,
    HeartbeatSeen,
    KillLeftovers,
    LaunchFailed,
    LaunchRanks,
    Phase,
    PublishStopOrder,
    PublishUnwind,
    RanksLaunched,
    Record,
    SignalRanks,
    SignalReceived,
    Started,
    State,
    StopRequested,
    Then,
    Tick,
    decide,
    initial_state,
    next_deadline,
)
from supervisor.core.causes import explain
from supervisor.core.decide import ends_at
from supervisor.core.devices import PERSISTENT, TRANSIENT
from supervisor.core.stop_requests import MAX_STOP_FILE_BYTES, StopFileUnparsable, parse_stop_file
from supervisor.launch.launcher import Isolated, Launcher, LocalLauncher, Spawned
from supervisor.launch.node_memory import resume_store
from supervisor.launch.nodes import Ledger
from supervisor.launch.ranks import Attempt
from supervisor.launch.time_limit import TimeLimitWatch
from supervisor.launch.trees import become_subreaper, kill_predecessor_leftovers
from supervisor.observe.goodput import Goodput
from supervisor.observe.metrics import MetricsExporter
from supervisor.observe.notify import Notifier, ServiceReporter
from supervisor.observe.progress import Counts, Observer, Progress
from supervisor.observe.status import StatusError, read_history, read_status, snapshot, write_status
from supervisor.observe.stragglers import Stragglers
from supervisor.rundir.checkpoints import find_junk, rotation, write_health_file
from supervisor.rundir.journal import Journal
from supervisor.rundir.lease import ABDICATED, RELEASED, Lease, LeaseHolder, LeaseLost, read_relayed_signal
from supervisor.rundir.persist import Persister, memory_status, newest_memory_snapshot
from supervisor.rundir.rank_logs import (
    abort_info,
    count,
    device_verdict,
    device_verdicts,
    last_event,
    last_step,
    stderr_tail,
)
from supervisor.rundir.watch import HeartbeatUnreadable, StopFileChanged, StopFileWatcher, read_heartbeat
from worker.contract import (
    EXIT_ANOMALY,
    EXIT_BAD_DEVICE,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_FAILED,
    RunLayout,
    named_store,
    resume_stores,
)
from worker.files import DIR_MODE, open_in, open_regular, unlink_quietly
from worker.manifest import remove_sharded
from worker.memory import create_memory_dir, memory_dir_for, remove_memory_dir
from worker.store import (
    MEMORY_LABEL,
    Choice,
    WorldSizeMismatch,
    choose_explicit,
    choose_resume,
    completed_at,
    health_entries,
    newest_complete,
    parse_checkpoint_name,
    passed_over_event,
    world_size_mismatch,
    world_sizes,
)

__all__ = ["LauncherFactory", "RunDirBusy", "Supervisor", "lock_run_dir"]

AGENT_COPY_SETTLED_S = 120.0  # a torn temporary younger than this may be a node agent's copy under way

POLL_INTERVAL_S = 1.0  # re-read heartbeats and the stop file, and refresh the state file, this often
# The next deadline walks every rank: after heartbeats alone (which only move a rank's deadline) it is worked out
# again at most this often, so thousands of ranks cost one walk per this, not one per event.
DEADLINE_REFRESH_S = 0.5
STATUS_SHARE = 0.02  # of the supervisor's CPU time, at most, goes to the state file and what is published with it
MAX_LOGGED_CHARS = 500  # of a path or error a rank logged, as it reaches the journal and the status
STOP_FILE_SETTLE_S = 0.2  # a stop file younger than this may be mid-write (`echo 500 > stop` truncates first)
# Phases in which no rank can save for a stop: a stop then ends the run at its newest complete state.
NO_RANK_SAVES = (Phase.STARTING, Phase.BACKOFF, Phase.STOPPING)
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # USR1: Slurm's time-limit warning
# (config, layout, post, log) -> the launcher that starts and watches the ranks
LauncherFactory = Callable[[JobConfig, RunLayout, Callable[[object], None], Any], Launcher]


@dataclass(frozen=True)
class LaunchPrepared:
    """The resume point for `action`, chosen (checksums verified) off the main loop."""

    action: LaunchRanks
    choice: Choice


class RunDirBusy(Exception):
    """Another supervisor holds the run dir."""


def lock_run_dir(layout: RunLayout) -> IO[str]:
    """Hold an exclusive lock on the run dir for this process's lifetime: one supervisor per run."""
    layout.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    lock = os.fdopen(open_in(layout.lock_file, os.O_RDWR | os.O_CREAT, root=layout.root), "r+", errors="replace")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read(32).strip()  # bounded: the file is in the run dir, anyone may have written it
        lock.close()
        raise RunDirBusy(
            f"{layout.root} is already supervised by pid {holder if holder.isdigit() else 'unknown'}"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


class Supervisor:
    """Runs one job to its end and returns the exit code."""

    def __init__(
        self,
        config: JobConfig,
        layout: RunLayout,
        journal: Journal,
        *,
        config_path: str,
        ignore_stop_file: bool = False,
        launcher: LauncherFactory = LocalLauncher,
        lease: Lease | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.stop_file = config.stop_file(layout)
        self._ignore_stop_file = ignore_stop_file
        self._stop_file_seen: tuple[int, ...] | None = None  # the write of the stop file acted on last
        self.log = journal.log
        self.layout = layout = self._with_memory_tier(layout)
        # Disk checkpoints from the memory tier: pinned snapshots copied to the checkpoint store off the main loop.
        self._persister = (
            None
            if layout.memory is None
            else Persister(
                layout, config.world_size, config.worker.prefix, self.log, persist_mb_s=config.worker.persist_mb_s
            )
        )
        self._memory_removed = False
        self._memory_health_seen: int | None = None  # the memory snapshot health_ckpts.json lists
        self._disk_health: list[dict[str, Any]] = []  # the disk checkpoints it lists
        self._memory_health: list[dict[str, Any]] = []  # and the newest memory snapshot's entry, if any
        self._memory_status: dict[str, Any] | None = None  # the memory block as last looked at
        previous = _previous_status(layout)  # what a supervisor of this run dir before us knew
        gaps = _previous_step_gaps(previous, config.hang.calibration.window)
        self.state: State = initial_state(config.policy(), step_gaps=gaps, history=read_history(previous))
        self._config_path = config_path
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lease = None if lease is None else LeaseHolder(layout, lease, self._inbox.put_nowait)
        self.handed_over: str | None = None  # why this supervisor stopped acting for the run (another may act)
        self._abdicate = False  # it found itself cut off: its lease is free for a successor at once
        self._relayed: str | None = None  # the id of the last signal the batch process relayed to us
        self._launcher = launcher(config, layout, self._inbox.put_nowait, self.log)
        self._launching: LaunchPrepared | None = None  # what the ranks being started resume from
        self._stop_watcher = StopFileWatcher(self.stop_file, self._inbox.put_nowait)
        # Inside a Slurm job: its end time, read now and then (a successor gets no time-limit warning of its own).
        self._time_limit = TimeLimitWatch.in_job(config.slurm.time_limit_margin_s, self._inbox.put_nowait, self.log)
        self._next_poll = 0.0
        self._next_status = 0.0  # the state file is written at a Tick once this has passed
        self._deadline: tuple[float, float | None] | None = None  # (worked out when, next_deadline) while valid
        self._started_at = time.time()
        self._health_seen: list[int] | None = None  # complete checkpoints when health and rotation were last done
        self._health_steps: list[int] = []  # those of them this world size wrote, less the rotated ones
        self._reported_junk: set[Any] = set()
        self._systemd = ServiceReporter(Notifier.from_environ(log=self.log))  # a no-op outside systemd
        # Bookkeeping beside the core: it never decides anything.
        self._observers: list[Observer] = [Progress(), Counts(previous)]  # counts carried over
        started = time.monotonic() - _process_age()  # a stopwatch starts with the command
        job = os.environ.get("SLURM_JOB_ID")  # a requeued job runs again under its own id
        beat = _last_beat(layout, previous, config.world_size)  # a predecessor that died heard up to about there
        self._predecessor_heard = beat
        self._goodput = Goodput(previous, wall_now=time.time(), process_started=started, job=job, last_beat=beat)
        self._observers.append(self._goodput)  # carried over
        self._observers.append(Stragglers(config.stragglers))
        self.status_listeners: list[Callable[[dict[str, Any]], None]] = []  # shown each status, once it is written
        self._metrics = MetricsExporter(config.metrics, self.log)  # opt-in: off, it costs one check per status
        self.status_listeners.append(self._metrics.publish)
        self._newest_checkpoint: tuple[int, float | None] | None = None  # (step, when it was completed)
        # rank -> (its newest beat's seq, the transient verdicts its process counted by then)
        self._transients: dict[int, tuple[int, int]] = {}
        self._devices = _device_verdicts(layout)  # the run's verdicts on devices, from the ledger: `status` shows them

    def run(self) -> int | None:
        """Supervise until the run finishes, fails or is stopped (its exit code), or until this supervisor must
        stop acting for it (None: `handed_over` says why; a successor may carry on)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in HANDLED_SIGNALS}
        if self._lease is not None:
            self._lease.start()
        self._launcher.start()
        if self._persister is not None:
            self._persister.start()
        self._stop_watcher.start()
        if self._time_limit is not None:
            self._time_limit.start()
        self.log.info(
            "supervisor_started",
            pid=os.getpid(),
            config=self._config_path,
            run_dir=str(self.layout.root),
            nproc=self.config.nproc_per_node,
            nodes=self.config.nodes,
            subreaper=become_subreaper(),
            **({} if self.layout.memory is None else {"memory_dir": str(self.layout.memory)}),
            **({} if self._predecessor_heard is None else {"predecessor_heard_step": self._predecessor_heard[0]}),
        )
        worker = self.config.worker
        if worker.save_checkpoint_steps == 0 and worker.save_checkpoint_interval_s == 0:
            self.log.warning(
                "checkpointing_off",
                reason="worker.save_checkpoint_steps and "
                "worker.save_checkpoint_interval_s are 0: after a crash the run starts again from step 0",
            )
        for leftover in kill_predecessor_leftovers(self.layout):
            self.log.warning("predecessor_leftover_killed", **leftover)
        unlink_quietly(self.layout.stop_order)  # a predecessor's order is not ours to carry out
        try:
            self._metrics.start()
            if not self._stop_file_blocks_start():
                self._handle(Started())
            while not self.state.phase.terminal and self.handed_over is None:
                self._handle(self._next_event())
        finally:
            if self.handed_over is None:
                self._launcher.close()  # on any way out, no process of the run outlives the supervisor
            else:
                self._launcher.hand_over()  # the agents fence their ranks; a successor may live in their step
            self._end_memory_tier()
            self._stop_watcher.stop()
            if self._time_limit is not None:
                self._time_limit.stop()
            self._metrics.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._end_lease()
        if self.handed_over is not None:
            return None
        self.log.info(
            "supervisor_exiting", state=self.state.phase.value, exit_code=self.state.exit_code, reason=self.state.reason
        )
        return self.state.exit_code or 0

    def _end_lease(self) -> None:
        """Released with the exit code (whoever claims it next starts the run afresh), or abdicated."""
        if self._lease is None:
            return
        if self.handed_over is None:
            self._lease.end(RELEASED, self.state.exit_code if self.state.phase.terminal else None)
        elif self._abdicate:
            self._lease.end(ABDICATED)

    def _hand_over(self, why: str, *, abdicate: bool) -> None:
        """Stop acting for the run at once: nothing more is launched, signalled or written by this supervisor."""
        if self.handed_over is None:
            self.handed_over, self._abdicate = why, abdicate
            self.log.error(
                "supervisor_isolated" if abdicate else "supervisor_deposed",
                why=why,
                attempt=self.state.attempt,
                action="fencing this node's ranks; handing over",
            )

    def _with_memory_tier(self, layout: RunLayout) -> RunLayout:
        """The layout with this run's memory directory, created here (mode 0700) when snapshots are on and the ranks
        run on this machine; without it (refused, no /dev/shm) snapshots go to the disk slots, as before."""
        multi_node = self.config.nodes > 1 or self.config.spare_nodes > 0  # each node's agent keeps its own
        if self.config.worker.snapshot_steps in (0, "0") or multi_node:
            return layout
        path = memory_dir_for(layout.root)
        try:
            return replace(layout, memory=create_memory_dir(path))
        except OSError as exc:
            self.log.warning("memory_tier_off", path=str(path), reason=str(exc), action="snapshots go to disk")
            return layout

    def _end_memory_tier(self) -> None:
        """At the run's end (not a hand-over): the newest memory snapshot persisted when it is newer than the newest
        disk checkpoint, so a stopped run loses nothing that was in memory; then the memory directory removed."""
        if self._persister is None:
            return
        self._persister.stop()  # whatever the way out: a supervisor that handed over writes nothing more
        if self.handed_over is not None or not self.state.phase.terminal:
            return
        try:
            persisted = self._persister.persist_newest()
        except OSError as exc:  # the run ends all the same; its memory then goes unpersisted, said here
            self.log.error("persist_failed", reason=str(exc)[:MAX_LOGGED_CHARS], at="the run's end")
            persisted = None
        assert self.layout.memory is not None  # a persister exists only with a memory tier
        remove_memory_dir(self.layout.memory)
        self._memory_removed = True
        self.log.info(
            "memory_tier_removed", path=str(self.layout.memory), persisted=None if persisted is None else persisted.step
        )
        self._write_status(durable=True)  # health_ckpts.json and status: the persisted step, no memory entry

    def _stop_file_blocks_start(self) -> bool:
        """A stop file present at start means the run was stopped on purpose: an automatic restart must not undo
        that. `--ignore-stop-file` launches anyway, treating the file's present content as already handled."""
        present = _stop_file_signature(self.stop_file)
        if present is None:
            return False
        if isinstance(present[1], OSError):  # a FIFO, directory or symlink there is nobody's stop request
            self._read_stop_file()
            return False
        if self._ignore_stop_file:
            self._stop_file_seen = present[0]
            self.log.warning("stop_file_ignored", path=str(self.stop_file))
            return False
        newest = self._newest_complete()  # no rank runs: the run ends at its newest complete state
        self.log.error(
            "stop_file_present",
            path=str(self.stop_file),
            action="not launching; remove the file or pass --ignore-stop-file",
            step=newest,
        )
        source = f"stop file {self.stop_file}"
        self.state = replace(
            self.state,
            phase=Phase.STOPPED,
            stopped_at=newest,
            stop_source=source,
            reason=f"not started: {source} is present; {ends_at(newest)}",
        )
        self._observe(Tick())  # goodput books what was trained past that state (a successor's) as lost
        self._write_status(durable=True)
        return True

    def _newest_complete(self) -> int | None:
        """The newest state complete on every rank (unverified; a snapshot's too): where a run stopped while no rank
        runs ends, and where its next start would resume."""
        worker = self.config.worker
        try:
            found = newest_complete(resume_stores(self.layout, worker), self.config.world_size, worker.prefix)
        except (OSError, ValueError):
            return None
        return None if found is None else found[1]

    def _relayed_signal(self) -> list[Event]:
        """A signal the job's batch process got while it waits as the job's keeper for us, a successor (Slurm's
        time-limit warning reaches only the batch shell)."""
        if self._lease is None or self._lease.lease.batch:  # only a successor has a keeper to relay for it
            return []
        relayed = read_relayed_signal(self.layout, self._lease.lease.generation)
        if relayed is None or relayed[0] == self._relayed:
            return []
        self._relayed = relayed[0]
        self.log.info("signal_relayed", signal=signal.Signals(relayed[1]).name, by="the batch process")
        return [SignalReceived(relayed[1])]

    def _read_stop_file(self) -> list[Event]:
        """A StopRequested for each new, settled write of the stop file; a warning for garbage."""
        present = _stop_file_signature(self.stop_file)
        if present is None:
            self._stop_file_seen = None  # removed: the next write counts as new, whatever it holds
            return []
        signature, data, age_s = present
        if signature == self._stop_file_seen:  # acted on already
            return []
        if age_s < STOP_FILE_SETTLE_S:  # maybe mid-write: look again once it has settled
            self._next_poll = min(self._next_poll, time.monotonic() + STOP_FILE_SETTLE_S - age_s)
            return []
        self._stop_file_seen = signature
        source = f"stop file {self.stop_file}"
        try:
            if isinstance(data, OSError):
                raise StopFileUnparsable(f"cannot read it: {data.strerror or data}")
            return [StopRequested(parse_stop_file(data, source))]
        except StopFileUnparsable as exc:
            self.log.warning("stop_file_unparsable", path=str(self.stop_file), error=str(exc), action="ignored")
            return []

    # ---- events in ----

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._inbox.put_nowait(SignalReceived(signum))  # nothing else: logging here can deadlock

    def _on_child_exit(self, attempt: int, rank: int, returncode: int) -> None:
        self._inbox.put_nowait(ChildExited(attempt, rank, returncode))

    def _with_abort_info(self, event: ChildExited) -> ChildExited:
        """A failed rank carries what a rank of its attempt logged about an anomaly abort: its own (it exited
        EXIT_ANOMALY) or a peer's (it died of the abort first, by SIGABRT). A crash, if none logged anything usable."""
        if event.returncode == 0 or not self._abort_may_matter(event):
            return event
        # Only a SIGABRT can be a peer's abort (NCCL's watchdog, a failed collective); stopping, the rank that logged
        # it brings it itself when it exits. Otherwise only its own log is read: at thousands of ranks, reading
        # every peer's log at each crash would hold the main loop for seconds.
        died_of_abort = event.returncode == -signal.SIGABRT and self.state.phase is Phase.RUNNING
        peers = range(self.config.world_size) if died_of_abort else ()
        ranks = [event.rank, *(r for r in peers if r != event.rank)]
        logged = next((e for r in ranks if (e := last_event(self.layout, r, event.attempt, "anomaly_abort"))), None)
        try:
            abort = abort_info(logged)
        except ValueError as exc:
            if event.returncode == EXIT_ANOMALY:  # a peer's unusable event is reported when that peer exits
                self.log.warning("anomaly_abort_unreadable", rank=event.rank, attempt=event.attempt, error=str(exc))
            return event
        return replace(event, abort=abort)

    def _abort_may_matter(self, event: ChildExited) -> bool:
        """Whether an abort could still change what follows this exit: its own 65, a failure while running, or one
        while a plain relaunch is pending (log tails are read for it: keep it to those)."""
        state = self.state
        if event.returncode == EXIT_ANOMALY:
            return True
        if event.attempt != state.attempt or state.rollback_pending:
            return False
        return state.phase is Phase.RUNNING or (state.phase is Phase.STOPPING and state.then is Then.RELAUNCH)

    def _with_refusal(self, event: ChildExited) -> ChildExited:
        """A rank that refused its resume checkpoint carries what it logged about it: it exits
        EXIT_CHECKPOINT_REFUSED, or dies of a peer's stop on its way out. A crash, if it logged nothing usable."""
        if event.returncode == 0:
            return event
        logged = last_event(self.layout, event.rank, event.attempt, "checkpoint_refused")
        try:
            if logged is None:
                if event.returncode != EXIT_CHECKPOINT_REFUSED:
                    return event  # an ordinary crash
                raise ValueError("no checkpoint_refused event in its log")
            step, path, error = count(logged, "step"), logged.get("path"), logged.get("error")
            if step != self.state.resume_step:
                raise ValueError(f"step {step} is not the resume step {self.state.resume_step}")
            if not isinstance(path, str) or not isinstance(error, str):
                raise ValueError("'path' or 'error' is not a string")
        except ValueError as exc:
            self.log.warning("checkpoint_refused_unreadable", rank=event.rank, attempt=event.attempt, error=str(exc))
            return event
        # The rank's log is not trusted: bounded, like everything else read from it.
        return replace(event, refused=CheckpointRefusal(step, path[:MAX_LOGGED_CHARS], error[:MAX_LOGGED_CHARS]))

    def _with_cause(self, event: ChildExited) -> ChildExited:
        """The first failure of an attempt carries why (from the tail of the rank's stderr) and the step it logged."""
        if event.returncode == 0 or self.state.phase is not Phase.RUNNING or event.attempt != self.state.attempt:
            return event  # later exits of a stopping attempt are consequences, not causes
        if event.cause is not None:  # the launcher knows better (its node was lost)
            return replace(event, step=last_step(self.layout, event.rank, event.attempt))
        oom = event.returncode == -signal.SIGKILL and self._launcher.oom_killed()
        cause = explain(stderr_tail(self.layout, event.rank, event.attempt), event.returncode, oom_killed=oom)
        return replace(event, cause=cause, step=last_step(self.layout, event.rank, event.attempt))

    def _with_stop_info(self, event: ChildExited) -> ChildExited:
        """A clean exit after carrying out a stop-and-exit order carries its step (read from the rank's log)."""
        if event.returncode != 0 or self.state.stop_order is None or not self.state.stop_order.exit:
            return event
        done = last_event(self.layout, event.rank, event.attempt, "stop_order_done")
        if done is None or done.get("exit") is not True:
            return event
        try:
            return replace(event, stopped_at=count(done, "step"))
        except ValueError as exc:
            self.log.warning("stop_order_done_unreadable", rank=event.rank, attempt=event.attempt, error=str(exc))
            return event

    def _next_event(self) -> Any:
        now = time.monotonic()
        if self._deadline is None or now - self._deadline[0] > DEADLINE_REFRESH_S:
            self._deadline = (now, next_deadline(self.state))
        deadline = self._deadline[1]
        wake = self._next_poll if deadline is None else min(self._next_poll, deadline)
        wake = min(wake, self._systemd.next_ping(), self._launcher.next_deadline())
        if now >= wake:
            return Tick()
        try:
            return self._inbox.get(timeout=wake - now)
        except queue.Empty:
            return Tick()

    def _handle(self, item: Any) -> None:
        pending: deque[Event] = deque(self._translate(item))
        if self.handed_over is not None:
            return  # what this supervisor knew is no longer the run's state: a successor writes that
        before = (self.state.phase, self.state.attempt)
        while pending:
            event = pending.popleft()
            if not isinstance(event, (Heartbeats, HeartbeatSeen)):
                self._deadline = None
            if isinstance(event, (StopRequested, SignalReceived)) and self.state.phase in NO_RANK_SAVES:
                event = replace(event, newest_step=self._newest_complete())  # where the run ends if it stops now
            self.state, actions = decide(self.state, event, time.monotonic())
            self._observe(event)
            for action in actions:
                pending.extend(self._execute(action))
            if isinstance(event, (Heartbeats, HeartbeatSeen)):
                pending.extend(self._transient_verdicts(event))
        changed = (self.state.phase, self.state.attempt) != before
        due = isinstance(item, Tick) and time.monotonic() >= self._next_status
        if changed or due or isinstance(item, Started):  # Started: "starting" while checkpoints are verified
            self._write_status(durable=changed, sync=not self.state.recovering_in_place)
        if changed or isinstance(item, (Tick, Started)):
            self._systemd.observe(self.state, time.monotonic(), launched=self._launcher.launched)

    def _observe(self, event: Event) -> None:
        now = time.monotonic()
        for each in event.beats if isinstance(event, Heartbeats) else (event,):  # observers take beats one by one
            for observer in self._observers:
                for level, name, fields in observer.observe(each, self.state, now):
                    getattr(self.log, level)(name, **fields)

    def _translate(self, item: Any) -> list[Event]:
        """Turn adapter hints into core events; a Tick also polls the launcher (hints can be lost)."""
        if isinstance(item, StopFileChanged):
            return self._read_stop_file()
        if isinstance(item, LeaseLost):
            self._hand_over(item.why, abdicate=False)
            return []
        if isinstance(item, Tick):
            self._next_poll = time.monotonic() + POLL_INTERVAL_S
            found = [e for event in self._launcher.poll() for e in self._from_launcher(event)]
            return [*found, *self._read_stop_file(), *self._relayed_signal(), item]
        if isinstance(item, ChildExited):
            # The step it reached, fresh (an lstat when unchanged); recovering in place, also whether each peer can
            # (a crash right after the launch may come before the watcher's first look at their beats).
            ranks = range(self.config.world_size) if self.config.in_place is None else (item.rank,)
            beats = [beat for rank in ranks for beat in self._launcher.last_heartbeat(rank)]
            return [*beats, self._explained(item)]
        if isinstance(item, LaunchPrepared):
            return self._launch_prepared(item)
        if isinstance(item, Spawned):
            return self._spawned(item)
        events = self._launcher.translate(item)
        return [item] if events is None else [e for found in events for e in self._from_launcher(found)]

    def _from_launcher(self, found: Event | Spawned | Isolated) -> list[Event]:
        if isinstance(found, Isolated):
            self._hand_over(found.why, abdicate=True)
            return []
        if isinstance(found, Spawned):
            return self._spawned(found)
        return [self._explained(found) if isinstance(found, ChildExited) else found]

    def _explained(self, exited: ChildExited) -> ChildExited:
        """A rank's exit with what its logs say about it."""
        return self._with_cause(
            self._with_stop_info(self._with_abort_info(self._with_refusal(self._with_device(exited))))
        )

    def _with_device(self, event: ChildExited) -> ChildExited:
        """A rank that left with EXIT_BAD_DEVICE carries the persistent verdict it left for, as the suspect's own
        log says it (its node and GPU); as its own log says it, if the suspect's has no word of it."""
        if event.returncode != EXIT_BAD_DEVICE or event.attempt != self.state.attempt:
            return event
        if self.state.phase is not Phase.RUNNING:  # the first exit brought it: thousands of ranks leave at once
            return event
        said = last_event(self.layout, event.rank, event.attempt, "sdc_verdict", verdict=PERSISTENT)
        try:
            if said is None:
                raise ValueError("no persistent sdc_verdict event in its log")
            suspect = count(said, "suspect")
            own = last_event(self.layout, suspect, event.attempt, "sdc_verdict", verdict=PERSISTENT, suspect=suspect)
            verdict = device_verdict(own if own is not None else said)
        except ValueError as exc:
            self.log.warning("sdc_verdict_unreadable", rank=event.rank, attempt=event.attempt, error=str(exc))
            return event  # a crash like any other
        return replace(event, device=verdict)

    def _transient_verdicts(self, event: Heartbeats | HeartbeatSeen) -> list[Event]:
        """Transient verdicts on a rank's own device, once its beats count more of them than seen (from its log)."""
        found: list[Event] = []
        for beat in event.beats if isinstance(event, Heartbeats) else (event,):
            counted = dict(beat.anomalies or ()).get(f"sdc_{TRANSIENT}", 0)
            seq, seen = self._transients.get(beat.rank, (-1, 0))
            seen = 0 if beat.seq < seq else seen  # a new process: its beats and counts start again
            self._transients[beat.rank] = (beat.seq, counted)
            if counted > seen:
                found += [
                    DeviceVerdictSeen(v) for v in device_verdicts(self.layout, beat.rank, TRANSIENT, seen, counted)
                ]
        return found

    # ---- actions out ----

    def _execute(self, action: Action) -> list[Event]:
        if isinstance(action, Record):
            getattr(self.log, action.level)(action.event, **dict(action.fields))
        elif isinstance(action, SignalRanks):
            chosen = None if action.ranks is None else set(action.ranks)  # a set: thousands of ranks
            running = {r.rank for r in self.state.ranks if r.running and (chosen is None or r.rank in chosen)}
            sent = self._launcher.signal(action.attempt, action.signum, running)
            self.log.info(
                "ranks_signalled", signal=signal.Signals(action.signum).name, ranks=sent, attempt=action.attempt
            )
        elif isinstance(action, LaunchRanks):
            self._launcher.prestart(action.attempt)
            threading.Thread(target=self._prepare_launch, args=(action,), daemon=True).start()
        elif isinstance(action, DumpStacks):
            self._launcher.dump_stacks(
                action.attempt, action.ranks, action.faulthandler_ranks, collective_failed=action.collective_failed
            )
        elif isinstance(action, KillLeftovers):
            kept = set(action.keep)
            survivors = [r for r in self.state.ranks if r.running and r.pid is not None and r.rank not in kept]
            self._launcher.kill_leftovers(action.attempt, survivors)
        elif isinstance(action, PublishStopOrder):
            self._launcher.publish(action.order)
        elif isinstance(action, PublishUnwind):
            self._launcher.unwind(action.attempt)
        elif isinstance(action, ChargeDevice):
            why = self._launcher.charge_device(action.verdict)
            self._devices = _device_verdicts(self.layout)
            if why is not None and action.verdict.verdict == TRANSIENT:  # a persistent one's attempt ends anyway
                return [DeviceExcluded(action.verdict, why)]
        else:
            raise TypeError(f"unknown action {action!r}")
        return []

    def _prepare_launch(self, action: LaunchRanks) -> None:
        """Off the main loop, which keeps answering signals and the watchdog, while the ranks' processes start
        (`prestart`): remove torn saves and choose the resume point (reading every candidate's files for their
        checksums can take minutes for big checkpoints)."""
        try:
            self._sort_out_junk()  # no save is in flight: the previous attempt's ranks are gone
            mismatch = self._world_size_mismatch(action.attempt)
            if mismatch is not None:  # before anything is launched, and without a retry: no relaunch can fix it
                self._inbox.put_nowait(LaunchFailed(action.attempt, mismatch.message(), retryable=False))
                return
            choice = self._choose_resume(action.attempt, action.resume_at_most, action.refused)
            self._launcher.await_prestarted()  # its ranks are forked from the fork server once it has imported
        except Exception as exc:  # noqa: BLE001 - whatever it is, the run must not wait forever in STARTING
            self._inbox.put_nowait(LaunchFailed(action.attempt, f"choosing a checkpoint failed: {exc!r}"))
            return
        self._inbox.put_nowait(LaunchPrepared(action, choice))

    def _world_size_mismatch(self, attempt: int) -> WorldSizeMismatch | None:
        """The first launch refuses checkpoints that only another world size wrote. Relaunches pass them over:
        the first launch found one of this world size, or started from scratch on purpose (resume_training: false)."""
        worker = self.config.worker
        if attempt != 0 or worker.resume_training is False:
            return None
        named = self._names_resume(attempt)
        stores = [named_store(self.layout, worker)] if named else resume_stores(self.layout, worker)
        return world_size_mismatch(stores, self.config.world_size, worker.prefix)

    def _launch_prepared(self, prepared: LaunchPrepared) -> list[Event]:
        action, choice = prepared.action, prepared.choice
        if self.state.phase is not Phase.STARTING or self.state.attempt != action.attempt:
            return []  # stopped while the checkpoints were being verified
        for step, reason in dict.fromkeys(choice.passed_over):  # a step passed over in two stores alike: once
            self.log.warning(passed_over_event(reason), step=step, reason=reason, attempt=action.attempt)
        if choice.step is None and choice.passed_over:
            self.log.error(
                "no_usable_checkpoint",
                attempt=action.attempt,
                candidates=len(choice.passed_over),
                then=self.config.worker.no_usable_checkpoint,
            )
        launched = self._launch(action, choice)
        return [] if launched is None else [launched]

    def _launch(self, action: LaunchRanks, choice: Choice) -> Event | None:
        attempt = action.attempt
        resume_step = choice.step
        if (
            resume_step is None
            and choice.passed_over
            and attempt == 0
            and isinstance(self.config.worker.resume_training, str)
        ):
            named, why = choice.passed_over[0]
            return LaunchFailed(
                attempt,
                f"the checkpoint named by worker.resume_training (step {named}) is not usable: {why}",
                retryable=False,
                exit_code=EXIT_FAILED,
            )
        if resume_step is None and choice.passed_over and self.config.worker.no_usable_checkpoint == "refuse":
            newest, why = choice.passed_over[0]
            return LaunchFailed(
                attempt,
                f"no usable checkpoint (newest, step {newest}: {why}); "
                "refusing to start from scratch (worker.no_usable_checkpoint: refuse)",
                retryable=False,
                exit_code=EXIT_FAILED,
            )
        if self._lease is not None and not self._lease.valid():  # launching now could race a successor
            self._hand_over(
                self._lease.lost.why if self._lease.lost else "the lease could not be renewed in time", abdicate=False
            )
            return None
        for rank in range(self.config.world_size):  # a beat from an earlier run must not pass for this one
            unlink_quietly(self.layout.heartbeat(rank))
        store = choice.store
        self._launching = LaunchPrepared(action, choice)
        spawned = self._launcher.launch(
            Attempt(
                attempt,
                resume_step,
                None if store is None else store.root,
                action.skip_to_batch,
                failures=(self.state.restarts, self._goodput.totals()["wall_s"]),  # `snapshot_steps: auto`'s rate
                keep=action.keep,
            )
        )
        return spawned if spawned is None or isinstance(spawned, LaunchFailed) else self._ranks_launched(spawned)

    def _spawned(self, spawned: Spawned) -> list[Event]:
        """A launcher that starts ranks asynchronously is done: the core hears of it now."""
        if self.state.phase is not Phase.STARTING or self.state.attempt != spawned.attempt:
            return []  # stopped meanwhile: the launcher is told to kill them by the stop that ended the attempt
        return [self._ranks_launched(spawned)]

    def _ranks_launched(self, spawned: Spawned) -> RanksLaunched:
        assert self._launching is not None and self._launching.action.attempt == spawned.attempt
        choice, attempt = self._launching.choice, spawned.attempt
        store = choice.store
        source = None if store is None or store == self.layout.checkpoints else store.label
        return RanksLaunched(
            attempt,
            spawned.pids,
            choice.step,
            choice.passed_over,
            source,
            resume_named=self._names_resume(attempt) and choice.step is not None,
            kept=spawned.kept,
            not_kept=spawned.not_kept,
        )

    def _sort_out_junk(self) -> None:
        """Before a launch: delete our torn temporaries, report anything foreign once."""
        junk = find_junk(self.layout, self.config.world_size, self.config.worker.prefix)
        if self._persister is not None:  # the persister may be copying into the checkpoint directory meanwhile
            junk = replace(
                junk,
                torn=tuple(p for p in junk.torn if not self._persister.in_flight(p)),
                foreign=tuple(p for p in junk.foreign if not self._persister.in_flight(p)),
            )
        elif self._agents_persist():  # node agents copy pins to disk: a fresh temporary may be theirs, under way
            junk = replace(junk, torn=tuple(p for p in junk.torn if not _recent(p, AGENT_COPY_SETTLED_S)))
        for path in junk.torn:
            if path.name.endswith(".dcp"):  # a sharded save that never got its manifest: the whole directory
                remove_sharded(path)
            else:
                unlink_quietly(path)
            self.log.info("torn_temporary_removed", path=str(path))
        unreported = [str(path) for path in junk.foreign if path not in self._reported_junk]
        if unreported:
            self.log.warning("checkpoint_dir_junk", paths=unreported, action="ignored, left in place")
            self._reported_junk.update(junk.foreign)

    def _agents_persist(self) -> bool:
        """Whether node agents persist snapshots (the memory tier on a multi-node run), not this process."""
        multi_node = self.config.nodes > 1 or self.config.spare_nodes > 0
        return multi_node and self.config.worker.snapshot_steps != 0

    def _names_resume(self, attempt: int) -> bool:
        """Whether this attempt resumes from the checkpoint `worker.resume_training` names (the first only)."""
        return attempt == 0 and isinstance(self.config.worker.resume_training, str)

    def _choose_resume(self, attempt: int, at_most: int | None, refused: tuple[tuple[int, str], ...] = ()) -> Choice:
        """Newest checkpoint complete, intact and healthy on every rank (at or before `at_most`, none `refused`),
        saying why newer ones were passed over; attempt 0 honours `worker.resume_training`."""
        worker, world = self.config.worker, self.config.world_size
        if attempt == 0 and worker.resume_training is False:
            return Choice(None, ())
        if self._names_resume(attempt):
            assert isinstance(worker.resume_training, str)  # what _names_resume checks
            named = parse_checkpoint_name(worker.resume_training)
            assert named is not None  # the config was validated
            return choose_explicit(named_store(self.layout, worker), world, worker.prefix, named)
        choice = choose_resume(
            resume_stores(self.layout, worker),
            world,
            worker.prefix,
            at_most=at_most,
            require_healthy=worker.use_checkpoint_health_monitor,
            refused=dict(refused),
        )
        # Multi-node: a snapshot newer than that in the nodes' memory, which each node gathers before its ranks start.
        memory = self._launcher.memory_choice(world, newer_than=choice.step, at_most=at_most, refused=dict(refused))
        if memory is None:
            return choice
        store = resume_store(memory_dir_for(self.layout.root))
        return Choice(memory.step, choice.passed_over, replace(store, label=memory.label))

    def _record_health(self, steps: list[int]) -> list[int]:
        """Rotate, then keep health_ckpts.json (seed 000) listing every complete checkpoint of this world size, when
        the set of complete checkpoints changes; returns those left."""
        if steps == self._health_seen:
            return self._health_steps
        prefix, world = self.config.worker.prefix, self.config.world_size
        sizes = world_sizes(self.layout.checkpoints, steps, prefix)
        # Another world size's per-rank checkpoints are not ours to rotate; sharded ones (no size here) are anyone's.
        ours = [step for step in steps if sizes.get(step, world) in (world, None)]
        entries = health_entries(self.layout.checkpoints, world, prefix, ours)
        doomed = self._rotate(ours, {e["step"] for e in entries if e["is_health"] == 0})
        self._health_seen = [step for step in steps if step not in doomed]
        self._health_steps = [step for step in ours if step not in doomed]
        self._disk_health = [{**e, "tier": "disk"} for e in entries if e["step"] not in doomed]
        self._write_health_file([*self._disk_health, *self._memory_health])
        return self._health_steps

    def _memory_block(self) -> dict[str, Any] | None:
        """Status's memory block (None without a memory tier, or once it is removed); health_ckpts.json's entry of
        the newest memory snapshot kept with it."""
        if self.layout.memory is None or self._memory_removed:
            if self._memory_health:
                self._memory_health, self._memory_health_seen = [], None
                self._write_health_file(self._disk_health)
            return None
        world, prefix = self.config.world_size, self.config.worker.prefix
        found = newest_memory_snapshot(self.layout, world, prefix)
        step = None if found is None else found[1]
        if step != self._memory_health_seen:
            self._memory_health_seen = step
            entries = [] if found is None else health_entries(found[0], world, prefix, [found[1]])
            self._memory_health = [{**e, "tier": MEMORY_LABEL} for e in entries]
            # Not fsynced: it changes with every snapshot, and the memory tier does not outlive the machine anyway.
            self._write_health_file([*self._disk_health, *self._memory_health], durable=False)
        return memory_status(self.layout, found, world, prefix, time.time())

    def _write_health_file(self, entries: list[dict[str, Any]], *, durable: bool = True) -> None:
        try:
            write_health_file(self.layout, entries, durable=durable)
        except OSError as exc:
            self.log.error("health_file_write_failed", error=str(exc))

    def _rotate(self, steps: list[int], healthy: set[int]) -> list[int]:
        """keep_checkpoint_max: delete the oldest complete checkpoints, record first so a kill leaves junk, not lies."""
        resumed = self.state.resume_step  # kept when it is one of this run dir's checkpoints (no resume_source)
        protected = {resumed} if resumed is not None and self.state.resume_source is None else set()
        doomed = rotation(steps, healthy, keep_max=self.config.worker.keep_checkpoint_max, protected=protected)
        for step in doomed:
            if self.layout.checkpoints.is_sharded(step, self.config.worker.prefix):
                remove_sharded(self.layout.checkpoints.sharded_dir(step, self.config.worker.prefix))
            for rank in range(self.config.world_size):
                unlink_quietly(self.layout.checkpoints.record(rank, step, self.config.worker.prefix))
                unlink_quietly(self.layout.checkpoints.file(rank, step, self.config.worker.prefix))
            self.log.info("checkpoint_rotated", step=step)
        return doomed

    def _completed_at(self, step: int) -> float | None:
        """When the newest complete checkpoint was completed (for its age in the metrics), looked up once per step."""
        if self._newest_checkpoint is None or self._newest_checkpoint[0] != step:
            when = completed_at(self.layout.checkpoints, self.config.world_size, self.config.worker.prefix, step)
            self._newest_checkpoint = (step, when)
        return self._newest_checkpoint[1]

    def _write_status(self, *, durable: bool, sync: bool = True) -> None:
        """The state file, the health file and rotation, the console line and metrics; at most once a second, and
        at scale (thousands of ranks to list, checkpoint directories to look through) never more than
        STATUS_SHARE of the supervisor's CPU time. `sync` False: a change of phase written without an fsync (a
        recovery in place's, which takes milliseconds: an fsync each is tens of them on a busy disk)."""
        started, cpu = time.monotonic(), time.thread_time()
        self._publish_status(durable=durable, sync=sync)
        # CPU time, not wall: a slow disk (an fsync on a loaded machine) must not make the state file go stale.
        self._next_status = started + (time.thread_time() - cpu) / STATUS_SHARE

    def _publish_status(self, *, durable: bool, sync: bool = True) -> None:
        # Checkpoints are looked through (one listing per rank) at the periodic writes and at the end, not at each
        # change of phase: a crash of thousands of ranks must not wait for it to be handled.
        looked = not durable or self.state.phase.terminal or self._health_seen is None
        steps = (
            self._record_health(
                self.layout.checkpoints.complete_steps(self.config.world_size, self.config.worker.prefix)
            )
            if looked
            else self._health_steps
        )
        if looked:
            self._memory_status = self._memory_block()
        extra = {
            "run_dir": str(self.layout.root),
            "config": self._config_path,
            "stop_file": str(self.stop_file),
            "supervisor_pid": os.getpid(),
            "supervisor_host": socket.gethostname(),
            "lease_generation": None if self._lease is None else self._lease.lease.generation,
            "started_at": self._started_at,
            "last_checkpoint": {"step": steps[-1]} if steps else None,
            "checkpoint_prefix": self.config.worker.prefix,  # for `stop` while no supervisor runs (a takeover)
            # While no rank runs: where a stop would end the run (a memory snapshot's step included), for `stop`.
            **({"newest_state": self._newest_complete()} if self.state.phase in NO_RANK_SAVES else {}),
            "last_checkpoint_at": self._completed_at(steps[-1]) if steps else None,
            "memory": self._memory_status,
            "logs": str(self.layout.attempt_log(self.state.attempt, 0, "err").parent),
            "device_verdicts": self._devices,
            **self._launcher.details(),
        }
        for observer in self._observers:
            extra.update(observer.status())
        status = snapshot(self.state, now=time.monotonic(), extra=extra)
        try:
            write_status(self.layout, status, durable=durable and sync)
        except OSError as exc:  # a full disk must not kill supervision; the journal says why status is stale
            self.log.error("status_write_failed", error=str(exc))
        for listener in self.status_listeners:  # the live console line, metrics
            listener(status)


def _device_verdicts(layout: RunLayout) -> list[dict[str, Any]]:
    """The newest verdicts on devices the node ledger holds (it outlives supervisors and jobs); none if unreadable."""
    try:
        return Ledger.load(layout).device_verdicts()
    except (OSError, ValueError):
        return []  # the launcher says why it cannot use the ledger


def _previous_status(layout: RunLayout) -> dict[str, Any]:
    """What a previous supervisor of this run dir last wrote (observers validate what they take from it)."""
    try:
        return read_status(layout)
    except StatusError:
        return {}


def _last_beat(layout: RunLayout, previous: dict[str, Any], world_size: int) -> tuple[int, float] | None:
    """After a supervisor that died mid-run (its host crashed): the newest step the ranks of its attempt wrote in
    their heartbeat files, and when (the file's mtime, wall clock). It heard them up to about there, after it last
    wrote its state. The first and the last rank are read (other nodes, the same steps): a start of thousands of
    ranks does not read thousands of files."""
    attempt = previous.get("attempt")
    if previous.get("state") not in ("running", "stopping") or type(attempt) is not int:
        return None
    newest: tuple[int, float] | None = None
    for rank in sorted({0, world_size - 1}):
        path = layout.heartbeat(rank)
        try:
            seen = read_heartbeat(path, rank)
            when = os.lstat(path).st_mtime
        except (HeartbeatUnreadable, OSError):
            continue
        if seen is not None and seen.attempt == attempt and (newest is None or seen.step > newest[0]):
            newest = (seen.step, when)
    return newest


def _previous_step_gaps(previous: dict[str, Any], window: int) -> tuple[float, ...]:
    """Calibration samples a previous supervisor of this run dir kept, so a restart does not start blind
    (only positive numbers, at most `window` of them: the file may have been tampered with)."""
    try:
        gaps = previous.get("calibration", {}).get("step_gaps", [])
        return tuple(float(g) for g in gaps if type(g) in (int, float) and g > 0)[-window:]
    except (AttributeError, TypeError):
        return ()


def _stop_file_signature(path: Path) -> tuple[tuple[int, ...], bytes | OSError, float] | None:
    """(what identifies this write, the content or why it cannot be read, seconds since it was written),
    or None when there is no file. Read bounded and without blocking: a FIFO or symlink there is refused."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory, FIFO, symlink, no permission: the operator must hear of it
        return (-1, exc.errno or 0), exc, math.inf
    try:
        stat = os.fstat(fd)
        data = os.read(fd, MAX_STOP_FILE_BYTES + 1)
    except OSError as exc:
        return (-1, exc.errno or 0), exc, math.inf
    finally:
        os.close(fd)
    signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size, zlib.crc32(data))
    return signature, data, time.time() - stat.st_mtime


def _process_age() -> float:
    """Seconds since this process started. psutil's create_time adds the boot time, which the kernel gives in whole
    seconds: up to a second too old. Both the start and the boot clock count from boot, exact to a clock tick."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, with pid and name cut off
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc (not Linux): psutil's estimate
        return max(0.0, time.time() - psutil.Process().create_time())


def _recent(path: Path, seconds: float) -> bool:
    """Whether `path` was modified within the last `seconds` (a missing one is not)."""
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime < seconds
    except OSError:
        return False
