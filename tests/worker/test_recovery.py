"""worker.recovery's parts on their own: which failures a rank recovers from in place, the supervisor's word it
reads (hostile files included), the NCCL watchdog's trigger, and a standby's GPU warm-up on a machine without one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from supervisor.rundir.watch import read_heartbeat
from tests.conftest import wait_until
from tests.e2e.conftest import REPO
from tests.hostile import KINDS, bounded, plant
from worker.contract import ENV_ATTEMPT, ENV_RUN_DIR, RECOVERING_PHASE, UNWIND_SIGNAL, RunLayout
from worker.recovery import _read_order, let_threads_run, peer_failure, watch_for_unwind
from worker.standby import warm_device

GLOO_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33696. "
    "This is typically caused by a remote worker crashing."
)


def test_a_peer_gone_is_recovered_from_in_place() -> None:
    assert peer_failure(RuntimeError(GLOO_GONE)).startswith("RuntimeError: [/pytorch/third_party/gloo")
    assert peer_failure(dist.DistNetworkError("Connection reset by peer")) is not None
    assert peer_failure(RuntimeError("NCCL communicator was aborted on rank 1")) is not None


def test_a_peer_gone_behind_another_exception_is_found() -> None:
    try:
        try:
            raise RuntimeError(GLOO_GONE)
        except RuntimeError as exc:
            raise ValueError("the loss could not be read") from exc
    except ValueError as outer:
        assert peer_failure(outer) is not None


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("a bug in the script"),
        RuntimeError("[gloo/transport/tcp/pair.cc:446] Received data size doesn't match expected size"),  # a desync
        RuntimeError("CUDA error: an illegal memory access was encountered; Connection reset by peer"),
        KeyboardInterrupt(),
        SystemExit(3),
    ],
)
def test_anything_else_ends_the_rank_as_it_always_did(exc: BaseException) -> None:
    assert peer_failure(exc) is None


def test_the_next_attempt_is_read_only_from_a_whole_order(tmp_path: Path) -> None:
    path = tmp_path / "recovery.json"
    assert _read_order(path) is None  # none yet
    path.write_text(json.dumps({"unwind": 3}))
    assert _read_order(path) is None  # the attempt unwinds; the next one is not named yet
    path.write_text(json.dumps({"unwind": 3, "next": 4, "env": {"MASTER_PORT": "29511", "TRAINWARDEN_ATTEMPT": "4"}}))
    assert _read_order(path) == (4, {"MASTER_PORT": "29511", "TRAINWARDEN_ATTEMPT": "4"})
    for junk in ('{"next": "4", "env": {}}', '{"next": 4, "env": {"A": 1}}', '{"next": 4, "env": []}', "[", "nan"):
        path.write_text(junk)
        assert _read_order(path) is None, junk


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_order_is_never_followed_or_blocked_on(tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    path = tmp_path / "run" / "recovery.json"
    plant(path, kind, outside)
    assert bounded(lambda: _read_order(path)) == ("returned", None)


def test_the_watchdog_aborts_once_when_its_attempt_unwinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With NCCL the watchdog aborts the communicators so a blocked collective raises (here: a recorded call)."""
    layout = RunLayout(tmp_path)
    layout.recovery.parent.mkdir(parents=True)
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_ATTEMPT, "2")
    aborted = threading.Event()
    calls: list[float] = []

    def abort() -> None:
        calls.append(time.monotonic())
        aborted.set()

    watch_for_unwind(abort)
    layout.recovery.write_text(json.dumps({"unwind": 1}))  # an earlier attempt's word: not this one's
    time.sleep(0.3)
    assert not calls
    layout.recovery.write_text(json.dumps({"unwind": 2}))
    assert aborted.wait(5)
    time.sleep(0.3)
    assert len(calls) == 1  # once per attempt
    os.environ[ENV_ATTEMPT] = "3"  # the process went on into attempt 3 (monkeypatch restores it)


def test_a_standby_warms_a_gpu_only_for_a_gpu_job() -> None:
    assert warm_device("cpu", 0) is None
    assert warm_device(None, 0) is None
    assert warm_device("cuda", 1) == "no CUDA device is visible: nothing warmed"  # this CPU-only machine


SCRIPT = """
import os, sys, time
from worker import run

calls = []

def main():
    calls.append(os.environ["TRAINWARDEN_ATTEMPT"])
    print("main", os.environ["TRAINWARDEN_ATTEMPT"], os.environ.get("MASTER_PORT"), flush=True)
    if len(calls) == 1:
        open(os.environ["READY"], "w").close()
        while True:  # training, until the supervisor's word
            time.sleep(0.01)
    print("done", calls, flush=True)

run(main)
"""


def test_a_rank_told_to_unwind_runs_its_training_function_again_in_the_next_attempt(tmp_path: Path) -> None:
    """The supervisor's word (its file, then UNWIND_SIGNAL) ends the training function; the process says
    `recovering`, waits for the next attempt, takes its variables and log files, and runs the function again. A
    word for another attempt is ignored."""
    layout = RunLayout(tmp_path / "run")
    layout.recovery.parent.mkdir(parents=True)
    ready = tmp_path / "ready"
    env = {**os.environ, "TRAINWARDEN_IN_PLACE": "1", ENV_RUN_DIR: str(layout.root), ENV_ATTEMPT: "0", "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env={**env, "READY": str(ready)}, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_until(ready.exists, timeout=30, what="the training function to run")
        layout.recovery.write_text(json.dumps({"unwind": 7}))  # a word for another attempt
        os.kill(proc.pid, UNWIND_SIGNAL)
        time.sleep(0.3)
        assert proc.poll() is None and not layout.heartbeat(0).exists()
        layout.recovery.write_text(json.dumps({"unwind": 0}))
        os.kill(proc.pid, UNWIND_SIGNAL)
        wait_until(lambda: _phase(layout) == RECOVERING_PHASE, timeout=10, what="the rank to say it recovers")
        ready_beat = read_heartbeat(layout.heartbeat(0), 0)  # as the supervisor reads it
        assert ready_beat is not None and ready_beat.failed_s is not None and 0 <= ready_beat.failed_s < 10
        order = {"unwind": 0, "next": 1, "env": {ENV_ATTEMPT: "1", "MASTER_PORT": "29777"}}
        layout.recovery.write_text(json.dumps(order))
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert out == "main 0 None\n"  # attempt 1's output goes to its own log file, as a relaunched rank's does
    assert "PeerFailed: attempt 0 unwinds" in err
    assert layout.attempt_log(1, 0, "out").read_text() == "main 1 29777\ndone ['0', '1']\n"


def _phase(layout: RunLayout) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(layout.heartbeat(0).read_text())["phase"]
    return None


STUCK = """
import os, time
import worker.recovery as recovery
from worker import run

recovery.RELEASE_TIMEOUT_S = 0.5  # the test's own bound; 5 s by default

class Stuck:
    def __del__(self):  # a destructor that never returns, as a gloo group's may while a live peer left its collective
        time.sleep(3600)

def main():
    stuck = Stuck()
    stuck.cycle = stuck  # freed only by the collector, at the recovery's collection
    del stuck
    open(os.environ["READY"], "w").close()
    while True:
        time.sleep(0.01)

run(main)
"""


def test_a_release_that_blocks_ends_the_rank_with_its_stacks(tmp_path: Path) -> None:
    """Releasing the failed attempt's objects must not hold the rank forever: past RELEASE_TIMEOUT_S it exits 1 with
    every thread's stack in its log, and the supervisor replaces it like the failed rank. The collection comes after
    its `recovering` beat (the supervisor chooses the next attempt meanwhile): a rank that dies after saying so is
    replaced as one that dies while unwinding is, or in the next attempt."""
    layout = RunLayout(tmp_path / "run")
    layout.recovery.parent.mkdir(parents=True)
    layout.recovery.write_text(json.dumps({"unwind": 0}))
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "TRAINWARDEN_IN_PLACE": "1",
        ENV_RUN_DIR: str(layout.root),
        ENV_ATTEMPT: "0",
        "READY": str(ready),
    }
    proc = subprocess.Popen([sys.executable, "-c", STUCK], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_until(ready.exists, timeout=30, what="the training function to run")
        os.kill(proc.pid, UNWIND_SIGNAL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1
    assert "Timeout (0:00:00.500000)!" in err and "in __del__" in err and "in _recover" in err


BLOCKED = """
import os, signal, sys, time
import torch, torch.distributed as dist
import worker.recovery as recovery
from worker import run

recovery.STUCK_S = 1.0  # the test's own bound; 3 s by default
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
if rank == 1:  # a peer that keeps its connection open and never joins the collective (it ignores the word)
    signal.signal(recovery.UNWIND_SIGNAL, signal.SIG_IGN)
    time.sleep(60)
    sys.exit(0)

def main():
    open(os.environ["READY"], "w").close()
    dist.all_reduce(torch.ones(1))  # waits in C++ for rank 1: the word's handler cannot run meanwhile

run(main)
"""


def test_a_rank_stuck_in_a_collective_after_the_word_exits_to_be_replaced(tmp_path: Path) -> None:
    """A gloo collective waiting on a live peer never raises, and its rank never runs the signal's handler: STUCK_S
    after the word the rank exits 1 with its stacks, so the supervisor replaces it and its peers are not held."""
    layout = RunLayout(tmp_path / "run")
    layout.recovery.parent.mkdir(parents=True)
    ready = tmp_path / "ready"
    env = {**os.environ, "TRAINWARDEN_IN_PLACE": "1", ENV_RUN_DIR: str(layout.root), ENV_ATTEMPT: "0",
           "READY": str(ready), "INIT": f"file://{tmp_path / 'store'}"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", BLOCKED], env={**env, "RANK": str(rank)}, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]  # fmt: skip
    try:
        wait_until(ready.exists, timeout=60, what="rank 0's training function to run")
        time.sleep(0.3)  # inside the collective
        layout.recovery.write_text(json.dumps({"unwind": 0}))
        os.kill(procs[0].pid, UNWIND_SIGNAL)
        _, err = procs[0].communicate(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 1, err[-2000:]
    assert "still in attempt 0's training function 1 s after the word to unwind" in err
    assert "in main" in err  # its stacks: where it was stuck


def test_threads_that_need_the_gil_once_more_run_before_the_group_goes() -> None:
    """A gloo work thread that ended a failed collective still frees its tensors under the GIL: the rank lets it
    run (here a thread busy without the GIL, as hashing is, that then needs it once) before it destroys its group."""
    done: list[bytes] = []
    data = os.urandom(1 << 20) * 64
    worker = threading.Thread(target=lambda: done.append(hashlib.sha256(data).digest()))
    worker.start()
    let_threads_run(limit_s=60)
    assert done, "returned while a thread was still runnable"
    worker.join(timeout=10)


def test_a_thread_that_waits_does_not_hold_the_rank_up() -> None:
    never = threading.Event()
    waiter = threading.Thread(target=never.wait, daemon=True)
    waiter.start()
    let_threads_run(limit_s=60)
    assert waiter.is_alive()  # it returned while the waiting thread still waits
    never.set()
    waiter.join(timeout=10)
