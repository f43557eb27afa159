"""The real supervisor and its Slurm launcher against a simulated fleet (bench/fleet.py: Slurm's commands and every
node's agent, speaking the agents' wire protocol), so the multi-node paths run on any machine, quickly: 20 nodes x
2 ranks with beats held back by up to half the node timeout, one node falling silent, a spare taking its place."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, journal, outcome_lines

sys.path.insert(0, str(REPO / "bench"))
import fleet  # noqa: E402 - the load generator lives with the benchmarks

pytestmark = pytest.mark.timeout(90)

NODES, SPARES, RANKS, TIMEOUT_S = 20, 1, 2, 3.0  # 3 s: the fleet itself may lag on a loaded machine


def _wall(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:g} s")


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return (
        [e for e in journal(run_dir) if e["event"] == kind]
        if (run_dir / "supervisor" / "events.jsonl").exists()
        else []
    )


def test_a_fleet_keeps_its_nodes_through_late_beats_and_a_silent_node_is_declared_lost_within_its_timeout(
    tmp_path: Path,
) -> None:
    fleet.install(tmp_path / "bin")
    names = [f"fleet{i:02d}" for i in range(NODES + SPARES)]
    fleet_log, control = tmp_path / "fleet.jsonl", tmp_path / "control.json"
    spec = {
        "nodes": names,
        "ranks_per_node": RANKS,
        "interval_s": 0.5,
        "late_s": TIMEOUT_S / 2,
        "late_share": 0.2,
        "log": str(fleet_log),
        "control": str(control),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "train.py").write_text("")
    job = {
        "script": str(tmp_path / "train.py"),
        "nodes": NODES,
        "nproc_per_node": RANKS,
        "spare_nodes": SPARES,
        "slurm": {"node_timeout_s": TIMEOUT_S},
        "restart": {"backoff_initial_s": 0.1},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_ID": fleet.JOB_ID,
        "SLURM_JOB_NODELIST": ",".join(names),
        "TRAINWARDEN_SUPERVISOR_ADDR": "127.0.0.1",
        fleet.ENV_SPEC: str(tmp_path / "spec.json"),
    }
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(tmp_path / "job.json"), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait(lambda: _events(run_dir, "ranks_launched"), 30, "launch")
        time.sleep(2 * TIMEOUT_S)  # beats up to half the timeout late, all along: no node is lost, no rank hangs
        assert not [e for e in journal(run_dir) if e["event"] in ("node_lost", "hang_suspected", "rank_crashed")]
        running = subprocess.run(
            [sys.executable, "-m", "supervisor", "status", str(run_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert f"  nodes: {NODES} running, {SPARES} spare" in running, running
        assert f"  ranks: {NODES * RANKS}, {NODES * RANKS} running, 0 failed" in running, running

        control.write_text(json.dumps({"silence": 1, "spread_s": 0}))
        lost = _wait(lambda: _events(run_dir, "node_lost"), 4 * TIMEOUT_S, "node_lost")[0]
        silenced = next(json.loads(line) for line in fleet_log.read_text().splitlines() if '"silenced"' in line)
        assert lost["node"] == silenced["node"]
        assert TIMEOUT_S <= _wall(lost) - silenced["last_sent"] <= TIMEOUT_S + 1
        relaunched = _wait(lambda: _events(run_dir, "ranks_placed")[1:], 30, "a relaunch")[0]
        assert lost["node"] not in relaunched["nodes"] and names[-1] in relaunched["nodes"]  # the spare took over
        _wait(lambda: len(_events(run_dir, "ranks_launched")) == 2, 30, "the relaunch started")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C kills at once (the fleet's ranks never save)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr[-2000:]
        assert outcome_lines(stderr)[0] == "trainwarden: run stopped: stopped on request"
        assert [e["node"] for e in _events(run_dir, "node_lost")] == [lost["node"]]  # every other node answered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        for line in fleet_log.read_text().splitlines() if fleet_log.exists() else []:
            record = json.loads(line)
            if record["event"] == "connected":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record["pid"], signal.SIGKILL)
