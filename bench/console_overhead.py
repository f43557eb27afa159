"""What the live console and the Prometheus metrics cost the supervisor: its CPU time at 8 ranks x 50 events/s.

Eight torch-free ranks each write a heartbeat 50 times a second (the worker library's own writer, throttling off),
for WINDOW_S seconds after a warm-up, under three supervisors in turn: JSON lines on a pipe (the display off: the
baseline), the console on a pseudo-terminal with its live status line, and that plus metrics (an HTTP endpoint
scraped once a second, and a textfile). The supervisor's own CPU time (user + system, from /proc via psutil) is
printed as % of one core for each, and the difference against the baseline.

Run from the repository root:  .venv/bin/python bench/console_overhead.py [--trials 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
RANKS = 8
BEATS_PER_S = 50
WARMUP_S = 5.0
WINDOW_S = 20.0

RANK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from worker.contract import ENV_ATTEMPT, ENV_RUN_DIR, RunLayout
    from worker.heartbeat import Heartbeat

    rank, layout = int(os.environ["RANK"]), RunLayout(Path(os.environ[ENV_RUN_DIR]))
    beat = Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=int(os.environ[ENV_ATTEMPT]),
                     interval_s=0.0)
    period, step, end = 1.0 / float(sys.argv[1]), 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        step += 1
        beat.beat(step, "train", step_time_s=period, loss=1.0 / step)
        time.sleep(period)
""")


def job(tmp: Path, *, metrics: bool) -> Path:
    script = tmp / "rank.py"
    script.write_text(RANK)
    config = {
        "script": str(script),
        "args": [str(BEATS_PER_S), str(WARMUP_S + WINDOW_S + 5)],
        "nproc_per_node": RANKS,
        "env": {"PYTHONPATH": str(REPO)},
        "hang": {"heartbeat": "required"},
    }
    if metrics:
        config["metrics"] = {"port": 0, "textfile": str(tmp / "trainwarden.prom")}
    path = tmp / "job.json"  # JSON is YAML
    path.write_text(json.dumps(config))
    return path


def scrape_forever(run_dir: Path, stop: threading.Event) -> None:
    """Once a second, as a Prometheus server would, once the supervisor says where it serves."""
    url = None
    while not stop.wait(1.0):
        if url is None:
            try:
                lines = (run_dir / "supervisor" / "events.jsonl").read_text().splitlines()
            except FileNotFoundError:
                continue
            url = next((json.loads(line)["url"] for line in lines if '"metrics_serving"' in line), None)
            continue
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=5).read()


def measure(kind: str) -> float:
    """The supervisor's CPU use over the window, in % of one core."""
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        argv = [
            sys.executable,
            "-m",
            "supervisor",
            "run",
            str(job(tmp, metrics=kind == "console+metrics")),
            "--run-dir",
            str(tmp / "run"),
        ]
        if kind == "json":
            proc = subprocess.Popen(
                [*argv, "--log-format", "json"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            controller = None
        else:  # a real terminal, so the live line is drawn; its output is read and dropped
            controller, terminal = pty.openpty()
            proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
            os.close(terminal)
            threading.Thread(target=_drain, args=(controller,), daemon=True).start()
        stop = threading.Event()
        threading.Thread(target=scrape_forever, args=(tmp / "run", stop), daemon=True).start()
        try:
            supervisor = psutil.Process(proc.pid)
            time.sleep(WARMUP_S)
            before = supervisor.cpu_times()
            started = time.monotonic()
            time.sleep(WINDOW_S)
            after = supervisor.cpu_times()
            elapsed = time.monotonic() - started
        finally:
            stop.set()
            proc.terminate()
            proc.wait(timeout=60)
            if controller is not None:
                os.close(controller)
        used = (after.user - before.user) + (after.system - before.system)
        return 100 * used / elapsed


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def component_costs() -> dict[str, float]:
    """Seconds per call of what the display and metrics add, in this process: precise where the end-to-end CPU
    figures above are noisy (a few % of a core from run to run on a shared 2-core machine)."""
    from supervisor.config import MetricsConfig
    from supervisor.observe.console import Console
    from supervisor.observe.metrics import MetricsExporter

    status = {
        "state": "running",
        "attempt": 1,
        "restarts": 1,
        "max_restarts": 3,
        "updated_at": time.time(),
        "last_checkpoint": {"step": 425},
        "last_checkpoint_at": time.time() - 3,
        "progress": {"step": 431, "total_steps": 600, "loss": 2.065, "steps_per_s": 12.6, "eta_s": 13.0},
        "goodput": {
            "wall_s": 40.0,
            "productive_s": 30.0,
            "lost_s": 1.0,
            "restart_s": 8.0,
            "save_s": 1.0,
            "hang_s": 0.0,
            "stopped_s": 0.0,
            "ratio": 0.75,
        },
        "ranks": [{"rank": r, "step": 431, "heartbeat_age_s": 0.2, "compute_s": 0.05} for r in range(RANKS)],
        "stragglers": [],
        "skipped_steps": 1,
        "anomalies": {"global_norm_spike": 1},
        "failures": [],
    }
    event = {
        "event": "rank_crashed",
        "level": "error",
        "rank": 1,
        "attempt": 0,
        "returncode": -9,
        "cause": "killed by SIGKILL",
        "time": "2026-11-23T16:02:16.000000Z",
    }
    with open(os.devnull, "w") as sink, tempfile.TemporaryDirectory() as name:
        console = Console(sink, live=True)
        exporter = MetricsExporter(MetricsConfig(textfile=str(Path(name) / "t.prom")), log=_Quiet())
        exporter.publish(status)
        from prometheus_client import generate_latest

        return {
            "status line": _per_call(lambda: console.status(status)),
            "event line": _per_call(lambda: console.event(event)),
            "metrics publish + textfile": _per_call(lambda: exporter.publish(status)),
            "metrics scrape": _per_call(lambda: generate_latest(exporter.registry)),
        }


class _Quiet:
    def __getattr__(self, _level: str) -> Any:
        return lambda *args, **kwargs: None


def _per_call(call: Any, seconds: float = 1.0) -> float:
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        calls += 1
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    kinds = ("json", "console", "console+metrics")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for trial in range(args.trials):
        for kind in kinds:
            results[kind].append(measure(kind))
            print(f"trial {trial + 1}: {kind:16s} {results[kind][-1]:6.2f} % of a core", flush=True)
    base = statistics.median(results["json"])
    print(
        f"\n{RANKS} ranks x {BEATS_PER_S} heartbeats/s, supervisor CPU over {WINDOW_S:.0f} s, median of {args.trials}:"
    )
    print(f"{'display':16s} {'% of a core':>12s} {'vs JSON lines':>14s}")
    for kind in kinds:
        median = statistics.median(results[kind])
        print(f"{kind:16s} {median:12.2f} {median - base:+13.2f}")
    # Rates: a status (line redrawn, metrics published) once a second, a scrape once a second, and, as the
    # worst case, every one of the 400 heartbeats a second an event line (heartbeats make none).
    rates = {"status line": 1, "event line": RANKS * BEATS_PER_S, "metrics publish + textfile": 1, "metrics scrape": 1}
    costs = component_costs()
    print(f"\n{'component':28s} {'per call':>10s} {'per second':>11s} {'% of a core':>12s}")
    for part, cost in costs.items():
        print(f"{part:28s} {1e6 * cost:8.1f} us {rates[part]:10d}x {100 * cost * rates[part]:11.3f}")
    print(f"{'total':28s} {'':10s} {'':11s} {sum(100 * c * rates[p] for p, c in costs.items()):11.3f}")


if __name__ == "__main__":
    main()
