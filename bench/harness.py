"""Shared pieces of the benchmarks that run the demo job under trainwarden and torchrun.

Launch command lines for both launchers in a fresh run dir, bounded polling, reading heartbeats and the
JSON-lines event logs, killing every process of a run, and the text helpers of the printed summaries.
The benchmarks run as scripts (`.venv/bin/python bench/x.py`), so they import this as `harness`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psutil
import yaml

from worker.contract import RunLayout

__all__ = [
    "NPROC",
    "POLL_S",
    "PREFIX",
    "REPO",
    "SCRIPT",
    "Launch",
    "demo_config",
    "event_time",
    "first_resumed_step",
    "fmt",
    "kill_run",
    "launched",
    "launched_to_end",
    "merged",
    "parse_time",
    "poll",
    "print_header",
    "rank_events",
    "ratio",
    "read_events",
    "read_heartbeat",
    "scratch_dir",
    "spread",
    "torchrun_launch",
    "trainwarden_launch",
]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "examples/demo_train.py"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
PREFIX = "demo"
NPROC = 2
POLL_S = 0.05
KILL_WAIT_S = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """One launcher's command line, environment and run directory for one trial."""

    argv: list[str]
    env: dict[str, str]
    run_dir: Path


# ---- launchers -------------------------------------------------------------------------------


def demo_config() -> dict[str, Any]:
    """configs/demo.yaml as a fresh dict."""
    return yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))


def trainwarden_launch(
    work: Path,
    steps: int,
    save_every: int,
    *,
    env: Mapping[str, str] | None = None,
    hang: dict[str, Any] | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> Launch:
    """`python -m supervisor run` on a config derived from configs/demo.yaml; `env` and `hang` go into the job,
    then `extra_config` is merged in, section by section (a key it leaves out keeps the demo's value)."""
    run_dir = work / "run"
    config = demo_config()
    config.update(script=str(REPO / SCRIPT), args=["--steps", str(steps)], run_dir=str(run_dir))
    config["worker"]["save_checkpoint_steps"] = save_every
    config.setdefault("env", {}).update(env or {})
    if hang is not None:
        config["hang"] = hang
    config = merged(config, extra_config or {})
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    argv = [sys.executable, "-m", "supervisor", "run", str(path), "--run-dir", str(run_dir)]
    return Launch(argv, dict(os.environ), run_dir)


def torchrun_launch(
    work: Path,
    steps: int,
    save_every: int,
    *,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 3,
    worker: Mapping[str, Any] | None = None,
) -> Launch:
    """Plain torchrun with its default rendezvous; the worker library resumes by itself. `worker`: more of the
    worker config (e.g. the demo's `worker:` section, so both launchers run the same job)."""
    run_dir = work / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [
        torchrun,
        "--nproc-per-node",
        str(NPROC),
        "--max-restarts",
        str(max_restarts),
        SCRIPT,
        "--steps",
        str(steps),
    ]
    worker_config = json.dumps({**(worker or {}), "save_checkpoint_steps": save_every, "prefix": PREFIX})
    full_env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TRAINWARDEN_RUN_DIR=str(run_dir),
        TRAINWARDEN_WORKER_CONFIG=worker_config,
        **(env or {}),
    )
    return Launch(argv, full_env, run_dir)


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra` laid over it; a mapping in both is merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = merged(out[key], value) if both else value
    return out


@contextlib.contextmanager
def launched(launch: Launch, work: Path) -> Iterator[subprocess.Popen]:
    """Start the launcher in its own session, output in `work`; on leaving, every process of the run is killed."""
    with open(work / "launcher.out", "wb") as out, open(work / "launcher.err", "wb") as err:
        launcher = subprocess.Popen(
            launch.argv,
            cwd=REPO,
            env=launch.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        yield launcher
    finally:
        with sigint_deferred():
            kill_run(launcher, launch.run_dir)


def launched_to_end(launch: Launch, work: Path, timeout_s: float) -> tuple[float, int | None]:
    """Run `launch` until its launcher exits or `timeout_s` passes: wall time (cleanup included) and exit code
    (None: killed at the limit)."""
    started = time.monotonic()
    with launched(launch, work) as launcher:
        try:
            exit_code: int | None = launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exit_code = None
    return time.monotonic() - started, exit_code


# ---- observing a run -------------------------------------------------------------------------


def poll(check: Callable[[], T | None], deadline: float, interval_s: float, alive: subprocess.Popen) -> T | None:
    """The first non-None `check()`, or None once `deadline` (monotonic) passes or `alive` has exited."""
    while time.monotonic() < deadline:
        found = check()
        if found is not None or alive.poll() is not None:
            return found
        time.sleep(interval_s)
    return None


def read_heartbeat(layout: RunLayout, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads(layout.heartbeat(rank).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of one event log (a rank's or the supervisor's journal); [] while it is missing."""
    events = []
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def rank_events(layout: RunLayout, ranks: Iterable[int] = range(NPROC)) -> list[dict[str, Any]]:
    """Every whole event line of the given ranks (all by default)."""
    return [event for rank in ranks for event in read_events(layout.rank_events(rank))]


def parse_time(text: str) -> float:
    """An ISO-8601 `time` field of an event (UTC, `Z` suffix) as a time.time() value."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def event_time(event: dict[str, Any]) -> float:
    return parse_time(event["time"])


def first_resumed_step(events: list[dict[str, Any]]) -> tuple[float, int] | None:
    """Wall time and attempt of the earliest step event after the first attempt."""
    steps = [(event_time(e), e["attempt"]) for e in events if e.get("event") == "step" and e.get("attempt", 0) >= 1]
    return min(steps, default=None)


# ---- cleaning up -------------------------------------------------------------------------------


def kill_run(launcher: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's group and every process whose environment names the run dir; wait, bounded."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(launcher.pid, signal.SIGKILL)  # first, so the launcher cannot start new ranks meanwhile
    procs = run_processes(run_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launcher.wait(timeout=KILL_WAIT_S)
    _, alive = psutil.wait_procs(procs, timeout=KILL_WAIT_S)
    alive = [p for p in alive if not is_zombie(p)]
    if launcher.returncode is None or alive:
        print(f"WARNING: left behind after SIGKILL: {[launcher.pid, *(p.pid for p in alive)]}", flush=True)


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Processes whose environment names `run_dir` as the trainwarden run dir (every rank, under both launchers)."""
    return [p for p in psutil.process_iter() if names_run_dir(p, run_dir)]


def names_run_dir(proc: psutil.Process, run_dir: Path) -> bool:
    try:
        return proc.environ().get("TRAINWARDEN_RUN_DIR") == str(run_dir)
    except psutil.Error:
        return False


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold off Ctrl-C while cleaning up, so a second one cannot leave processes behind; re-raised after."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def scratch_dir(keep: bool) -> Iterator[Path]:
    """A fresh temporary folder for the trials' run dirs; removed afterwards unless `keep`."""
    work = Path(tempfile.mkdtemp(prefix="trainwarden-bench-")).resolve()
    try:
        yield work
    finally:
        if keep:
            print(f"run dirs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# ---- report ------------------------------------------------------------------------------------


def print_header(details: str) -> None:
    """The command line, working directory and core count, then what the benchmark does."""
    print(f"command: {shlex.join([sys.executable, *sys.argv])}  (cwd {Path.cwd()})")
    print(f"cores: {os.cpu_count()} (usable {len(os.sched_getaffinity(0))}); {details}", flush=True)


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def spread(values: list[float | None]) -> tuple[float | None, str]:
    """Median, and 'median [min–max]' as text, of the values that were measured."""
    got = [v for v in values if v is not None]
    if not got:
        return None, "n/a"
    median = statistics.median(got)
    missing = f", {len(values) - len(got)} n/a" if len(got) < len(values) else ""
    return median, f"{median:.2f} [{min(got):.2f}–{max(got):.2f}]{missing}"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator and denominator else "n/a"


LAUNCHERS = ("trainwarden", "torchrun")


def run_trials(
    trials: int,
    work: Path,
    run_trial: Callable[[str, Path], T],
    describe: Callable[[int, int, T], str],
    names: Iterable[str] = LAUNCHERS,
) -> list[T]:
    """Each trial runs every launcher in turn, so drift on the machine hits all alike; prints as it goes."""
    results = []
    for index in range(1, trials + 1):
        for name in names:
            trial = run_trial(name, work / f"trial_{index}_{name.replace(' ', '_')}")
            results.append(trial)
            print(describe(index, trials, trial), flush=True)
    return results
