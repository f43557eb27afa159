"""A simulated fleet: N nodes x R ranks speaking the node agents' real wire protocol to a real supervisor.

It stands in for Slurm's commands (installed as `srun`, `scontrol`, `sinfo`, `squeue` by `install`), so the
supervisor's own SlurmLauncher plans the nodes, starts "the step" and places the ranks exactly as on a cluster;
only the step is this one process, holding one TCP connection per node (selectors, no threads). Each node dials
in with the run's token, answers `launch` with pids, sends one `beat` message per interval with its ranks' new
records (as supervisor.agent does), answers `signal` with the ranks' exits and `exit` by hanging up.

Faults, from the spec file (TW_FLEET_SPEC, JSON) and a control file the benchmark writes while it runs:
  late_share, late_s   each message is held back, with this probability, by up to late_s (a slow link)
  {"silence": K}       K running nodes, chosen at random over `spread_s`, fall silent (a dead node, a partition)
Everything it does that a measurement needs (connected, spawned, each node silenced and when it last spoke) goes to
the spec's `log` as JSON lines with wall-clock times.

    python bench/fleet.py srun|scontrol|sinfo|squeue ARGS...   (through the wrappers `install` writes)
"""

from __future__ import annotations

import json
import os
import random
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.launch.wire import encode  # noqa: E402 - after the path is set

ENV_SPEC = "TW_FLEET_SPEC"
JOB_ID = "4242"


def install(bin_dir: Path) -> None:
    """Wrappers named as Slurm's commands, each running this file."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for command in ("srun", "scontrol", "sinfo", "squeue", "scancel"):
        wrapper = bin_dir / command
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {command} "$@"\n')
        wrapper.chmod(0o755)


def spec() -> dict[str, Any]:
    return json.loads(Path(os.environ[ENV_SPEC]).read_text())


def log(event: str, **fields: Any) -> None:
    with open(spec()["log"], "a") as out:
        out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


# ---- Slurm's commands, as the supervisor asks them ----


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))
    elif args[:2] == ["show", "job"]:
        print(f"JobId={JOB_ID} JobState=RUNNING NodeList={','.join(spec()['nodes'])}")
    elif args[:1] == ["ping"]:
        print("Slurmctld(primary) at fleet-controller is UP")
    return 0


def sinfo(args: list[str]) -> int:
    names = args[args.index("-n") + 1].split(",")
    print("\n".join(f"{name} allocated" for name in names))
    return 0


def squeue(args: list[str]) -> int:
    print("RUNNING")
    return 0


# ---- the step: every node's agent ----


class Node:
    def __init__(self, name: str, index: int, attempt: int, ranks_per_node: int) -> None:
        self.name, self.index, self.attempt = name, index, attempt
        self.sock: socket.socket | None = None
        self.buffer = b""
        self.ranks: list[int] = []
        self.seq: dict[int, int] = {}
        self.running = False
        self.silent = False
        self.next_send = 0.0
        self.last_sent = 0.0  # wall clock
        self.exited: set[int] = set()
        self.ranks_per_node = ranks_per_node

    def send(self, message: dict[str, Any]) -> None:
        if self.sock is None or self.silent:
            return
        try:
            self.sock.sendall(encode(message))
            self.last_sent = time.time()
        except OSError:
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def beats(self, interval: float, now: float) -> list[dict[str, Any]]:
        records = []
        for rank in self.ranks:
            if rank in self.exited:
                continue
            self.seq[rank] = seq = self.seq.get(rank, 0) + 1
            records.append(
                {
                    "attempt": self.attempt,
                    "rank": rank,
                    "seq": seq,
                    "step": seq,
                    "phase": "train",
                    "step_time_s": interval,
                    "loss": 1.0 / seq,
                    "compute_s": interval * 0.9,
                    "total_steps": 10**6,
                    "age_s": round(random.uniform(0, interval / 2), 3),
                }
            )
        return records


def srun(args: list[str]) -> int:
    plan = spec()
    nodelist = next(a.split("=", 1)[1] for a in args if a.startswith("--nodelist="))
    agent = args[args.index("supervisor.agent") + 1 :]
    connect, attempt = agent[agent.index("--connect") + 1], int(agent[agent.index("--attempt") + 1])
    host, _, port = connect.rpartition(":")
    token = os.environ["TRAINWARDEN_AGENT_TOKEN"]
    interval, late_s, late_share = plan.get("interval_s", 1.0), plan.get("late_s", 0.0), plan.get("late_share", 0.0)
    selector = selectors.DefaultSelector()
    nodes = [Node(name, i, attempt, plan["ranks_per_node"]) for i, name in enumerate(nodelist.split(","))]
    for node in nodes:
        node.sock = socket.create_connection((host, int(port)), timeout=30)
        node.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node.send(
            {
                "type": "hello",
                "token": token,
                "node": node.name,
                "attempt": attempt,
                "pid": 100000 + node.index,
                "port": 20000 + node.index % 40000,
                "slurm_node_id": str(node.index),
                "gpu_problems": [],
            }
        )
        node.sock.setblocking(False)
        selector.register(node.sock, selectors.EVENT_READ, node)
    log("connected", attempt=attempt, nodes=len(nodes), pid=os.getpid())
    control = Path(plan["control"])
    handled_control = control.stat().st_mtime if control.exists() else None  # an order is for the step it came to
    silenced: list[tuple[float, Node]] = []  # (when, node) still to silence
    while any(node.sock is not None for node in nodes):
        now = time.monotonic()
        for key, _ in selector.select(timeout=0.05):
            receive(key.data, selector)
        for node in nodes:
            if node.running and not node.silent and node.sock is not None and now >= node.next_send:
                node.send({"type": "beat", "beats": node.beats(interval, now)})
                delay = random.uniform(0, late_s) if random.random() < late_share else 0.0
                node.next_send = now + interval + delay
        if control.exists() and control.stat().st_mtime != handled_control:
            handled_control = control.stat().st_mtime
            order = json.loads(control.read_text())
            running = [node for node in nodes if node.running and not node.silent]
            for node in random.sample(running, min(order.get("silence", 0), len(running))):
                silenced.append((now + random.uniform(0, order.get("spread_s", 2.0)), node))
        for when, node in list(silenced):
            if now >= when:
                silenced.remove((when, node))
                node.silent = True
                log("silenced", node=node.name, last_sent=node.last_sent, attempt=attempt)
    return 0


def receive(node: Node, selector: selectors.BaseSelector) -> None:
    assert node.sock is not None
    try:
        chunk = node.sock.recv(65536)
    except BlockingIOError:
        return
    except OSError:
        chunk = b""
    if not chunk:
        selector.unregister(node.sock)
        node.close()
        return
    node.buffer += chunk
    while b"\n" in node.buffer:
        line, node.buffer = node.buffer.split(b"\n", 1)
        answer(node, json.loads(line), selector)
        if node.sock is None:
            return


def answer(node: Node, message: dict[str, Any], selector: selectors.BaseSelector) -> None:
    kind = message["type"]
    if node.silent:
        return
    if kind == "launch":
        node.ranks = sorted(int(rank) for rank in message["envs"])
        node.running, node.next_send = True, time.monotonic() + random.uniform(0, 1.0)
        node.send({"type": "spawned", "pids": {str(rank): 200000 + rank for rank in node.ranks}})
        if node.index == 0:
            log("spawned", attempt=node.attempt)
    elif kind == "signal":
        ranks = [int(rank) for rank in message["ranks"] if int(rank) not in node.exited]
        node.send({"type": "signalled", "ranks": ranks})
        for rank in ranks:
            node.exited.add(rank)
            node.send({"type": "exited", "rank": rank, "code": -int(message["signum"])})
        if node.exited >= set(node.ranks):
            node.send({"type": "done"})
            node.running = False
    elif kind == "dump_stacks":
        node.send(
            {"type": "stacks", "paths": [], "last_steps": [], "stacks": {}, "flights": {}, "states": {}, "expected": []}
        )
    elif kind == "exit":
        if node.sock is not None:
            selector.unregister(node.sock)
        node.close()


COMMANDS = {"srun": srun, "scontrol": scontrol, "sinfo": sinfo, "squeue": squeue, "scancel": squeue}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
