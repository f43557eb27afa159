"""The node agent: one per node of a multi-node attempt, started by the supervisor in a Slurm job step.

It dials the supervisor, says who it is, starts the ranks the supervisor places on its node, and reports
over the same TCP stream what the supervisor would otherwise read from files: every new heartbeat (read
here, on the node that wrote it, so no shared-filesystem cache can delay it), every rank exit, stack dumps.
It carries out the supervisor's orders (signal ranks, dump stacks, publish a stop order) and never decides
anything itself, with two exceptions. The fence: when the supervisor falls silent (it died, or the network
is cut) for `fence_s`, or its stream ends without a word, the agent kills its ranks, so the supervisor can
relaunch elsewhere knowing no half of the old job still runs. The succession: the agent then stands for
successor (succession.py); if the supervisor's lease lapses and it is this agent's turn, it becomes the new
supervisor. Both are written to the run's journal by the agent itself. Torch-free, like the whole supervisor.

    python -m supervisor.agent --connect HOST:PORT --run-dir DIR --attempt N --fence-s S [--memory-prefix P]
    (the run's token in TRAINWARDEN_AGENT_TOKEN; --memory-prefix: the memory tier is on, checkpoints named P)

With the memory tier on, the agent also keeps its node's share of it (node_memory.py): the run's memory directory
in this node's shared memory, its ranks' pins persisted to disk, their newest snapshot copied to a partner node,
and what a relaunched rank resumes from gathered before it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from supervisor.core import HeartbeatSeen
from supervisor.launch.gpu_health import ENV_VISIBLE, count_gpus, gpu_problems
from supervisor.launch.launcher import publish_order
from supervisor.launch.node_memory import NodeMemory
from supervisor.launch.ranks import (
    Ranks,
    free_port,
    local_env,
    publish_next,
    publish_unwind,
    signal_group,
    spawn_ranks,
)
from supervisor.launch.stacks import collect_stacks
from supervisor.launch.succession import Succession, become_successor, stand_for_successor
from supervisor.launch.trees import descendants, die_with_parent, sigkill
from supervisor.rundir.journal import append_event
from supervisor.rundir.watch import HeartbeatFiles, HeartbeatUnreadable
from worker.contract import ENV_MEMORY_DIR, ENV_RUN_DIR, UNWIND_SIGNAL, RunLayout, StopOrder
from worker.files import ensure_dir, open_append
from worker.memory import create_memory_dir, memory_dir_for, remove_memory_dir

__all__ = ["ENV_TOKEN", "main"]

ENV_TOKEN = "TRAINWARDEN_AGENT_TOKEN"
POLL_S = 0.2  # heartbeat files are looked at this often (an lstat each, a read only when one changed)
BEAT_S = 1.0  # one message this often carries the node's new beats (each with its age), or says it is alive
MAX_STACK_CHARS = 64 * 1024  # per rank, in a stacks message
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# An agent stuck this long past its own deadlines writes every thread's stack to its log (and again each period):
# nothing else would say where, once the batch host and its srun are gone.
STALL_S = 30.0


class Agent:
    """Runs one attempt's ranks on this node for the supervisor at the other end of `peer`; recovering in place,
    the attempts after it too: its survivors unwind on the supervisor's word and go on, the ranks lost start anew."""

    def __init__(
        self, peer: Any, layout: RunLayout, attempt: int, fence_s: float, token: str, memory_prefix: str | None = None
    ) -> None:
        self._token = token
        self._peer = peer
        self._layout = layout
        self._attempt = attempt
        self._fence_s = fence_s
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._ranks: Ranks | None = None
        self._exited: set[int] = set()
        self._said_done = False  # every rank exited and the supervisor was told
        self._files = HeartbeatFiles(layout)
        self._beats: dict[int, int] = {}  # rank -> seq of the last beat sent
        self._unsent: dict[int, tuple[dict[str, Any], float]] = {}  # rank -> its newest record, when it was written
        self._unreadable: set[int] = set()
        self._heard = time.monotonic()
        self._beat_sent = 0.0
        self._host = socket.gethostname()
        self._succession: Succession | None = None  # how to take the supervisor's place, once it said
        self._memory_prefix = memory_prefix
        self._memory: NodeMemory | None = None  # this node's memory tier, when on and its directory could serve
        self._inventory: dict[str, Any] | None = None  # what the supervisor was last told this node holds
        self._preparing = False  # gathering what the ranks resume from (a launch under way)
        self._unwound = attempt  # the attempt before this one, recovering in place
        self._unwinding = False  # the attempt unwinds: its survivors' beats go to the supervisor at once

    def run(self) -> int:
        for signum in FORWARDED_SIGNALS:  # Slurm signals every process of the step: the supervisor decides
            signal.signal(signum, lambda s, _f: self._inbox.put(("signal", s)))
        self._peer.serve(lambda m: self._inbox.put(("message", m)), lambda why: self._inbox.put(("end", why)))
        memory_port = self._open_memory()
        self._send(
            "hello",
            token=self._token,
            node=self._host,
            attempt=self._attempt,
            pid=os.getpid(),
            port=free_port("0.0.0.0"),
            slurm_node_id=os.environ.get("SLURM_NODEID"),
            gpu_problems=gpu_problems(),
            gpus=count_gpus().to_json(),  # judged against the job's `device` (`reported_shortage`)
            cuda_visible_devices=os.environ.get(ENV_VISIBLE),  # what the ranks inherit here
            memory_port=memory_port,
            memory=self._memory_inventory(),
        )
        fenced: str | None = None
        ended = False
        try:
            fenced, ended = self._loop()
        finally:
            killed = self._kill_all()
            self._peer.close()
            self._close_memory(remove=ended)
        if fenced is None:
            faulthandler.cancel_dump_traceback_later()
            return 0
        print(f"trainwarden agent: {fenced}: fencing", file=sys.stderr)
        self.journal("agent_fenced", "warning", why=fenced, ranks_killed=killed)
        self._succeed()
        faulthandler.cancel_dump_traceback_later()
        return 1

    def _succeed(self) -> None:
        """Stand for successor; on winning the lease, become the new supervisor (exec: no return)."""
        succession = self._succession
        if succession is None:
            return
        deadline = time.monotonic() + succession.wait_s()
        faulthandler.dump_traceback_later(succession.wait_s() + STALL_S, repeat=True)
        lease, why = stand_for_successor(
            self._layout,
            succession,
            here=self._host,
            deadline=deadline,
            say=lambda line: self.journal("successor_waiting_for_controller", "warning", why=line),
        )
        if lease is None:
            self.journal("successor_declined", "info", why=why, generation=succession.generation)
            return
        self.journal(
            "successor_claimed", "warning", generation=lease.generation, previous_generation=succession.generation
        )
        become_successor(self._layout, succession, lease)

    def journal(self, event: str, level: str, **fields: Any) -> None:
        try:
            append_event(
                self._layout.journal,
                root=self._layout.root,
                event=event,
                level=level,
                node=self._host,
                attempt=self._attempt,
                agent_pid=os.getpid(),
                **fields,
            )
        except OSError as exc:
            print(f"trainwarden agent: cannot write the journal: {exc}", file=sys.stderr)

    def _loop(self) -> tuple[str | None, bool]:
        """Until the supervisor says exit (None, and whether the run ended), or why the agent must fence."""
        armed = -math.inf
        while True:
            if time.monotonic() - armed >= BEAT_S:  # re-armed (a thread started) once a second, not every poll
                faulthandler.dump_traceback_later(self._fence_s + STALL_S, repeat=True)
                armed = time.monotonic()
            try:
                kind, payload = self._inbox.get(timeout=POLL_S)
            except queue.Empty:
                kind, payload = "tick", None
            if kind == "message":
                self._heard = time.monotonic()
                if payload["type"] == "exit":
                    return None, payload.get("end") is True
                try:
                    self._on_message(payload)
                except (KeyError, TypeError, ValueError) as exc:
                    print(f"trainwarden agent: bad order {payload.get('type')!r}: {exc}", file=sys.stderr)
            elif kind == "end":
                return f"supervisor gone ({payload or 'end of stream'})", False
            elif kind == "resume_prepared":
                self._spawn(*payload)
            elif kind == "exited":
                self._on_rank_exit(*payload)
            elif kind == "signal":
                self._send("signal", signum=payload)
            elif kind == "stacks":
                self._send("stacks", **payload)
            if self._done() and not self._said_done:
                sigkill(descendants())  # a rank's grandchildren do not outlive the attempt
                if self._memory is not None:  # the copy under way finishes; later pins wait for the next attempt
                    self._memory.stop_persisting()
                self._send("done")
                # Stay until the supervisor says exit: ranks that died because the supervisor's host did (their
                # collective broke) must not take away the successor that this agent may have to become.
                self._said_done = True
            self._forward_heartbeats(now=self._unwinding)
            if time.monotonic() - self._heard > self._fence_s:
                return f"nothing from the supervisor for {self._fence_s:g} s", False

    def _done(self) -> bool:
        return self._ranks is not None and self._exited >= set(self._ranks.procs)

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "launch":
            self._launch(message)
        elif kind == "signal" and self._ranks is not None:
            ranks = {int(r) for r in message["ranks"]}
            sent = [r for r, p in self._ranks.procs.items() if r in ranks and signal_group(p.pid, message["signum"])]
            self._send("signalled", ranks=sent)
        elif kind == "dump_stacks" and self._ranks is not None:
            threading.Thread(
                target=self._dump_stacks, args=(message["ranks"], message["faulthandler"]), daemon=True
            ).start()
        elif kind == "unwind":
            self._unwind(int(message["attempt"]))
        elif kind == "succession":
            self._succession = Succession.from_json(message["succession"])
        elif kind == "order":
            order = message["order"]
            publish_order(self._layout, None if order is None else StopOrder.from_json(order), _StderrLog())

    def _unwind(self, attempt: int) -> None:
        """The supervisor's word that `attempt` unwinds (worker.recovery), written where this node's ranks read it,
        then UNWIND_SIGNAL to each survivor's leader; the supervisor gets a fresh port for the next attempt's store,
        which rank 0 may host here."""
        if attempt != self._attempt or self._ranks is None:
            return
        publish_unwind(self._layout, attempt)  # a rename on NFS is seen at once on the node that made it
        for rank, proc in self._ranks.procs.items():
            if rank not in self._exited and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, UNWIND_SIGNAL)
        self._unwinding = True
        self._send("unwinding", port=free_port("0.0.0.0"))

    def _launch(self, message: dict[str, Any]) -> None:
        if self._preparing:
            return
        if "keep" in message:  # the next attempt, in place: this agent and its surviving ranks go on
            if self._ranks is None or int(message["attempt"]) <= self._attempt:
                return
            self._move_on(int(message["attempt"]))
        elif self._ranks is not None:
            return
        memory = message.get("memory")
        resume = memory.get("resume") if isinstance(memory, dict) and self._memory is not None else None
        if not isinstance(resume, dict):
            self._spawn(message, None)
            return
        self._preparing = True  # a launch under way: a second one is not started meanwhile
        node_memory, world_size = self._memory, int(message["memory"]["world_size"])
        assert node_memory is not None
        sources = {int(rank): holder for rank, holder in resume["sources"].items()}

        def prepare() -> None:  # a fetch from another node may take a while: the loop keeps talking meanwhile
            problem = node_memory.prepare_resume(int(resume["step"]), sources, world_size)
            self._inbox.put(("resume_prepared", (message, problem)))

        threading.Thread(target=prepare, name="memory-resume", daemon=True).start()

    def _move_on(self, attempt: int) -> None:
        """From now on this agent runs `attempt`: what it knew of the one before goes."""
        self._unwound, self._attempt = self._attempt, attempt
        self._unwinding = self._said_done = False
        self._exited, self._beats, self._unsent, self._unreadable = set(), {}, {}, set()

    def _spawn(self, message: dict[str, Any], resume_problem: str | None) -> None:
        self._preparing = False
        if resume_problem is not None:
            self._send("resume_failed", step=message["memory"]["resume"]["step"], reason=resume_problem)
            return
        envs = {int(rank): local_env(env) for rank, env in message["envs"].items()}
        keep = {int(rank) for rank in message.get("keep", ())}
        kept = self._ranks.keep(keep) if keep and self._ranks is not None else None
        went_on = [] if kept is None else sorted(kept.procs)  # before the ranks started anew join them
        if self._memory_prefix is not None:
            # This node's memory directory, even where it could not be made: its ranks then refuse it and tell the
            # others (the tier is agreed by every rank, or snapshots stay on disk everywhere).
            directory = str(memory_dir_for(self._layout.root))
            envs = {rank: {**env, ENV_MEMORY_DIR: directory} for rank, env in envs.items()}
        if kept is not None:  # told the next attempt's variables instead; the others start anew beside them
            publish_next(self._layout, self._unwound, self._attempt, envs[min(kept.procs)])
            envs = {rank: env for rank, env in envs.items() if rank not in kept.procs}
        try:
            self._ranks = spawn_ranks(
                message["argv"],
                envs,
                self._layout,
                self._attempt,
                lambda _a, rank, code: self._inbox.put(("exited", (rank, code))),
                kept=kept,
            )
        except OSError as exc:
            self._send("spawn_failed", error=f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
            return
        pids = {str(rank): proc.pid for rank, proc in self._ranks.procs.items()}
        self._send("spawned", pids=pids, kept=went_on)
        orders = message.get("memory")
        if self._memory is not None and isinstance(orders, dict):
            self._memory.run_for(
                sorted(self._ranks.procs),
                int(orders["world_size"]),
                orders.get("partner"),
                float(orders["rate_bytes_s"]),
                _JournalLog(self),
                persist_mb_s=float(orders.get("persist_mb_s", 0.0)),
            )

    # -- the memory tier on this node (node_memory.py) --

    def _open_memory(self) -> int | None:
        """This node's memory directory made and served when the tier is on; the port other agents reach it at."""
        if self._memory_prefix is None:
            return None
        path = memory_dir_for(self._layout.root)
        try:
            layout = replace(self._layout, memory=create_memory_dir(path))
            self._memory = NodeMemory(layout, self._host, self._token, self._memory_prefix, self.journal)
            return self._memory.serve()
        except OSError as exc:
            self._memory = None
            self.journal("memory_tier_off", "warning", path=str(path), reason=str(exc), action="snapshots go to disk")
            return None

    def _memory_inventory(self) -> dict[str, Any] | None:
        return None if self._memory is None else self._memory.inventory()

    def _close_memory(self, *, remove: bool) -> None:
        """The run ended (`remove`): this node's memory directory goes; else it stays for the next attempt."""
        if self._memory is None:
            return
        self._memory.close()
        if remove:
            remove_memory_dir(self._memory.memory)

    def _on_rank_exit(self, rank: int, code: int) -> None:
        self._forward_heartbeats(only=[rank], now=True)  # the step it reached, before its exit
        self._exited.add(rank)
        # What this node's memory holds now: the choice of where to resume comes next, and a beat's is a second old.
        self._inventory = self._memory_inventory()
        self._send("exited", rank=rank, code=code, **({} if self._inventory is None else {"memory": self._inventory}))

    def _dump_stacks(self, ranks: list[int], faulthandler: list[int]) -> None:
        assert self._ranks is not None
        pids = {r: self._ranks.procs[r].pid for r in ranks if r in self._ranks.procs}
        dumps = collect_stacks(
            self._layout,
            self._attempt,
            pids,
            tuple(r for r in faulthandler if r in pids),
            ranks=tuple(self._ranks.procs),
        )
        self._inbox.put(
            (
                "stacks",
                {
                    "paths": list(dumps.paths),
                    "last_steps": [list(p) for p in dumps.last_steps],
                    "stacks": {str(r): t[-MAX_STACK_CHARS:] for r, t in dumps.by_rank.items()},
                    "flights": {str(r): f for r, f in dumps.flights.items()},
                    "states": {str(r): s for r, s in dumps.states.items()},
                    "expected": list(dumps.expected),
                },
            )
        )

    def _forward_heartbeats(self, only: list[int] | None = None, *, now: bool = False) -> None:
        """Every BEAT_S (or `now`), one message with the newest record of each rank that beat since the last one,
        each with its age; an empty one says the agent is alive."""
        for rank in (self._ranks.procs if self._ranks else {}) if only is None else only:
            try:
                seen = self._files.read(rank)
            except HeartbeatUnreadable as exc:
                if rank not in self._unreadable:
                    self._send("unreadable", rank=rank, error=str(exc))
                self._unreadable.add(rank)
                continue
            self._unreadable.discard(rank)
            if seen is not None and seen.attempt == self._attempt and self._beats.get(rank) != seen.seq:
                self._beats[rank] = seen.seq
                self._unsent[rank] = (beat_record(seen), time.monotonic() - seen.age_s)
        if (now and self._unsent) or time.monotonic() - self._beat_sent >= BEAT_S:
            sent = self._beat_sent = time.monotonic()
            beats = [{**record, "age_s": round(sent - written, 3)} for record, written in self._unsent.values()]
            self._unsent = {}
            inventory = self._memory_inventory()
            if inventory == self._inventory:
                self._send("beat", beats=beats)
            else:  # what this node holds in memory, when it changed
                self._inventory = inventory
                self._send("beat", beats=beats, memory=inventory)

    def _send(self, kind: str, **fields: Any) -> None:
        self._peer.send({"type": kind, "attempt": self._attempt, **fields})  # recovering in place, it moves on

    def _kill_all(self) -> list[int]:
        """SIGKILL every rank still running and everything they started; the ranks killed."""
        killed = []
        if self._ranks is not None:
            killed = self._ranks.signal(signal.SIGKILL, only=lambda rank: rank not in self._exited)
        sigkill(descendants())
        return sorted(killed)


def beat_record(seen: HeartbeatSeen) -> dict[str, Any]:
    """A heartbeat as the wire carries it: its fields that have a value."""
    return {key: value for key, value in asdict(seen).items() if value is not None and key != "age_s"}


class _JournalLog:
    """The persister's log on a node: the run's journal, as the agent writes it."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def info(self, event: str, **fields: Any) -> None:
        self._agent.journal(event, "info", **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._agent.journal(event, "error", **fields)


class _StderrLog:
    """Where the agent's few complaints go: its stderr, which srun labels and the supervisor's log keeps."""

    def error(self, event: str, **fields: Any) -> None:
        print(f"trainwarden agent: {event} {fields}", file=sys.stderr)


def agent_log(layout: RunLayout, host: str) -> Path:
    return layout.root / "logs" / f"agent_{''.join(c if c.isalnum() or c in '.-' else '_' for c in host)}.log"


def log_to_own_file(layout: RunLayout) -> None:
    """Standard output and error to this node's own log in the run dir, not srun's pipes to the batch host: what
    the agent says after that host died (its fencing, its stall dumps) stays readable, and no write of it depends on
    forwarding to an srun that is gone. Kept on srun's if the file cannot be made."""
    path = agent_log(layout, socket.gethostname())
    try:
        ensure_dir(layout.root, path.parent)
        fd = open_append(path, root=layout.root)
    except OSError as exc:
        print(f"trainwarden agent: cannot open {path}, writing to srun's output: {exc}", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for target in (1, 2):
        os.dup2(fd, target)  # inheritable: an exec'd successor keeps writing here
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    from supervisor.launch.wire import Peer

    parser = argparse.ArgumentParser(prog="python -m supervisor.agent")
    parser.add_argument("--connect", required=True, metavar="HOST:PORT")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--fence-s", type=float, required=True)
    parser.add_argument("--memory-prefix")
    args = parser.parse_args(argv)
    die_with_parent()  # srun's step daemon going away takes us along
    layout = RunLayout(Path(args.run_dir))
    log_to_own_file(layout)
    host, _, port = args.connect.rpartition(":")
    token = os.environ.pop(ENV_TOKEN, "")
    try:
        sock = socket.create_connection((host, int(port)), timeout=10)
    except OSError as exc:
        print(f"trainwarden agent: cannot reach the supervisor at {args.connect}: {exc}", file=sys.stderr)
        return 1
    os.environ[ENV_RUN_DIR] = str(layout.root)
    agent = Agent(Peer(sock), layout, args.attempt, args.fence_s, token, args.memory_prefix)
    try:
        return agent.run()
    except Exception as exc:
        agent.journal("agent_died", "error", error=repr(exc)[:300])  # its ranks died with it (parent-death signal)
        raise
