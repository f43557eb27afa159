"""Multi-node runs inside a Slurm allocation: each attempt is one `srun` job step with one node agent per node.

Slurm places, starts and cleans up; the supervisor decides. Per attempt the launcher asks Slurm for the job's
nodes now and their states (off the main loop), picks `nodes` of them that the node ledger does not exclude
(spares wait their turn), starts the agents with `srun --overlap -N k -w <nodes> --ntasks-per-node=1`, and waits
for each to dial in over TCP with the run's token. It then places the ranks (node i runs ranks i*n .. i*n+n-1,
GROUP_RANK i; MASTER_ADDR is node 0 as the supervisor reaches it, MASTER_PORT a port node 0 found free), tells
every agent how to take the supervisor's place (succession.py), and turns what the agents report into the core's
events. A node whose agent's stream breaks, or that falls silent for `slurm.node_timeout_s`, is lost: its ranks
count as killed, it is charged in the ledger (excluded for a cool-down, for good once Slurm marks it down), and
the next attempt runs on the rest plus a spare. The controller is not the network (controller.py): only when every
other node falls silent at once does the supervisor test its own link (can it reach the Slurm controller?): if not,
it is the one cut off, charges nobody, and hands over (Isolated). `scontrol` or `srun` failing alone only means the
controller is out of reach: the ranks running go on, and a new step waits for it (`slurm.controller_wait_s`,
`controller_unreachable` / `controller_back`); a step Slurm cannot create yet is tried again with backoff. A step
stuck on a dead node is not waited for: `--overlap` lets the next step start beside it.
Nothing here reads heartbeats or exits from the shared filesystem (NFS caches them).
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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from supervisor.config import JobConfig
from supervisor.core import (
    ChildExited,
    DeviceVerdict,
    Event,
    Heartbeats,
    HeartbeatSeen,
    LaunchFailed,
    RankState,
    SignalReceived,
    StacksCollected,
)
from supervisor.core.blame import IN_COLLECTIVE, SILENT
from supervisor.core.causes import Cause, CauseKind
from supervisor.launch import slurmctl
from supervisor.launch.controller import STEP_RETRIES, ControllerWait, cut_off, retry_delay_s, step_not_created_yet
from supervisor.launch.gpu_health import reported_shortage
from supervisor.launch.launcher import Isolated, Spawned, publish_order
from supervisor.launch.node_memory import (
    Held,
    MemoryChoice,
    choose_memory,
    held_here,
    parse_inventory,
    unheld_ranks,
)
from supervisor.launch.nodes import Ledger, NodeFault, TooFewNodes, device_fault, plan_nodes, update_ledger
from supervisor.launch.ranks import Attempt, Placement, contract_env, rank_argv
from supervisor.launch.stacks import FAULTHANDLER_WAIT_S, PYSPY_TIMEOUT_S, StackDumps, judge
from supervisor.launch.succession import Succession
from supervisor.launch.wire import Hub, Peer, WireError
from supervisor.rundir.lease import ABDICATED, HELD, RELEASED, Lease
from supervisor.rundir.lease import read as read_lease
from supervisor.rundir.throttle import MB
from supervisor.rundir.watch import progress_fields, recovery_fields
from worker.contract import EXIT_FAILED, EXIT_REQUEUE, RunLayout, StopOrder
from worker.files import open_append, read_bytes
from worker.store import MEMORY_LABEL

__all__ = ["SlurmLauncher", "in_allocation"]

HELLO_TIMEOUT_S = 60.0  # srun to every agent dialled in: Slurm's step launch plus Python's start-up
PINGS_PER_FENCE = 4  # an agent hears from us this many times within the silence that makes it fence its ranks
STACKS_GRACE_S = 5.0  # beyond the agents' own dump timeouts
SIGNAL_DEDUP_S = 5.0  # Slurm signals every node's agent at once: one stop request, not one per node
MAX_HELLO_WAIT_S = 10.0  # a connection that says nothing for this long is dropped
STEP_END_WAIT_S = 3.0  # an agent gone before launch: this long for srun to say the whole step failed
SRUN_LOG_TAIL = 4096
# A hang's culprit charges its node when the node is the likely cause: its device, link or kernel (a collective that
# never completed there, a frozen process); a host-side hang or a desync is the program's, the same on any node.
CHARGED_CLASSES = (IN_COLLECTIVE, SILENT)


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


@dataclass
class _Node:
    """One node of the current attempt, as its agent reports it."""

    name: str
    group_rank: int
    ranks: tuple[int, ...]
    attempt: int = 0  # the attempt its agent runs (recovering in place, it goes on into the next)
    peer: Peer | None = None
    address: str | None = None
    port: int | None = None
    memory_port: int | None = None  # where its agent serves the node's memory snapshots (node_memory.py)
    heard: float = 0.0  # monotonic: the last message from its agent
    pids: dict[int, int] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)
    kept: set[int] = field(default_factory=set)  # its ranks that went on in place into this attempt
    state: str = "starting"  # starting, running, done, lost
    stacks: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.peer is not None and self.state in ("starting", "running")

    def shown_state(self) -> str:
        """For `status`: a node whose ranks all exited runs nothing, whatever its agent last said."""
        if self.state == "done" or (
            self.state in ("starting", "running") and self.pids and set(self.ranks) <= self.exited
        ):
            return "ended"
        return self.state


@dataclass(frozen=True)
class _AgentSaid:
    attempt: int
    node: str
    message: dict[str, Any]


@dataclass(frozen=True)
class _BeatsArrived:
    """Agents sent heartbeats: the launcher holds them until the main loop takes them all at once."""


@dataclass(frozen=True)
class _AgentGone:
    attempt: int
    node: str
    why: str | None


@dataclass(frozen=True)
class _AgentArrived:
    peer: Peer
    hello: dict[str, Any]


@dataclass(frozen=True)
class _Planned:
    """What Slurm said before an attempt: the job's nodes now and their states, or why it could not be asked."""

    attempt: int
    nodes: tuple[str, ...] = ()
    states: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    reachable: bool = True  # the controller answered `scontrol ping`
    asked: float | None = None  # monotonic: when the question that failed was asked


@dataclass(frozen=True)
class _SrunExited:
    pid: int  # which srun: an attempt placed again (a node lost before launch) keeps its number
    returncode: int


@dataclass(frozen=True)
class _LinkChecked:
    """`scontrol ping` from here, asked when every other node fell silent or srun failed before any agent spoke."""

    attempt: int
    reachable: bool
    suspects: tuple[str, ...]  # the silent nodes ((): an srun failure)
    why: str
    srun_said: str | None = None  # srun exited before every agent dialled in, with these last words


class SlurmLauncher:
    """Node agents in one Slurm job step per attempt, reporting over TCP."""

    def __init__(
        self,
        config: JobConfig,
        layout: RunLayout,
        post: Callable[[object], None],
        log: Any,
        *,
        lease: Lease | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self._config = config
        self._layout = layout
        self._post = post
        self._log = log
        self._lease = lease
        self._args = tuple(args)  # our own command line, for a successor
        self._host = socket.gethostname()
        self._allocation = _nodelist_at_start()  # until the first plan asks Slurm for the nodes now
        self._seen = list(self._allocation)  # every node the job held: one Slurm dropped is still worth showing
        self._states: dict[str, str] = {}  # Slurm's state of each node, as of the last plan
        self._token = secrets.token_hex(16)
        self._server = socket.create_server(("0.0.0.0", 0), backlog=1024)  # a fleet's agents dial in at once
        self._hub = Hub()  # reads every agent's stream
        self._beats_lock = threading.Lock()
        self._arrived_beats: dict[int, HeartbeatSeen] = {}  # rank -> its newest beat not yet taken
        self._attempt: int | None = None
        self._pending = Attempt(0)  # the attempt being placed
        self._nodes: dict[str, _Node] = {}
        self._width = config.nodes  # the nodes of the attempt (fewer than the config's when the run went on shrunk)
        self._not_kept: str | None = None  # why the ranks to keep in place were relaunched after all
        self._srun: list[subprocess.Popen] = []
        self._hello_deadline: float | None = None
        self._stacks_deadline: float | None = None
        self._collective_failed = False  # the stacks sought are a failed collective's, not a hang's
        self._checking_link = False
        self._controller = ControllerWait(config.slurm.controller_wait_s)
        self._retry_at: float | None = None  # when to plan the pending attempt again (controller wait, step retry)
        self._step_tries = 0  # steps of the pending attempt Slurm could not create yet
        self._ended_early: dict[str, tuple[str, float]] = {}  # node -> (why, until): its stream ended before launch
        self._signalled = False  # the supervisor signalled this attempt's ranks: later deaths are its doing
        self._last_ping = 0.0
        self._ping_s = self._fence_s() / PINGS_PER_FENCE
        self._next_check = math.inf  # when poll must look for silent nodes next (see next_deadline)
        self._forwarded: dict[int, float] = {}  # signum -> when an agent's last forwarded one was posted
        self._failed_on: str | None = None
        self._ledger = self._load_ledger()
        # The memory tier across nodes (node_memory.py): what each node holds, kept across attempts (a node's memory
        # outlives its agent) until the node is lost; steps that failed to gather; the choice the next launch uses.
        self._held: dict[str, Held] = {}
        self._held_bytes: dict[str, int] = {}
        self._held_lock = threading.Lock()
        self._memory_refused: dict[int, str] = {}
        self._chosen: MemoryChoice | None = None

    def _load_ledger(self) -> Ledger:
        try:
            return Ledger.load(self._layout)
        except (OSError, ValueError) as exc:
            self._log.error(
                "node_ledger_unreadable", path=str(self._layout.node_ledger), error=str(exc), action="starting empty"
            )
            return Ledger()

    # ---- lifecycle ----

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True, name="agents").start()
        self._charge_predecessor()
        if self._memory_on() and (held := held_here(self._layout, self._config.worker.prefix)) is not None:
            self._hold(self._host, held)  # a successor's node: its snapshots and its partner's copy, before any agent
        self._log.info(
            "slurm_allocation",
            job=slurmctl.job_id(),
            host=self._host,
            excluded=self._excluded() or None,
            listening=self._advertised(),
        )

    def _charge_predecessor(self) -> None:
        """Taking over within the job: the last supervisor's host went silent or cut itself off, so it is charged
        as a lost node (a cool-down, for good once Slurm marks it down), and no attempt waits on it."""
        if self._lease is None:
            return
        before = read_lease(self._layout, self._lease.generation - 1)
        if before is not None and before.host == self._host and before.job == self._lease.job and before.batch:
            if before.state == HELD or (before.state == RELEASED and before.exit_code is None):
                # The batch script's supervisor died on this live host (killed, a Python error) without ending the
                # run; the script started us (`--take-over`). Its host lives: nobody is charged.
                self._log.warning(
                    "supervisor_replaced",
                    node=self._host,
                    previous_pid=before.pid,
                    previous_generation=before.generation,
                    lease=before.state,
                    generation=self._lease.generation,
                    charged=None,
                )
            return
        if before is None or before.state == RELEASED or before.host == self._host or before.job != self._lease.job:
            return
        self._log.warning(
            "supervision_taken_over",
            previous_host=before.host,
            previous_generation=before.generation,
            previous_pid=before.pid,
            lease=before.state,
            generation=self._lease.generation,
        )
        self._charge(
            before.host,
            f"lost: the supervisor's host (lease generation {before.generation} "
            f"{'abdicated' if before.state == ABDICATED else 'lapsed'})",
            "lost",
        )

    def close(self) -> None:
        for node in self._nodes.values():
            if node.peer is not None:
                node.peer.send({"type": "exit", "end": True})  # the run is over: its memory on each node goes
        deadline = time.monotonic() + 3.0
        for proc in self._srun:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_steps()
        self.hand_over()

    def hand_over(self) -> None:
        """Every agent's stream ends without a word: each fences its ranks and stands for successor. The srun
        clients are left alone: killing one ends its step, and a successor may live in it."""
        for node in self._nodes.values():
            if node.peer is not None:
                node.peer.close()
        self._server.close()
        self._hub.close()

    @property
    def launched(self) -> bool:
        return self._attempt is not None

    # ---- launching ----

    def prestart(self, attempt: int) -> None:
        """Nothing: the agents start their ranks when the attempt's launch reaches them."""

    def await_prestarted(self) -> None:
        """Nothing was started."""

    def launch(self, attempt: Attempt) -> None:
        """Ask Slurm for the nodes (in a thread: the controller may be slow or out of reach); `_Planned` goes on.
        Recovering in place (`attempt.keep`), the agents alive stay, with their steps and their surviving ranks."""
        kept = self._live_agents() if attempt.keep else {}
        for node in self._nodes.values():  # the last attempt's other agents, if any is still there, go
            if node.name not in kept:
                self._dismiss(node)
        if not kept:
            self._kill_steps()  # a step stuck on a lost node is not waited for
        if attempt.number != self._pending.number:
            self._step_tries = 0
        self._retry_at = None
        self._attempt, self._pending, self._nodes = None, attempt, kept
        self._not_kept = None if kept or not attempt.keep else "no node of the failed attempt has its agent left"
        self._hello_deadline, self._ended_early = None, {}
        threading.Thread(
            target=self._plan, args=(attempt.number, sorted(self._ledger_nodes())), daemon=True, name="slurm-plan"
        ).start()
        return None

    def _live_agents(self) -> dict[str, _Node]:
        """The nodes whose agents are here and whose ranks did not fail with them: they go on into the next attempt,
        each made ready for it."""
        live = {n.name: n for n in self._nodes.values() if n.peer is not None and n.state != "lost"}
        for node in live.values():
            node.state, node.pids, node.exited, node.stacks = "starting", {}, set(), None
        return live

    def _dismiss(self, node: _Node) -> None:
        if node.peer is not None:
            node.peer.send({"type": "exit"})  # said, not a fence: the supervisor is alive
            node.peer.close()

    def _ledger_nodes(self) -> set[str]:
        return {fault.node for fault in self._ledger.faults}

    def _plan(self, attempt: int, known: list[str]) -> None:
        asked = time.monotonic()
        try:
            nodes = slurmctl.allocation()
            states = slurmctl.node_states([*nodes, *known])
        except slurmctl.SlurmError as exc:
            self._post(_Planned(attempt, error=str(exc), reachable=slurmctl.controller_reachable(), asked=asked))
            return
        self._post(_Planned(attempt, tuple(nodes), states))

    def _planned(self, planned: _Planned) -> list[Event | Isolated]:
        if planned.attempt != self._pending.number or self._attempt is not None:
            return []
        if planned.error is not None:
            why = f"cannot ask Slurm for the job's nodes: {planned.error}"
            if not planned.reachable:  # no agent runs to judge our link by: the controller alone is out of reach
                return self._await_controller(planned.attempt, why, planned.asked)
            if self._step_tries < STEP_RETRIES:  # it answers now (it was slow, or just came back): ask again
                self._controller_answered()
                return self._retry_step(why)
            return [LaunchFailed(planned.attempt, why)]
        self._controller_answered()
        self._allocation, self._states = list(planned.nodes), planned.states
        self._seen += [node for node in planned.nodes if node not in self._seen]
        self._update_ledger(lambda ledger: ledger.confirmed(self._states, time.time()))
        if self._nodes:  # recovering in place: only the lost nodes' places are filled
            return self._fill_places(planned.attempt)
        try:
            nodes, spares = plan_nodes(self._allocation, self._excluded(), self._config.nodes, self._config.min_nodes)
        except TooFewNodes as exc:
            self._log.error("too_few_nodes", error=str(exc), resubmit_with=exc.exclude_option)
            return [LaunchFailed(planned.attempt, f"{exc}; requeue with {exc.exclude_option}", exit_code=EXIT_REQUEUE)]
        if len(nodes) < self._config.nodes:  # no spare left, and slurm.min_nodes allows it
            self._log.warning(
                "run_shrunk",
                attempt=planned.attempt,
                nodes=len(nodes),
                of_nodes=self._config.nodes,
                world_size=len(nodes) * self._config.nproc_per_node,
                excluded=sorted(self._excluded()),
            )
        failed = self._start_step(self._pending, {name: i for i, name in enumerate(nodes)}, spares)
        return [] if failed is None else [failed]

    def _fill_places(self, attempt: int) -> list[Event | Isolated]:
        """In place: the nodes kept go on in their places (one excluded since goes); a spare takes each other place
        in a new step of its own. Too few spares for the attempt's width: every node starts anew."""
        excluded = self._excluded()
        for name in [name for name in self._nodes if name in excluded or name not in self._allocation]:
            self._dismiss(self._nodes.pop(name))
        taken = {node.group_rank for node in self._nodes.values()}
        places = [place for place in range(self._width) if place not in taken]
        free = [name for name in self._allocation if name not in excluded and name not in self._nodes]
        if len(free) < len(places) or not self._nodes:
            self._not_kept = (
                f"no spare node for the place of each node lost ({len(free)} for {len(places)})"
                if self._nodes
                else "every node of the failed attempt is excluded"
            )
            for node in self._nodes.values():
                self._dismiss(node)
            self._kill_steps()
            self._nodes = {}
            return self._planned(_Planned(attempt, tuple(self._allocation), self._states))
        self._log.info("nodes_kept", attempt=attempt, nodes=sorted(self._nodes), places=places)
        if not places:
            self._attempt = attempt
            self._signalled, self._failed_on = False, None
            return list(self._place())
        failed = self._start_step(self._pending, dict(zip(free, places, strict=False)), free[len(places) :])
        return [] if failed is None else [failed]

    def _start_step(self, attempt: Attempt, places: dict[str, int], spares: list[str]) -> LaunchFailed | None:
        """A step of agents on the nodes of `places` (each name with its place, the group rank), beside the nodes
        kept from the attempt before."""
        n = self._config.nproc_per_node
        self._attempt = attempt.number
        self._nodes.update({name: _Node(name, i, tuple(range(i * n, (i + 1) * n))) for name, i in places.items()})
        self._width = len(self._nodes)
        self._signalled, self._failed_on = False, None
        env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": self._token}
        try:
            log = open_append(self._srun_log(attempt.number), root=self._layout.root)  # agents' stderr, labelled
            try:
                proc = subprocess.Popen(
                    self._srun_argv(attempt.number, list(places)),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            finally:
                os.close(log)
        except OSError as exc:
            return LaunchFailed(attempt.number, f"cannot start srun: {exc.strerror or exc}")
        self._srun.append(proc)
        threading.Thread(
            target=lambda: self._post(_SrunExited(proc.pid, proc.wait())), daemon=True, name=f"srun-a{attempt.number}"
        ).start()
        self._hello_deadline = time.monotonic() + HELLO_TIMEOUT_S
        self._log.info("agents_starting", attempt=attempt.number, nodes=list(places), spares=spares)
        return None

    def _srun_log(self, attempt: int) -> Any:
        return self._layout.root / "supervisor" / f"srun_attempt_{attempt}.log"

    def _srun_argv(self, attempt: int, nodes: list[str]) -> list[str]:
        srun = shutil.which("srun") or "srun"
        fence_s = self._fence_s()
        # srun does not inherit the job's CPUs per task (Slurm 21.08+): the agent, parent of every rank of its
        # node, asks for what the job got on this node, or Slurm would confine the node's ranks to one CPU.
        cpus = os.environ.get("SLURM_CPUS_ON_NODE", "")
        return [
            srun,
            "--overlap",
            "--no-kill",
            "--kill-on-bad-exit=0",
            "--unbuffered",
            "--label",
            *([f"--cpus-per-task={cpus}"] if cpus.isdigit() else []),
            # --ntasks too: srun otherwise takes the job's SLURM_NTASKS (sbatch --ntasks-per-node=1 -N3: 3)
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}",
            f"--job-name=trainwarden-attempt-{attempt}",
            *self._config.slurm.srun_args,
            sys.executable,
            "-m",
            "supervisor.agent",
            "--connect",
            self._advertised(),
            "--run-dir",
            str(self._layout.root),
            "--attempt",
            str(attempt),
            "--fence-s",
            f"{fence_s:g}",
            *(["--memory-prefix", self._config.worker.prefix] if self._memory_on() else []),
        ]

    def _memory_on(self) -> bool:
        """Snapshots in memory: asked for, and in checkpoints each node can hold its part of (not a framework's)."""
        return self._config.worker.snapshot_steps != 0

    def _fence_s(self) -> float:
        return max(1.0, self._config.slurm.node_timeout_s / 2)  # fenced well before it is declared lost

    def _advertised(self) -> str:
        """host:port the agents dial: TRAINWARDEN_SUPERVISOR_ADDR, else our address on the route to the nodes."""
        port = self._server.getsockname()[1]
        host = os.environ.get("TRAINWARDEN_SUPERVISOR_ADDR") or _route_address(
            next(iter(self._allocation), None) or os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
        )
        return f"{host}:{port}"

    def _place(self) -> list[Event]:
        """Every agent is here: tell each which ranks to start, with torchrun's variables."""
        attempt = self._pending
        if gone := self._holders_gone(attempt):  # the memory snapshot chosen is no longer within reach
            return self._resume_failed(next(iter(self._nodes.values())), {"step": attempt.resume_step, "reason": gone})
        first = min(self._nodes.values(), key=lambda node: node.group_rank)
        master, port = first.address or "127.0.0.1", first.port or 29500
        n = self._config.nproc_per_node
        world = len(self._nodes) * n  # fewer than the config's when the run goes on shrunk (slurm.min_nodes)
        argv = rank_argv(self._config)
        succession = self._succession()
        for node in self._nodes.values():
            envs = {
                str(rank): contract_env(
                    self._config,
                    self._layout,
                    Placement(rank, rank - node.ranks[0], node.group_rank, world, n),
                    attempt,
                    master_addr=master,
                    port=port,
                )
                for rank in node.ranks
            }
            assert node.peer is not None
            if succession is not None:
                node.peer.send({"type": "succession", "succession": succession.to_json()})
            launch: dict[str, Any] = {"type": "launch", "argv": argv, "envs": envs}
            if node.attempt != attempt.number:  # kept: its agent and its surviving ranks go on into this attempt
                launch.update(attempt=attempt.number, keep=[rank for rank in node.ranks if rank in attempt.keep])
                node.attempt = attempt.number
            if self._memory_on() and node.memory_port is not None:
                launch["memory"] = self._memory_orders(node, attempt, world)
            node.peer.send(launch)
        self._log.info(
            "ranks_placed",
            attempt=attempt.number,
            master_addr=master,
            master_port=port,
            nodes={node.name: list(node.ranks) for node in self._nodes.values()},
        )
        return []

    def _holders_gone(self, attempt: Attempt) -> str | None:
        """Resuming from memory: why some rank's snapshot cannot be fetched (its holder is not in this attempt)."""
        chosen = self._chosen
        if chosen is None or attempt.resume_step != chosen.step or attempt.resume_dir is None:
            return None
        for rank, holder in sorted(chosen.holders.items()):
            node = self._nodes.get(holder)
            if node is None or self._memory_address(node) is None:
                return f"rank {rank}'s copy is on {holder}, which is not in this attempt"
        return None

    def _succession(self) -> Succession | None:
        """How an agent takes our place: the other nodes of the attempt, in group-rank order, may."""
        if self._lease is None:
            return None
        lease = self._lease
        order = tuple(
            node.name for node in sorted(self._nodes.values(), key=lambda n: n.group_rank) if node.name != self._host
        )
        return Succession(
            lease.generation,
            lease.ttl_s,
            order,
            self._args,
            os.getcwd(),
            dict(os.environ),
            self._config.slurm.controller_wait_s,
        )

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
        if not (
            hello and hello["type"] == "hello" and isinstance(token, str) and hmac.compare_digest(token, self._token)
        ):
            peer.close()
            return
        self._post(_AgentArrived(peer, hello))

    def translate(self, item: object) -> Sequence[Event | Spawned | Isolated] | None:
        if isinstance(item, _AgentArrived):
            return self._arrived(item.peer, item.hello)
        if isinstance(item, _BeatsArrived):
            with self._beats_lock:
                beats, self._arrived_beats = self._arrived_beats, {}
            return [Heartbeats(tuple(beats.values()))] if beats else []
        if isinstance(item, _AgentSaid):
            node = self._nodes.get(item.node)
            if item.attempt != self._attempt or node is None or node.state == "lost":
                return []
            try:
                return self._said(node, item.message)
            except (KeyError, TypeError, ValueError) as exc:
                self._log.warning("agent_message_unreadable", node=node.name, error=str(exc)[:200])
                return []
        if isinstance(item, _AgentGone):
            node = self._nodes.get(item.node)
            if item.attempt != self._attempt or node is None or node.state in ("done", "lost"):
                return []
            why = f"its agent's connection ended ({item.why or 'closed'})"
            if node.state == "starting":  # the whole step may be failing (srun gave up on another node): wait
                self._ended_early[node.name] = (why, time.monotonic() + STEP_END_WAIT_S)
                return []
            return self._lose(node, why)
        if isinstance(item, _Planned):
            return self._planned(item)
        if isinstance(item, _SrunExited):
            return self._srun_exited(item)
        if isinstance(item, _LinkChecked):
            return self._link_checked(item)
        return None

    def _memory_orders(self, node: _Node, attempt: Attempt, world: int) -> dict[str, Any]:
        """A node's part of the memory tier this attempt: the partner its snapshots are copied to (the next node in
        the ring), and, resuming from memory, where each of its ranks' files is (None: here)."""
        ring = sorted(self._nodes.values(), key=lambda n: n.group_rank)
        partner = ring[(ring.index(node) + 1) % len(ring)]
        orders: dict[str, Any] = {
            "world_size": world,
            "partner": None if partner is node else self._memory_address(partner),
            "rate_bytes_s": self._config.slurm.peer_copy_mb_s * MB,
            "persist_mb_s": self._config.worker.persist_mb_s,
        }
        chosen = self._chosen
        if chosen is not None and attempt.resume_step == chosen.step and attempt.resume_dir is not None:
            holders = {rank: self._nodes.get(chosen.holders.get(rank, "")) for rank in node.ranks}
            orders["resume"] = {
                "step": chosen.step,
                "sources": {
                    str(rank): None if holder is node else self._memory_address(holder)
                    for rank, holder in holders.items()
                },
            }
        return orders

    def _memory_address(self, node: _Node | None) -> str | None:
        if node is None or node.address is None or node.memory_port is None:
            return None
        return f"{node.address}:{node.memory_port}"

    def memory_choice(
        self, world_size: int, *, newer_than: int | None, at_most: int | None, refused: Mapping[int, str]
    ) -> MemoryChoice | None:
        """The newest step the nodes' memory holds for every rank, newer than the disk's `newer_than` (the next
        launch gathers it on each node); None when there is none, or the tier is off."""
        if not self._memory_on():
            return None
        with self._held_lock:
            held = {node: ranks for node, ranks in self._held.items() if node not in self._excluded()}
        self._chosen = choose_memory(
            held, world_size, newer_than=newer_than, at_most=at_most, refused={**self._memory_refused, **refused}
        )
        if self._chosen is None and (unheld := unheld_ranks(held, world_size, newer_than=newer_than)) is not None:
            step, missing = unheld  # said plainly: a node and its partner were both lost
            self._log.warning(
                "memory_snapshot_lost",
                step=step,
                ranks_missing=missing,
                reason="no node still in the run holds these ranks' snapshot or its partner copy",
                action="resume from disk",
            )
        return self._chosen

    def _hold(self, node: str, inventory: Any) -> None:
        """What a node's agent says its memory holds (any thread)."""
        with self._held_lock:
            self._held[node] = parse_inventory(inventory)
            raw = inventory.get("bytes") if isinstance(inventory, dict) else None
            self._held_bytes[node] = raw if type(raw) is int and raw >= 0 else 0

    def _forget_memory(self, node: str) -> None:
        with self._held_lock:
            self._held.pop(node, None)
            self._held_bytes.pop(node, None)

    def _resume_failed(self, node: _Node, message: dict[str, Any]) -> list[Event]:
        """A node could not gather the memory snapshot its ranks were to resume from: that step is passed over and
        the attempt launched again (from the next candidate, disk at worst)."""
        step, reason = int(message["step"]), str(message["reason"])[:500]
        self._memory_refused[step] = f"{MEMORY_LABEL}: on {node.name}: {reason}"
        self._log.warning("snapshot_passed_over", step=step, reason=self._memory_refused[step], attempt=self._attempt)
        self._kill_steps()
        return [LaunchFailed(self._attempt or 0, f"memory snapshot of step {step} on {node.name}: {reason}")]

    def _arrived(self, peer: Peer, hello: dict[str, Any]) -> list[Event]:
        name = hello.get("node")
        attempt: Any = hello.get("attempt")  # the agent's word: this attempt's number, once checked below
        node = self._nodes.get(name) if isinstance(name, str) else None
        if attempt != self._attempt or node is None or node.peer is not None or node.state != "starting":
            peer.send({"type": "exit"})  # a late agent of an older attempt, or a node not in this one
            peer.close()
            return []
        if short := reported_shortage(self._config, hello, node.name):  # the job asks more of its nodes than they have
            peer.send({"type": "exit"})
            peer.close()
            self._kill_steps()
            self._hello_deadline = None
            return [LaunchFailed(attempt, short, retryable=False)]
        problems = hello.get("gpu_problems")
        if isinstance(problems, list) and problems:  # NVML on that node says a GPU needs a reset: not this attempt
            peer.send({"type": "exit"})
            peer.close()
            said = [str(p)[:200] for p in problems[:16]]
            self._log.error("gpu_unhealthy", node=node.name, attempt=attempt, problems=said)
            return self._lose(node, f"unhealthy GPU: {'; '.join(said)}")
        port, memory_port = hello.get("port"), hello.get("memory_port")
        node.peer, node.address, node.heard, node.attempt = peer, peer.address, time.monotonic(), attempt
        node.port = port if type(port) is int and 0 < port < 65536 else None
        node.memory_port = memory_port if type(memory_port) is int and 0 < memory_port < 65536 else None
        if node.memory_port is not None:
            self._hold(node.name, hello.get("memory"))
        self._hub.add(
            peer,
            lambda m: self._heard(node, m),
            lambda why: self._post(_AgentGone(node.attempt, node.name, why)),
        )
        self._log.info(
            "agent_connected", attempt=attempt, node=node.name, address=node.address, agent_pid=hello.get("pid")
        )
        if all(n.peer is not None for n in self._nodes.values()):
            self._hello_deadline = None
            return self._place()
        return []

    def _heard(self, node: _Node, message: dict[str, Any]) -> None:
        """In the hub's thread: the node is alive now (whatever the main loop's backlog); its beats are held for
        the main loop to take together, anything else goes to the main loop as it is. Each message is of the
        attempt its agent ran when it sent it."""
        node.heard = time.monotonic()
        said = message.get("attempt")
        attempt = said if type(said) is int else node.attempt
        if message["type"] != "beat":
            self._post(_AgentSaid(attempt, node.name, message))
            return
        if "memory" in message and node.state != "lost":
            self._hold(node.name, message["memory"])
        records = message.get("beats")
        beats = (
            [beat for record in records if (beat := self._beat(node, record)) is not None]
            if isinstance(records, list) and attempt == self._attempt
            else []
        )
        if not beats:
            return
        with self._beats_lock:
            first = not self._arrived_beats
            self._arrived_beats.update((beat.rank, beat) for beat in beats)
        if first:
            self._post(_BeatsArrived())

    def _said(self, node: _Node, message: dict[str, Any]) -> Sequence[Event | Spawned]:
        kind = message["type"]
        if kind == "spawned":
            node.pids = {int(rank): int(pid) for rank, pid in message["pids"].items() if int(rank) in node.ranks}
            node.kept = {int(rank) for rank in message.get("kept", ()) if int(rank) in node.ranks}
            node.state = "running"
            if all(n.state == "running" for n in self._nodes.values()):
                pids = tuple(
                    pid
                    for n in sorted(self._nodes.values(), key=lambda n: n.group_rank)
                    for _, pid in sorted(n.pids.items())
                )
                if not self._pending.keep:
                    return [Spawned(self._attempt or 0, pids)]
                kept = tuple(sorted(rank for n in self._nodes.values() for rank in n.kept))
                return [Spawned(self._attempt or 0, pids, kept=kept, not_kept=self._not_kept)]
            return []
        if kind == "resume_failed":
            return self._resume_failed(node, message)
        if kind == "unwinding":  # the port the next attempt's store may be hosted at, on this node
            port = message.get("port")
            node.port = port if type(port) is int and 0 < port < 65536 else node.port
            return []
        if kind == "spawn_failed":
            self._kill_steps()
            return [LaunchFailed(self._attempt or 0, f"on {node.name}: {str(message['error'])[:300]}")]
        if kind == "exited":
            if "memory" in message:
                self._hold(node.name, message["memory"])
            return self._exited(node, int(message["rank"]), int(message["code"]))
        if kind == "stacks":
            node.stacks = message
            return self._stacks_if_all_in()
        if kind == "signal":
            return self._forwarded_signal(int(message["signum"]))
        if kind == "unreadable":
            self._log.warning(
                "heartbeat_unreadable", rank=int(message["rank"]), node=node.name, error=str(message["error"])[:300]
            )
        elif kind == "done":
            node.state = "done"
        return []

    def _beat(self, node: _Node, record: Any) -> HeartbeatSeen | None:
        if not isinstance(record, dict):
            return None
        fields = ("attempt", "rank", "seq", "step", "phase", "step_time_s")
        age = record.get("age_s")  # bounded: an agent's clock error must not date a beat before the attempt
        age = min(float(age), self._config.slurm.node_timeout_s) if _is_number(age) and age > 0 else 0.0
        unchecked: dict[str, Any] = {k: record.get(k) for k in fields}  # the checks below judge the beat
        beat = HeartbeatSeen(**unchecked, **recovery_fields(record), **progress_fields(record), age_s=age)
        ok = (
            beat.rank in node.ranks
            and beat.attempt == self._attempt
            and all(type(v) is int and v >= 0 for v in (beat.seq, beat.step))
            and isinstance(beat.phase, str)
            and (beat.step_time_s is None or (type(beat.step_time_s) in (int, float) and beat.step_time_s > 0))
        )
        return beat if ok else None

    def _exited(self, node: _Node, rank: int, code: int) -> list[Event]:
        if rank not in node.ranks or rank in node.exited:
            return []
        node.exited.add(rank)
        if code < 0 and not self._signalled and self._failed_on is None:  # the first death, not the stop's
            self._failed_on = node.name
            self._charge(node.name, f"rank {rank} killed by {_signal_name(-code)}", "failed")
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

    # ---- lost nodes, and our own link ----

    def _lose(self, node: _Node, why: str) -> list[Event]:
        """A node is gone: its ranks count as killed (they are blocked with a lost peer), it is charged."""
        node.state = "lost"
        self._forget_memory(node.name)  # whatever it held in memory is out of reach
        if node.peer is not None:
            node.peer.close()
        if self._failed_on is None:
            self._failed_on = node.name
        self._log.error(
            "node_lost",
            node=node.name,
            attempt=self._attempt,
            why=why,
            ranks=list(node.ranks),
            slurm_state=self._states.get(node.name),
        )
        self._charge(node.name, f"lost: {why}", "lost")
        if any(n.state == "starting" for n in self._nodes.values()):  # no rank runs yet: start over without it
            return self._launch_again()
        cause = Cause(CauseKind.NODE_LOST, f"node {node.name} lost: {why}")
        events: list[Event] = []
        for rank in node.ranks:
            if rank not in node.exited:
                node.exited.add(rank)
                events.append(
                    ChildExited(
                        self._attempt or 0, rank, -signal.SIGKILL, cause=cause, node=node.name, lost_with=node.ranks
                    )
                )
        if node.stacks is None and self._stacks_deadline is not None:
            node.stacks = {"paths": [], "stacks": {}, "last_steps": []}
            events += self._stacks_if_all_in()
        return events

    def _launch_again(self) -> list[Event]:
        """The attempt lost a node before its ranks started: the same attempt on the nodes left (each retry
        excludes a node at least for its cool-down, so this ends: at worst with too few nodes)."""
        self.launch(self._pending)  # its outcome is posted (`_Planned`), never returned
        return []

    def _check_link(self, suspects: tuple[str, ...], why: str, srun_said: str | None = None) -> None:
        """Is it us? `scontrol ping` in a thread; `_LinkChecked` goes on."""
        self._checking_link = True
        attempt = self._attempt if self._attempt is not None else self._pending.number
        threading.Thread(
            target=lambda: self._post(_LinkChecked(attempt, slurmctl.controller_reachable(), suspects, why, srun_said)),
            daemon=True,
            name="link-check",
        ).start()

    def _link_checked(self, checked: _LinkChecked) -> list[Event | Isolated]:
        self._checking_link = False
        if checked.attempt not in (self._attempt, self._pending.number):
            return []
        remote = {n.name for n in self._nodes.values() if n.active and n.name != self._host}
        if checked.suspects and cut_off(remote, checked.suspects, False, checked.reachable):
            return [Isolated(f"{checked.why}, and the Slurm controller is out of reach from {self._host}")]
        if not checked.suspects:  # srun failed, or no agent dialled in: no node is to blame
            if not checked.reachable:
                return self._await_controller(checked.attempt, checked.why)
            self._controller_answered()
            if checked.srun_said is not None and not step_not_created_yet(checked.srun_said):
                # Slurm refused the step's request itself (an invalid option, a gres it has not): so will it again
                return [LaunchFailed(checked.attempt, checked.why, retryable=False, exit_code=EXIT_FAILED)]
            if checked.srun_said is not None and self._step_tries < STEP_RETRIES:
                return self._retry_step(checked.why)
            return [LaunchFailed(checked.attempt, checked.why)]  # retryable: a relaunch, while restarts are left
        events: list[Event | Isolated] = []
        now = time.monotonic()
        for name in checked.suspects:
            node = self._nodes.get(name)
            if node is not None and node.active and now - node.heard > self._config.slurm.node_timeout_s:
                events += self._lose(node, f"no word from its agent for {now - node.heard:.1f} s")
        return events

    def _await_controller(self, attempt: int, why: str, asked: float | None = None) -> list[Event | Isolated]:
        """What needs the controller (a new step) waits for it, bounded by `slurm.controller_wait_s`; the plan is
        asked again with backoff meanwhile. Past the wait, the run ends with 75, to be resubmitted."""
        now = time.monotonic()
        first, expired = self._controller.out_of_reach(now, asked)
        if first:
            self._log.warning(
                "controller_unreachable",
                attempt=attempt,
                why=why[:300],
                wait_s=self._config.slurm.controller_wait_s,
                host=self._host,
            )
        if expired:
            waited = now - (self._controller.since or now)
            return [
                LaunchFailed(
                    attempt,
                    f"the Slurm controller was out of reach for {waited:.0f} s (slurm.controller_wait_s): {why}",
                    exit_code=EXIT_REQUEUE,
                )
            ]
        self._retry_at = self._controller.next_try(now)
        self._next_check = min(self._next_check, self._retry_at)
        return []

    def _controller_answered(self) -> None:
        waited = self._controller.back(time.monotonic())
        if waited is not None:
            self._log.info("controller_back", waited_s=round(waited, 1), host=self._host)

    def _retry_step(self, why: str) -> list[Event | Isolated]:
        """Slurm could not create the step yet (the last one not cleaned up, its nodes busy), or did not say the
        job's nodes though it answers now: the same attempt again after a backoff, its nodes asked anew."""
        self._step_tries += 1
        delay = retry_delay_s(self._step_tries)
        self._log.warning(
            "step_retry", attempt=self._pending.number, tries=self._step_tries, delay_s=delay, why=why[:300]
        )
        self._retry_at = time.monotonic() + delay
        self._next_check = min(self._next_check, self._retry_at)
        return []

    def _srun_exited(self, exited: _SrunExited) -> list[Event | Isolated]:
        """srun ended before every agent dialled in: the launch failed (Slurm refused the step, or cannot be
        reached from here), which no node is charged for."""
        current = self._srun[-1].pid if self._srun and self._attempt is not None else None
        if exited.pid != current or all(n.peer is not None for n in self._nodes.values()):
            return []
        self._hello_deadline, self._ended_early = None, {}
        tail = _last_line(self._srun_log(self._attempt or 0))
        why = f"srun exited with code {exited.returncode} before every agent connected" + (f": {tail}" if tail else "")
        self._log.error("srun_failed", attempt=self._attempt, returncode=exited.returncode, said=tail)
        if not self._checking_link:
            self._check_link((), why, _log_tail(self._srun_log(self._attempt or 0)) or None)  # no words: unknown
        return []

    def _charge(self, node: str, reason: str, kind: str) -> None:
        self._update_ledger(lambda ledger: ledger.charged(NodeFault(node, time.time(), reason, kind)))
        excluded = self._excluded()
        if node in excluded:
            self._log.warning("node_excluded", node=node, why=excluded[node])

    def charge_device(self, verdict: DeviceVerdict) -> str | None:
        """The node that ran the verdict's rank, as this allocation names it (else as the rank said)."""
        node = next((n.name for n in self._nodes.values() if verdict.rank in n.ranks), verdict.node)
        if node is None:
            return None
        fault = device_fault(verdict, node, time.time())
        self._charge(node, fault.reason, fault.kind)
        return self._excluded().get(node)

    def _update_ledger(self, change: Callable[[Ledger], Ledger]) -> None:
        """Through the file, under its lock: an operator may have forgiven a node meanwhile."""
        try:
            self._ledger = update_ledger(self._layout, change)
        except (OSError, ValueError) as exc:
            self._ledger = change(self._ledger)  # the decision still holds for this supervisor's lifetime
            self._log.error("node_ledger_write_failed", error=str(exc))

    def _excluded(self) -> dict[str, str]:
        return self._ledger.excluded(time.time(), **self._config.slurm.ledger_rules, slurm_states=self._states)

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

    def dump_stacks(
        self,
        attempt: int,
        ranks: tuple[int, ...],
        faulthandler_ranks: tuple[int, ...],
        *,
        collective_failed: bool = False,
    ) -> None:
        self._collective_failed = collective_failed
        if attempt != self._attempt:
            self._post(StacksCollected(attempt, ()))
            return
        for node in self._nodes.values():
            node.stacks = None if node.state == "running" and set(node.ranks) & set(ranks) else {}
        self._stacks_deadline = (
            time.monotonic() + PYSPY_TIMEOUT_S * self._config.nproc_per_node + FAULTHANDLER_WAIT_S + STACKS_GRACE_S
        )
        asked = self._send(
            ranks,
            lambda mine: {
                "type": "dump_stacks",
                "ranks": mine,
                "faulthandler": [r for r in mine if r in faulthandler_ranks],
            },
        )
        if not asked:
            self._post(StacksCollected(attempt, ()))
            self._stacks_deadline = None

    def _stacks_if_all_in(self, *, timed_out: bool = False) -> list[Event]:
        if self._stacks_deadline is None or (not timed_out and any(n.stacks is None for n in self._nodes.values())):
            return []
        self._stacks_deadline = None
        merged = StackDumps((), {}, ())
        for node in self._nodes.values():
            merged = _merge(merged, node.stacks or {}, set(node.ranks))
        verdict, blocked = judge(
            tuple(sorted(r for n in self._nodes.values() for r in n.ranks)),
            merged,
            collective_failed=self._collective_failed,
        )
        suspect = None if verdict is None else next((n for n in self._nodes.values() if verdict.rank in n.ranks), None)
        if suspect is not None and verdict is not None and verdict.cls in CHARGED_CLASSES:
            what = "collective failed" if self._collective_failed else "hang"
            self._charge(suspect.name, f"{what}: rank {verdict.rank} {verdict.cls}: {verdict.evidence}", "failed")
        return [
            StacksCollected(
                self._attempt or 0,
                merged.paths,
                culprit=None if verdict is None else verdict.rank,
                last_steps=merged.last_steps,
                blocked=blocked,
                verdict=verdict,
                node=None if suspect is None else suspect.name,
            )
        ]

    def kill_leftovers(self, attempt: int, survivors: Iterable[RankState]) -> None:
        """Each agent kills its ranks' grandchildren itself before it reports done."""

    def unwind(self, attempt: int) -> None:
        """Each agent tells its node's survivors (worker.recovery); the agents of lost nodes are gone."""
        if attempt != self._attempt:
            return
        for node in self._nodes.values():
            if node.peer is not None and node.state != "lost":
                node.peer.send({"type": "unwind", "attempt": attempt})

    def publish(self, order: StopOrder | None) -> None:
        publish_order(self._layout, order, self._log)  # for `status` and any rank on this machine
        payload = None if order is None else asdict(order)
        for node in self._nodes.values():  # each agent writes it on its own node: no NFS cache in the way
            if node.peer is not None and node.state == "running":
                node.peer.send({"type": "order", "order": payload})

    def last_heartbeat(self, rank: int) -> list[Event]:
        return []  # the agent sent the rank's last beat before its exit

    def poll(self) -> list[Event | Isolated]:
        now = time.monotonic()
        events: list[Event | Isolated] = []
        if self._hello_deadline is not None and now > self._hello_deadline:
            events += self._hello_timed_out()
        if self._stacks_deadline is not None and now > self._stacks_deadline:
            events += self._stacks_if_all_in(timed_out=True)
        events += self._silent_nodes(now)
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            self.launch(self._pending)  # its outcome is posted (`_Planned`)
        for name, (why, until) in list(self._ended_early.items()):
            if now >= until:  # srun still runs: this node's agent died on its own
                del self._ended_early[name]
                if (node := self._nodes.get(name)) is not None and node.state == "starting":
                    events += self._lose(node, why)
        if now - self._last_ping >= self._ping_s:
            self._last_ping = now
            for node in self._nodes.values():
                if node.peer is not None and node.state != "lost":  # a done node's agent waits for our word
                    node.peer.send({"type": "ping"})
        self._next_check = self._quietest()
        return events

    def _hello_timed_out(self) -> list[Event]:
        """Some agents never dialled in. With others in, those nodes are lost; with none, it may be us."""
        self._hello_deadline = None
        missing = tuple(n.name for n in self._nodes.values() if n.peer is None)
        if len(missing) == len(self._nodes):
            if not self._checking_link:
                self._check_link((), f"no agent connected within {HELLO_TIMEOUT_S:g} s of srun")
            return []
        for name in missing:
            self._log.error("node_lost", node=name, attempt=self._attempt, why="its agent never connected")
            self._charge(name, f"lost: its agent did not connect within {HELLO_TIMEOUT_S:g} s", "lost")
        return self._launch_again()

    def _silent_nodes(self, now: float) -> list[Event]:
        """Nodes silent past the timeout are lost, unless every other node is: then our own link is tested first."""
        if self._checking_link:
            return []
        timeout = self._config.slurm.node_timeout_s
        silent = [n for n in self._nodes.values() if n.active and now - n.heard > timeout]
        if not silent:
            return []
        remote = {n.name for n in self._nodes.values() if n.active and n.name != self._host}
        suspects = tuple(n.name for n in silent)
        # A node heard within the timeout (one that finished included) shows our own link works.
        heard = any(
            n.name != self._host and n.peer is not None and now - n.heard <= timeout
            for n in self._nodes.values()
            if n.name not in suspects
        )
        if cut_off(remote, suspects, heard, None) is None:  # every other node silent: is it us? ask the controller
            self._check_link(suspects, f"every other node went silent ({', '.join(sorted(remote))})")
            return []
        events: list[Event] = []
        for node in silent:
            events += self._lose(node, f"no word from its agent for {now - node.heard:.1f} s")
        return events

    def next_deadline(self) -> float:
        """The moment the quietest node's agent has been silent for the node timeout: it is declared lost then,
        not at the next once-a-second tick (while our own link is tested, its answer is awaited instead). Worked
        out at each poll: agents are heard from all the time, so it only ever comes later than that."""
        return self._next_check

    def _quietest(self) -> float:
        timeout = self._config.slurm.node_timeout_s
        heard = [n.heard + timeout + 0.01 for n in self._nodes.values() if n.active and not self._checking_link]
        retry = [] if self._retry_at is None else [self._retry_at]
        return min([*heard, *retry, *(until for _, until in self._ended_early.values())], default=math.inf)

    def oom_killed(self) -> bool:
        return False  # another node's cgroup is not ours to read

    def details(self) -> dict[str, Any]:
        now = time.monotonic()
        excluded = self._excluded()
        with self._held_lock:
            held = dict(self._held_bytes)  # what each node's memory tier holds (node_memory.py)
        nodes = [
            {
                "node": n.name,
                "group_rank": n.group_rank,
                "state": n.shown_state(),
                "ranks": list(n.ranks),
                "heartbeat_age_s": None if n.peer is None else round(now - n.heard, 3),
                **({"memory_bytes": held[n.name]} if n.name in held and n.active else {}),
            }
            for n in sorted(self._nodes.values(), key=lambda n: n.group_rank)
        ]
        spares = [name for name in self._allocation if name not in self._nodes and name not in excluded]
        nodes += [{"node": name, "state": "spare"} for name in spares]  # a cooled-down node is one again
        nodes += [
            {"node": name, "state": "excluded", "why": why} for name, why in excluded.items() if name in self._seen
        ]
        policy = {
            **self._config.slurm.ledger_rules,
            "nodes": self._config.nodes,
            "min_nodes": self._config.min_nodes,
            "spare_nodes": self._config.spare_nodes,
        }  # for `trainwarden nodes`, which has only the run dir
        world = len(self._nodes) * self._config.nproc_per_node or self._config.world_size
        return {
            "nodes": nodes,
            "failed_on": self._failed_on,
            "slurm_job": slurmctl.job_id(),
            "excluded_nodes": sorted(excluded),
            "node_policy": policy,
            "world_size": world,
            "full_world_size": self._config.world_size,
        }

    def _kill_steps(self) -> None:
        """Kill the srun clients of earlier attempts; their agents fence themselves when the stream ends."""
        for proc in self._srun:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self._srun = [proc for proc in self._srun if proc.poll() is None]


def _nodelist_at_start() -> list[str]:
    """The job's nodes as its environment says (fixed at its start): good enough to find our route to them."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    try:
        return slurmctl.hostnames(nodelist) if nodelist else []
    except slurmctl.SlurmError:
        return []


def _merge(dumps: StackDumps, got: dict[str, Any], ranks: set[int]) -> StackDumps:
    """`dumps` with one node agent's stacks message added (only what it says of its own ranks)."""

    def mine(key: str) -> dict[int, Any]:
        found = got.get(key)
        return (
            {int(r): v for r, v in found.items() if str(r).isdigit() and int(r) in ranks}
            if isinstance(found, dict)
            else {}
        )

    return StackDumps(
        tuple(sorted({*dumps.paths, *(str(p) for p in got.get("paths", []))})),
        {**dumps.by_rank, **{r: str(t) for r, t in mine("stacks").items()}},
        (*dumps.last_steps, *((int(r), int(s)) for r, s in got.get("last_steps", []) if int(r) in ranks)),
        {**dumps.flights, **{r: f for r, f in mine("flights").items() if isinstance(f, dict)}},
        {**dumps.states, **{r: str(s) for r, s in mine("states").items()}},
        tuple(sorted({*dumps.expected, *(int(r) for r in got.get("expected", []) if int(r) in ranks)})),
    )


def _route_address(node: str) -> str:
    """Our address on the route to `node` (a UDP connect sends nothing), so its agent can dial back."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(node), 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _log_tail(path: Any) -> str:
    """The end of an attempt's srun log (srun's own lines may precede a last one that says less)."""
    try:
        return read_bytes(path, 1 << 20)[-SRUN_LOG_TAIL:].decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _last_line(path: Any) -> str:
    """The last line srun (or an agent) wrote to an attempt's log: why a step failed, in Slurm's words."""
    try:
        data = read_bytes(path, 1 << 20)[-SRUN_LOG_TAIL:]
    except OSError:
        return ""
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return type(value) in (int, float)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
