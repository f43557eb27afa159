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
    config = {"script": str(script), "args": [str(BEATS_PER_S), str(WARMUP_S + WINDOW_S + 5)],
              "nproc_per_node": RANKS, "env": {"PYTHONPATH": str(REPO)}, "hang": {"heartbeat": "required"}}
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
        argv = [sys.executable, "-m", "supervisor", "run", str(job(tmp, metrics=kind == "console+metrics")),
                "--run-dir", str(tmp / "run")]
        if kind == "json":
            proc = subprocess.Popen([*argv, "--log-format", "json"], cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
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
    print(f"\n{RANKS} ranks x {BEATS_PER_S} heartbeats/s, supervisor CPU over {WINDOW_S:.0f} s, median of "
          f"{args.trials}:")
    print(f"{'display':16s} {'% of a core':>12s} {'vs JSON lines':>14s}")
    for kind in kinds:
        median = statistics.median(results[kind])
        print(f"{kind:16s} {median:12.2f} {median - base:+13.2f}")


if __name__ == "__main__":
    main()
