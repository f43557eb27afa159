"""Multi-node runs inside a Slurm allocation: each attempt is one `srun` job step with one node agent per node.

Slurm places, starts and cleans up; the supervisor decides. Per attempt the launcher picks `nodes` nodes of the
allocation that the node ledger does not exclude (spares wait their turn), starts the agents with
`srun --overlap -N k -w <nodes> --ntasks-per-node=1`, and waits for each to dial in over TCP with the run's
token. It then places the ranks (node i runs ranks i*n .. i*n+n-1, GROUP_RANK i; MASTER_ADDR is node 0 as the
supervisor reaches it, MASTER_PORT a port node 0 found free) and turns what the agents report into the core's
events. A node whose agent falls silent for `slurm.node_timeout_s` (or whose stream breaks) is lost: its ranks
count as killed, it is charged in the ledger and excluded, and the next attempt runs on the rest plus a spare.
A step stuck on a dead node is not waited for (Slurm may take minutes to give it up): `--overlap` lets the next
step start beside it. Nothing here reads heartbeats or exits from the shared filesystem (NFS caches them).
"""

from __future__ import annotations

import contextlib
import hmac
import math
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.causes import Cause, CauseKind
from supervisor.config import JobConfig
from supervisor.core import ChildExited, Event, HeartbeatSeen, LaunchFailed, RankState, SignalReceived, StacksCollected
from supervisor.launcher import Spawned, publish_order
from supervisor.nodes import Ledger, NodeFault, TooFewNodes, plan_nodes
from supervisor.ranks import Attempt, Placement, contract_env, rank_argv
from supervisor.stacks import FAULTHANDLER_WAIT_S, PYSPY_TIMEOUT_S, outside_collectives
from supervisor.watch import progress_fields
from supervisor.wire import Peer, WireError
from worker.contract import EXIT_REQUEUE, RunLayout, StopOrder
from worker.files import open_append

__all__ = ["SlurmError", "SlurmLauncher", "allocation", "in_allocation"]

HELLO_TIMEOUT_S = 60.0  # srun to every agent dialled in: Slurm's step launch plus Python's start-up
PING_S = 1.0
STACKS_GRACE_S = 5.0  # beyond the agents' own dump timeouts
SIGNAL_DEDUP_S = 5.0  # Slurm signals every node's agent at once: one stop request, not one per node
MAX_HELLO_WAIT_S = 10.0  # a connection that says nothing for this long is dropped


class SlurmError(Exception):
    """Not in a usable Slurm allocation."""


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def allocation() -> list[str]:
    """The allocation's hostnames, in Slurm's order (`scontrol show hostnames` expands `node[1-3]`)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: not inside an sbatch/salloc allocation")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmError(f"cannot expand the node list {nodelist!r} with scontrol: {exc}") from None
    return out.split()


@dataclass
class _Node:
    """One node of the current attempt, as its agent reports it."""

    name: str
    group_rank: int
    ranks: tuple[int, ...]
    peer: Peer | None = None
    address: str | None = None
    port: int | None = None
    heard: float = 0.0  # monotonic: the last message from its agent
    pids: dict[int, int] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)
    state: str = "starting"  # starting, running, done, lost
    stacks: dict[str, Any] | None = None


@dataclass(frozen=True)
class _AgentSaid:
    attempt: int
    node: str
    message: dict[str, Any]


@dataclass(frozen=True)
class _AgentGone:
    attempt: int
    node: str
    why: str | None


@dataclass(frozen=True)
class _AgentArrived:
    peer: Peer
    hello: dict[str, Any]


class SlurmLauncher:
    """Node agents in one Slurm job step per attempt, reporting over TCP."""

    def __init__(self, config: JobConfig, layout: RunLayout, post: Callable[[object], None], log: Any,
                 *, nodes: list[str] | None = None) -> None:
        self._config = config
        self._layout = layout
        self._post = post
        self._log = log
        self._allocation = allocation() if nodes is None else nodes
        self._token = secrets.token_hex(16)
        self._server = socket.create_server(("0.0.0.0", 0), backlog=64)
        self._attempt: int | None = None
        self._pending = Attempt(0)  # the attempt being placed
        self._nodes: dict[str, _Node] = {}
        self._srun: list[subprocess.Popen] = []
        self._hello_deadline: float | None = None
        self._stacks_deadline: float | None = None
        self._signalled = False  # the supervisor signalled this attempt's ranks: later deaths are its doing
        self._last_ping = 0.0
        self._forwarded: dict[int, float] = {}  # signum -> when an agent's last forwarded one was posted
        self._spares: list[str] = []
        self._failed_on: str | None = None
        try:
            self._ledger = Ledger.load(layout)
        except (OSError, ValueError) as exc:
            log.error("node_ledger_unreadable", path=str(layout.node_ledger), error=str(exc), action="starting empty")
            self._ledger = Ledger()

    # ---- lifecycle ----

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True, name="agents").start()
        excluded = self._excluded()
        self._log.info("slurm_allocation", job=os.environ.get("SLURM_JOB_ID"), nodes=self._allocation,
                       excluded=excluded or None, listening=self._advertised())

    def close(self) -> None:
        for node in self._nodes.values():
            if node.peer is not None:
                node.peer.send({"type": "exit"})
        deadline = time.monotonic() + 3.0
        for proc in self._srun:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_steps()
        for node in self._nodes.values():
            if node.peer is not None:
                node.peer.close()
        self._server.close()

    @property
    def launched(self) -> bool:
        return self._attempt is not None

    # ---- launching ----

    def launch(self, attempt: Attempt) -> Spawned | LaunchFailed | None:
        for node in self._nodes.values():  # the last attempt's agents, if any is still there, fence themselves
            if node.peer is not None:
                node.peer.close()
        self._kill_steps()  # a step stuck on a lost node is not waited for
        try:
            nodes, self._spares = plan_nodes(self._allocation, self._excluded(), self._config.nodes)
        except TooFewNodes as exc:
            self._log.error("too_few_nodes", error=str(exc), resubmit_with=exc.exclude_option)
            return LaunchFailed(attempt.number, f"{exc}; requeue with {exc.exclude_option}", exit_code=EXIT_REQUEUE)
        n = self._config.nproc_per_node
        self._attempt, self._pending = attempt.number, attempt
        self._nodes = {name: _Node(name, i, tuple(range(i * n, (i + 1) * n))) for i, name in enumerate(nodes)}
        self._signalled, self._failed_on = False, None
        argv = self._srun_argv(attempt.number, nodes)
        env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": self._token}
        try:
            log = open_append(self._layout.root / "supervisor" / f"srun_attempt_{attempt.number}.log",
                              root=self._layout.root)  # the agents' stderr, labelled by srun
            try:
                self._srun.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                   start_new_session=True))
            finally:
                os.close(log)
        except OSError as exc:
            return LaunchFailed(attempt.number, f"cannot start srun: {exc.strerror or exc}")
        self._hello_deadline = time.monotonic() + HELLO_TIMEOUT_S
        self._log.info("agents_starting", attempt=attempt.number, nodes=nodes, spares=self._spares)
        return None

    def _srun_argv(self, attempt: int, nodes: list[str]) -> list[str]:
        srun = shutil.which("srun") or "srun"
        fence_s = max(1.0, self._config.slurm.node_timeout_s / 2)  # fenced well before it is declared lost
        # srun does not inherit the job's CPUs per task (Slurm 21.08+): the agent, parent of every rank of its
        # node, asks for what the job got on this node, or Slurm would confine the node's ranks to one CPU.
        cpus = os.environ.get("SLURM_CPUS_ON_NODE", "")
        return [srun, "--overlap", "--no-kill", "--kill-on-bad-exit=0", "--unbuffered", "--label",
                *([f"--cpus-per-task={cpus}"] if cpus.isdigit() else []),
                # --ntasks too: srun otherwise takes the job's SLURM_NTASKS (sbatch --ntasks-per-node=1 -N3: 3)
                f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(nodes)}",
                f"--job-name=trainwarden-attempt-{attempt}", *self._config.slurm.srun_args,
                sys.executable, "-m", "supervisor.agent", "--connect", self._advertised(),
                "--run-dir", str(self._layout.root), "--attempt", str(attempt), "--fence-s", f"{fence_s:g}"]

    def _advertised(self) -> str:
        """host:port the agents dial: TRAINWARDEN_SUPERVISOR_ADDR, else our address on the route to the nodes."""
        port = self._server.getsockname()[1]
        host = os.environ.get("TRAINWARDEN_SUPERVISOR_ADDR") or _route_address(self._allocation[0])
        return f"{host}:{port}"

    def _place(self) -> None:
        """Every agent is here: tell each which ranks to start, with torchrun's variables."""
        attempt = self._pending
        first = min(self._nodes.values(), key=lambda node: node.group_rank)
        master, port = first.address or "127.0.0.1", first.port or 29500
        world, n = self._config.world_size, self._config.nproc_per_node
        argv = rank_argv(self._config)
        for node in self._nodes.values():
            envs = {str(rank): contract_env(self._config, self._layout,
                                            Placement(rank, rank - node.ranks[0], node.group_rank, world, n), attempt,
                                            master_addr=master, port=port) for rank in node.ranks}
            assert node.peer is not None
            node.peer.send({"type": "launch", "argv": argv, "envs": envs})
        self._log.info("ranks_placed", attempt=attempt.number, master_addr=master, master_port=port,
                       nodes={node.name: list(node.ranks) for node in self._nodes.values()})

    # ---- the agents' stream ----

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """A connection counts once it proves it knows the run's token."""
        peer = Peer(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(MAX_HELLO_WAIT_S), 0))
        try:
            hello = peer.receive()
        except WireError:
            hello = None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))  # then wait as long as it takes
        token = hello.get("token") if hello else None
        if not (hello and hello["type"] == "hello" and isinstance(token, str)
                and hmac.compare_digest(token, self._token)):
            peer.close()
            return
        self._post(_AgentArrived(peer, hello))

    def translate(self, item: object) -> list[Event | Spawned] | None:
        if isinstance(item, _AgentArrived):
            return self._arrived(item.peer, item.hello)
        if isinstance(item, _AgentSaid):
            node = self._nodes.get(item.node)
            if item.attempt != self._attempt or node is None or node.state == "lost":
                return []
            node.heard = time.monotonic()
            try:
                return self._said(node, item.message)
            except (KeyError, TypeError, ValueError) as exc:
                self._log.warning("agent_message_unreadable", node=node.name, error=str(exc)[:200])
                return []
        if isinstance(item, _AgentGone):
            node = self._nodes.get(item.node)
            if item.attempt != self._attempt or node is None or node.state in ("done", "lost"):
                return []
            return self._lose(node, f"its agent's connection ended ({item.why or 'closed'})")
        return None

    def _arrived(self, peer: Peer, hello: dict[str, Any]) -> list[Event]:
        name, attempt = hello.get("node"), hello.get("attempt")
        node = self._nodes.get(name) if isinstance(name, str) else None
        if attempt != self._attempt or node is None or node.peer is not None or node.state != "starting":
            peer.send({"type": "exit"})  # a late agent of an older attempt, or a node not in this one
            peer.close()
            return []
        port = hello.get("port")
        node.peer, node.address, node.heard = peer, peer.address, time.monotonic()
        node.port = port if type(port) is int and 0 < port < 65536 else None
        peer.serve(lambda m, n=node.name, a=attempt: self._post(_AgentSaid(a, n, m)),
                   lambda why, n=node.name, a=attempt: self._post(_AgentGone(a, n, why)))
        self._log.info("agent_connected", attempt=attempt, node=node.name, address=node.address,
                       agent_pid=hello.get("pid"))
        if all(n.peer is not None for n in self._nodes.values()):
            self._hello_deadline = None
            self._place()
        return []

    def _said(self, node: _Node, message: dict[str, Any]) -> list[Event | Spawned]:
        kind = message["type"]
        if kind == "beat":
            return [beat for record in message["beats"] if (beat := self._beat(node, record)) is not None]
        if kind == "spawned":
            node.pids = {int(rank): int(pid) for rank, pid in message["pids"].items() if int(rank) in node.ranks}
            node.state = "running"
            if all(n.state == "running" for n in self._nodes.values()):
                pids = tuple(pid for n in sorted(self._nodes.values(), key=lambda n: n.group_rank)
                             for _, pid in sorted(n.pids.items()))
                return [Spawned(self._attempt or 0, pids)]
            return []
        if kind == "spawn_failed":
            self._kill_steps()
            return [LaunchFailed(self._attempt or 0, f"on {node.name}: {str(message['error'])[:300]}")]
        if kind == "exited":
            return self._exited(node, int(message["rank"]), int(message["code"]))
        if kind == "stacks":
            node.stacks = message
            return self._stacks_if_all_in()
        if kind == "signal":
            return self._forwarded_signal(int(message["signum"]))
        if kind == "unreadable":
            self._log.warning("heartbeat_unreadable", rank=int(message["rank"]), node=node.name,
                              error=str(message["error"])[:300])
        elif kind == "done":
            node.state = "done"
        return []

    def _beat(self, node: _Node, record: Any) -> HeartbeatSeen | None:
        if not isinstance(record, dict):
            return None
        fields = ("attempt", "rank", "seq", "step", "phase", "step_time_s")
        beat = HeartbeatSeen(**{k: record.get(k) for k in fields}, **progress_fields(record))
        ok = beat.rank in node.ranks and beat.attempt == self._attempt and all(
            type(v) is int and v >= 0 for v in (beat.seq, beat.step)) and isinstance(beat.phase, str) and (
            beat.step_time_s is None or (type(beat.step_time_s) in (int, float) and beat.step_time_s > 0))
        return beat if ok else None

    def _exited(self, node: _Node, rank: int, code: int) -> list[Event]:
        if rank not in node.ranks or rank in node.exited:
            return []
        node.exited.add(rank)
        if code < 0 and not self._signalled and self._failed_on is None:  # the first death, not the stop's
            self._failed_on = node.name
            self._charge(node.name, f"rank {rank} killed by {_signal_name(-code)}", fatal=False)
        return [ChildExited(self._attempt or 0, rank, code, node=node.name)]

    def _forwarded_signal(self, signum: int) -> list[Event]:
        """Slurm signalled the step: USR1 is the time-limit warning, anything else a stop (never a second
        Ctrl-C, which would kill at once: the same signal may reach the supervisor itself too)."""
        signum = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        now = time.monotonic()
        if now - self._forwarded.get(signum, -SIGNAL_DEDUP_S) < SIGNAL_DEDUP_S:
            return []
        self._forwarded[signum] = now
        return [SignalReceived(signum)]

    def _lose(self, node: _Node, why: str) -> list[Event]:
        """A node is gone: its ranks count as killed, it is charged and never used again by this run."""
        node.state = "lost"
        if node.peer is not None:
            node.peer.close()
        if self._failed_on is None:
            self._failed_on = node.name
        self._log.error("node_lost", node=node.name, attempt=self._attempt, why=why, ranks=list(node.ranks))
        self._charge(node.name, f"lost: {why}", fatal=True)
        if any(n.state == "starting" for n in self._nodes.values()):  # no rank runs yet: start over without it
            return self._launch_again()
        cause = Cause(CauseKind.NODE_LOST, f"node {node.name} lost: {why}")
        events: list[Event] = []
        for rank in node.ranks:
            if rank not in node.exited:
                node.exited.add(rank)
                events.append(ChildExited(self._attempt or 0, rank, -signal.SIGKILL, cause=cause, node=node.name))
        if node.stacks is None and self._stacks_deadline is not None:
            node.stacks = {"paths": [], "stacks": {}, "last_steps": []}
            events += self._stacks_if_all_in()
        return events

    def _launch_again(self) -> list[Event]:
        """The attempt lost a node before its ranks started: the same attempt on the nodes left (each retry
        excludes a node for good, so this ends: at worst with too few nodes)."""
        failed = self.launch(self._pending)
        return [] if failed is None else [failed]

    def _charge(self, node: str, reason: str, *, fatal: bool) -> None:
        self._ledger = self._ledger.charged(NodeFault(node, time.time(), reason, fatal))
        try:
            self._ledger.save(self._layout)
        except OSError as exc:
            self._log.error("node_ledger_write_failed", error=str(exc))
        excluded = self._excluded()
        if node in excluded:
            self._log.warning("node_excluded", node=node, why=excluded[node])

    def _excluded(self) -> dict[str, str]:
        slurm = self._config.slurm
        return self._ledger.excluded(time.time(), max_failures=slurm.max_node_failures,
                                     window_s=slurm.node_failure_window_s)

    # ---- orders to the agents ----

    def _send(self, ranks: Collection[int], message: Callable[[list[int]], dict[str, Any]]) -> list[int]:
        reached = []
        for node in self._nodes.values():
            mine = [rank for rank in node.ranks if rank in ranks]
            if mine and node.peer is not None and node.state not in ("lost", "done") and node.peer.send(message(mine)):
                reached += mine
        return reached

    def signal(self, attempt: int, signum: int, ranks: Collection[int]) -> list[int]:
        if attempt != self._attempt:
            return []
        self._signalled = True
        return self._send(ranks, lambda mine: {"type": "signal", "signum": signum, "ranks": mine})

    def dump_stacks(self, attempt: int, ranks: tuple[int, ...], faulthandler_ranks: tuple[int, ...]) -> None:
        if attempt != self._attempt:
            self._post(StacksCollected(attempt, ()))
            return
        for node in self._nodes.values():
            node.stacks = None if node.state == "running" and set(node.ranks) & set(ranks) else {}
        self._stacks_deadline = time.monotonic() + PYSPY_TIMEOUT_S * self._config.nproc_per_node + \
            FAULTHANDLER_WAIT_S + STACKS_GRACE_S
        asked = self._send(ranks, lambda mine: {"type": "dump_stacks", "ranks": mine,
                                                "faulthandler": [r for r in mine if r in faulthandler_ranks]})
        if not asked:
            self._post(StacksCollected(attempt, ()))
            self._stacks_deadline = None

    def _stacks_if_all_in(self, *, timed_out: bool = False) -> list[Event]:
        if self._stacks_deadline is None or (not timed_out and any(n.stacks is None for n in self._nodes.values())):
            return []
        self._stacks_deadline = None
        paths, by_rank, last_steps = [], {}, []
        for node in self._nodes.values():
            got = node.stacks or {}
            paths += [str(p) for p in got.get("paths", [])]
            by_rank.update({int(r): str(t) for r, t in got.get("stacks", {}).items() if int(r) in node.ranks})
            last_steps += [(int(r), int(s)) for r, s in got.get("last_steps", []) if int(r) in node.ranks]
        culprit = outside_collectives(by_rank)
        suspect = next((n for n in self._nodes.values() if culprit in n.ranks), None)
        if suspect is not None:
            self._charge(suspect.name, f"hang: rank {culprit} was the one rank outside a collective", fatal=False)
        return [StacksCollected(self._attempt or 0, tuple(sorted(paths)), culprit=culprit,
                                last_steps=tuple(last_steps))]

    def kill_leftovers(self, attempt: int, survivors: Iterable[RankState]) -> None:
        """Each agent kills its ranks' grandchildren itself before it reports done."""

    def publish(self, order: StopOrder | None) -> None:
        publish_order(self._layout, order, self._log)  # for `status` and any rank on this machine
        payload = None if order is None else asdict(order)
        for node in self._nodes.values():  # each agent writes it on its own node: no NFS cache in the way
            if node.peer is not None and node.state == "running":
                node.peer.send({"type": "order", "order": payload})

    def last_heartbeat(self, rank: int) -> list[Event]:
        return []  # the agent sent the rank's last beat before its exit

    def poll(self) -> list[Event]:
        now = time.monotonic()
        events: list[Event] = []
        if self._hello_deadline is not None and now > self._hello_deadline:
            self._hello_deadline = None
            missing = [n.name for n in self._nodes.values() if n.peer is None]
            for name in missing:
                self._log.error("node_lost", node=name, attempt=self._attempt, why="its agent never connected")
                self._charge(name, f"lost: its agent did not connect within {HELLO_TIMEOUT_S:g} s", fatal=True)
            events += self._launch_again()
        if self._stacks_deadline is not None and now > self._stacks_deadline:
            events += self._stacks_if_all_in(timed_out=True)
        timeout = self._config.slurm.node_timeout_s
        for node in list(self._nodes.values()):
            if node.peer is not None and node.state in ("starting", "running") and now - node.heard > timeout:
                events += self._lose(node, f"no word from its agent for {now - node.heard:.1f} s")
        if now - self._last_ping >= PING_S:
            self._last_ping = now
            for node in self._nodes.values():
                if node.peer is not None and node.state in ("starting", "running"):
                    node.peer.send({"type": "ping"})
        return events

    def next_deadline(self) -> float:
        """The moment the quietest node's agent has been silent for the node timeout: it is declared lost then,
        not at the next once-a-second tick."""
        timeout = self._config.slurm.node_timeout_s
        heard = [n.heard for n in self._nodes.values() if n.peer is not None and n.state in ("starting", "running")]
        return min(heard) + timeout + 0.01 if heard else math.inf

    def oom_killed(self) -> bool:
        return False  # another node's cgroup is not ours to read

    def details(self) -> dict[str, Any]:
        now = time.monotonic()
        excluded = self._excluded()
        nodes = [{"node": n.name, "group_rank": n.group_rank, "state": n.state, "ranks": list(n.ranks),
                  "heartbeat_age_s": None if n.peer is None else round(now - n.heard, 3)}
                 for n in sorted(self._nodes.values(), key=lambda n: n.group_rank)]
        nodes += [{"node": name, "state": "spare"} for name in self._spares]
        nodes += [{"node": name, "state": "excluded", "why": why} for name, why in excluded.items()
                  if name in self._allocation]
        return {"nodes": nodes, "failed_on": self._failed_on, "slurm_job": os.environ.get("SLURM_JOB_ID"),
                "excluded_nodes": sorted(excluded)}

    def _kill_steps(self) -> None:
        """Kill the srun clients of earlier attempts; their agents fence themselves when the stream ends."""
        for proc in self._srun:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self._srun = [proc for proc in self._srun if proc.poll() is None]


def _route_address(node: str) -> str:
    """Our address on the route to `node` (a UDP connect sends nothing), so its agent can dial back."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(node), 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
