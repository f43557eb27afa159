"""The node agent, a real process, driven over its real TCP stream by a test playing the supervisor."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.launch.agent import agent_log
from supervisor.launch.wire import Peer
from tests.conftest import wait_until
from tests.e2e.conftest import REPO
from worker.contract import RunLayout

TOKEN = "0123456789abcdef"
# A rank: beats once (as the worker library would), then sleeps or exits with the code it is given.
RANK_SCRIPT = """
import json, os, sys, time
rank = int(os.environ["RANK"])
beat = {"attempt": 0, "rank": rank, "seq": 1, "step": 7, "phase": "train"}
path = os.path.join(os.environ["TRAINWARDEN_RUN_DIR"], "ranks", f"rank_{rank}", "heartbeat.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path + ".tmp", "w") as f:
    json.dump(beat, f)
os.replace(path + ".tmp", path)
time.sleep(float(sys.argv[1]))
sys.exit(int(os.environ["LOCAL_RANK"]) + 3)
"""


class FakeSupervisor:
    """The supervisor's end of one agent's stream."""

    def __init__(self, tmp_path: Path, fence_s: float = 30.0, env: dict[str, str] | None = None) -> None:
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        (tmp_path / "rank.py").write_text(RANK_SCRIPT)
        self.script = tmp_path / "rank.py"
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(30)
        env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": TOKEN, **(env or {})}
        self.agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor.agent",
                "--connect",
                f"127.0.0.1:{server.getsockname()[1]}",
                "--run-dir",
                str(self.run_dir),
                "--attempt",
                "0",
                "--fence-s",
                str(fence_s),
            ],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        sock, _ = server.accept()
        server.close()
        sock.settimeout(30)  # a test waits for a message at most this long
        self.peer = Peer(sock)
        sock.settimeout(30)
        self.hello = self.receive("hello")

    def receive(self, kind: str) -> dict:
        """The next message of `kind`, skipping beats (liveness, or the ranks' own, which may come at any time)."""
        while True:
            message = self.peer.receive()
            assert message is not None, f"stream ended while waiting for {kind}"
            if message["type"] == kind:
                return message
            assert message["type"] == "beat", message

    def launch(self, seconds: float, ranks: tuple[int, ...] = (4, 5)) -> dict[int, int]:
        envs = {
            str(rank): {"RANK": str(rank), "LOCAL_RANK": str(i), "TRAINWARDEN_RUN_DIR": str(self.run_dir)}
            for i, rank in enumerate(ranks)
        }
        self.peer.send({"type": "launch", "argv": [sys.executable, str(self.script), str(seconds)], "envs": envs})
        return {int(rank): pid for rank, pid in self.receive("spawned")["pids"].items()}

    def close(self) -> None:
        if self.agent.poll() is None:
            self.agent.kill()
        self.agent.wait(timeout=10)
        self.peer.close()


@pytest.fixture
def supervisor(tmp_path):
    fake = FakeSupervisor(tmp_path)
    yield fake
    fake.close()


def test_the_agent_introduces_itself_with_the_token_and_a_free_port(supervisor):
    hello = supervisor.hello
    assert hello["token"] == TOKEN and hello["node"] == socket.gethostname() and hello["attempt"] == 0
    assert hello["pid"] == supervisor.agent.pid and 0 < hello["port"] < 65536


def test_the_agent_says_in_its_hello_which_gpus_nvml_calls_unhealthy(supervisor, tmp_path):
    """No NVML here: nothing known; with nvidia-ml-py saying GPU 0 needs a reset, the hello says so (the supervisor
    then loses the node for this attempt: docs/hangs.md), with the GPUs NVML counts and the node's
    CUDA_VISIBLE_DEVICES (the supervisor's preflight of `device: cuda`)."""
    assert supervisor.hello["gpu_problems"] is None
    (tmp_path / "nvml").mkdir()
    env = {"PYTHONPATH": str(REPO / "tests" / "fake_nvml"), "CUDA_VISIBLE_DEVICES": "0"}
    fake = FakeSupervisor(tmp_path / "nvml", env=env)
    try:
        assert fake.hello["gpu_problems"] == ["GPU 0: NVML asks for a GPU reset"]
        assert (fake.hello["gpus"], fake.hello["cuda_visible_devices"]) == ({"gpus": 1, "how": "counted by NVML"}, "0")
    finally:
        fake.close()


def test_ranks_are_started_their_beats_and_exits_reported_then_the_agent_is_done(supervisor):
    pids = supervisor.launch(0.5)
    assert set(pids) == {4, 5}
    beats, exits = [], {}
    while len(exits) < 2:
        message = supervisor.peer.receive()
        assert message is not None
        if message["type"] == "beat":
            beats += message["beats"]
        elif message["type"] == "exited":
            exits[message["rank"]] = message["code"]
    assert exits == {4: 3, 5: 4}  # global ranks, each rank's own exit code
    assert sorted(b["rank"] for b in beats) == [4, 5] and {b["step"] for b in beats} == {7}
    assert all(0 <= b["age_s"] < 2 for b in beats)  # how long each waited on the node for its message
    assert supervisor.receive("done")
    time.sleep(0.3)
    assert supervisor.agent.poll() is None  # it waits for the supervisor's word
    supervisor.peer.send({"type": "exit"})
    assert supervisor.agent.wait(timeout=10) == 0
    logs = supervisor.run_dir / "logs" / "attempt_0"
    assert sorted(p.name for p in logs.iterdir()) == ["rank_4.err", "rank_4.out", "rank_5.err", "rank_5.out"]


def test_ranks_that_exited_before_the_supervisor_died_leave_the_agent_to_fence_and_stand_for_successor(supervisor):
    """The supervisor's host crashed: the ranks here died at once (their collective broke), before the agent
    heard the stream end. The agent is done, yet it waits for the supervisor's word, so the stream's end without
    one is a fence (journaled: it then stands for successor), not a quiet exit that leaves the run to nobody."""
    supervisor.launch(0.1)
    supervisor.receive("exited"), supervisor.receive("exited")
    assert supervisor.receive("done")
    supervisor.peer.close()
    assert supervisor.agent.wait(timeout=10) == 1
    journal = (supervisor.run_dir / "supervisor" / "events.jsonl").read_text().splitlines()
    (fenced,) = [e for e in map(json.loads, journal) if e["event"] == "agent_fenced"]
    assert fenced["ranks_killed"] == [] and "supervisor gone" in fenced["why"]


def test_a_silent_supervisor_is_fenced_off_ranks_killed_agent_gone(tmp_path):
    fake = FakeSupervisor(tmp_path, fence_s=2.0)
    try:
        pids = fake.launch(60)
        started = time.monotonic()
        assert fake.agent.wait(timeout=15) == 1  # no pings: fenced
        assert time.monotonic() - started < 10
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids.values()
        )
        # Said in this node's own log in the run dir, which outlives the batch host and its srun.
        assert fake.agent.stderr.read() == ""
        fenced = agent_log(RunLayout(fake.run_dir), socket.gethostname()).read_text()
        assert fenced.startswith("trainwarden agent: nothing from the supervisor for 2 s: fencing")
    finally:
        fake.close()


def test_the_supervisor_gone_kills_the_ranks_at_once(supervisor):
    pids = supervisor.launch(60)
    supervisor.peer.close()
    assert supervisor.agent.wait(timeout=10) == 1
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids.values()), timeout=10)


def test_a_slurm_signal_to_the_agent_is_forwarded_and_the_ranks_left_alone(supervisor):
    pids = supervisor.launch(60)
    supervisor.agent.send_signal(signal.SIGTERM)
    assert supervisor.receive("signal")["signum"] == signal.SIGTERM
    assert supervisor.agent.poll() is None and all(psutil.pid_exists(pid) for pid in pids.values())
    supervisor.peer.send({"type": "signal", "signum": signal.SIGKILL, "ranks": [5]})
    assert supervisor.receive("signalled")["ranks"] == [5]
    assert supervisor.receive("exited") == {"type": "exited", "attempt": 0, "rank": 5, "code": -signal.SIGKILL}


def test_a_stop_order_is_written_into_the_run_dir_by_the_agent(supervisor):
    supervisor.launch(60)
    order = {"id": 1, "step": 40, "exit": True}
    supervisor.peer.send({"type": "order", "order": order})
    path = supervisor.run_dir / "supervisor" / "stop_order.json"
    wait_until(path.exists, timeout=10)
    assert json.loads(path.read_text()) == order
    supervisor.peer.send({"type": "order", "order": None})
    wait_until(lambda: not path.exists(), timeout=10)


def test_a_bad_order_is_reported_and_does_not_kill_the_agent(supervisor):
    supervisor.launch(60)
    supervisor.peer.send({"type": "signal", "ranks": "all"})  # no signum
    supervisor.peer.send({"type": "ping"})
    time.sleep(0.5)
    assert supervisor.agent.poll() is None
