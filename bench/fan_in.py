"""What supervising costs, from 8 local ranks to a simulated fleet of 1,024 nodes x 8 ranks, and how fast a lost node
is declared among them.

1. 8 local torch-free ranks beating at the worker library's default interval (0.5 s), JSON logs: the supervisor's
   CPU (user + system, psutil) over the window.
2. For each fleet size, the real supervisor in a simulated Slurm allocation (bench/fleet.py stands in for srun and
   the node agents, speaking their wire protocol): every node sends its 8 ranks' beats once a second, 5 % of
   messages held back by up to half the node timeout (a slow link). Measured: how long from the step's start until
   every agent connected and the attempt was reported started; the supervisor's CPU over the window; the verdicts
   it reached meanwhile (all false: no node failed); then K nodes fall silent within 2 s, and each one's detection
   latency is the journal's `node_lost` time less the last moment that node spoke.

Run from the repository root:  .venv/bin/python bench/fan_in.py [--quick]
  --quick: 1,024 nodes only, a 60 s window (about 2 minutes); the full run: 64, 256 and 1,024 nodes, with a 600 s
  window at 1,024 (the 10-minute false-verdict run), about 15 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import console_overhead  # noqa: E402 - a sibling benchmark: its torch-free rank and job
import fleet  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RANKS = 8
NODE_TIMEOUT_S = 10.0  # slurm.node_timeout_s's default
LOSSES = 20
WARMUP_S = 5.0
FALSE_VERDICTS = ("node_lost", "hang_suspected", "hang_detected", "rank_crashed", "rank_failed", "run_failed")


PROFILE: Path | None = None  # --profile: py-spy records the supervisor over the fleet's window


def cpu_percent(pid: int, window_s: float, profile: Path | None = None) -> float:
    proc = psutil.Process(pid)
    before, started = proc.cpu_times(), time.monotonic()
    if profile is None:
        time.sleep(window_s)
    else:  # sampling costs the supervisor a little: its figure is then a bound
        subprocess.run(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--nonblocking",
                "-r",
                "50",
                "-f",
                "raw",
                "-p",
                str(pid),
                "-d",
                str(int(window_s)),
                "-o",
                str(profile),
            ],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    after = proc.cpu_times()
    return 100 * ((after.user - before.user) + (after.system - before.system)) / (time.monotonic() - started)


def local(window_s: float) -> float:
    """% of a core at 8 local ranks beating twice a second (the worker library's default interval)."""
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        console_overhead.BEATS_PER_S = 2
        console_overhead.WINDOW_S = window_s
        job = console_overhead.job(tmp, metrics=False)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor",
                "run",
                str(job),
                "--run-dir",
                str(tmp / "run"),
                "--log-format",
                "json",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(WARMUP_S)
            return cpu_percent(proc.pid, window_s)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def journal(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "supervisor" / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def wall(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {timeout_s:g} s")


def simulated(nodes: int, window_s: float) -> dict[str, Any]:
    """One fleet run: start-up, CPU, false verdicts, node-loss latencies."""
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        fleet.install(tmp / "bin")
        names = [f"fleet{i:04d}" for i in range(nodes + LOSSES)]
        fleet_log, control = tmp / "fleet.jsonl", tmp / "control.json"
        spec = {
            "nodes": names,
            "ranks_per_node": RANKS,
            "interval_s": 1.0,
            "late_s": NODE_TIMEOUT_S / 2,
            "late_share": 0.05,
            "log": str(fleet_log),
            "control": str(control),
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        (tmp / "train.py").write_text("")
        job = {
            "script": str(tmp / "train.py"),
            "nodes": nodes,
            "nproc_per_node": RANKS,
            "spare_nodes": LOSSES,
            "slurm": {"node_timeout_s": NODE_TIMEOUT_S},
        }
        (tmp / "job.json").write_text(json.dumps(job))
        env = {
            **os.environ,
            "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}",
            "SLURM_JOB_ID": fleet.JOB_ID,
            "SLURM_JOB_NODELIST": ",".join(names),
            "TRAINWARDEN_SUPERVISOR_ADDR": "127.0.0.1",
            fleet.ENV_SPEC: str(tmp / "spec.json"),
        }
        run_dir = tmp / "run"
        with open(tmp / "supervisor.err", "w") as err:  # the child has its own copy
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "supervisor",
                    "run",
                    str(tmp / "job.json"),
                    "--run-dir",
                    str(run_dir),
                    "--log-format",
                    "json",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            return measure(proc, run_dir, fleet_log, control, window_s)
        finally:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            proc.kill()
            for line in fleet_log.read_text().splitlines() if fleet_log.exists() else []:
                record = json.loads(line)
                if record["event"] == "connected":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(record["pid"], signal.SIGKILL)


def measure(proc: subprocess.Popen, run_dir: Path, fleet_log: Path, control: Path, window_s: float) -> dict[str, Any]:
    def events(kind: str) -> list[dict[str, Any]]:
        return [e for e in journal(run_dir) if e["event"] == kind]

    launched = wait_for(lambda: events("ranks_launched"), 120, "ranks_launched")[0]
    startup = wall(launched) - wall(events("agents_starting")[0])
    time.sleep(WARMUP_S)
    cpu = cpu_percent(proc.pid, window_s, PROFILE)
    false = [e for e in journal(run_dir) if e["event"] in FALSE_VERDICTS]
    control.write_text(json.dumps({"silence": LOSSES, "spread_s": 2.0}))

    def silenced() -> list[dict[str, Any]]:
        return [json.loads(line) for line in fleet_log.read_text().splitlines() if '"silenced"' in line]

    def declared() -> dict[str, float] | None:
        lost = {e["node"]: wall(e) for e in events("node_lost")}
        quiet = silenced()
        return lost if len(quiet) == LOSSES and all(s["node"] in lost for s in quiet) else None

    lost = wait_for(declared, 3 * NODE_TIMEOUT_S + 30, f"{LOSSES} node_lost events")
    latencies = sorted(lost[s["node"]] - s["last_sent"] for s in silenced())
    return {"startup_s": startup, "cpu": cpu, "false": false, "latencies": latencies}


def p99(values: list[float]) -> float:
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 nodes only, a 60 s window")
    parser.add_argument("--profile", type=Path, help="py-spy the supervisor over the fleet's window (raw stacks)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    sizes = {1024: 60.0} if args.quick else {64: 60.0, 256: 60.0, 1024: 600.0}
    local_cpu = local(20.0 if args.quick else 60.0)
    results = {}
    for nodes, window in sizes.items():
        results[nodes] = found = simulated(nodes, window)
        print(
            f"{nodes:5d} nodes x {RANKS} ranks: started in {found['startup_s']:.1f} s, supervisor "
            f"{found['cpu']:.1f} % of a core over {window:.0f} s, {len(found['false'])} false verdicts, node loss "
            f"declared after {min(found['latencies']):.2f}-{max(found['latencies']):.2f} s "
            f"(p99 {p99(found['latencies']):.2f} s, {LOSSES} nodes)",
            flush=True,
        )
        for event in found["false"]:
            print(f"  false verdict: {json.dumps(event)[:300]}")
    if len(results) > 1:
        print("\nnodes  % of a core  per node (% of a core)  node loss p99 (s)")
        for nodes, found in results.items():
            print(f"{nodes:5d}  {found['cpu']:11.1f}  {found['cpu'] / nodes:22.4f}  {p99(found['latencies']):17.2f}")
    biggest = results[max(results)]
    print()
    print(f"supervisor CPU at 8 local ranks, default settings: {local_cpu:.2f} % of a core")
    print(f"supervisor CPU at {max(results)} nodes x {RANKS} ranks: {biggest['cpu']:.1f} % of a core")
    print(f"node loss declared p99: {p99(biggest['latencies']):.2f} s (timeout {NODE_TIMEOUT_S:g} s)")
    print(f"false verdicts: {sum(len(found['false']) for found in results.values())}")
    print(f"all agents connected and the attempt started: {biggest['startup_s']:.1f} s after the step started")


if __name__ == "__main__":
    main()
