"""worker.recovery's parts on their own: which failures a rank recovers from in place, the supervisor's word it
reads (hostile files included), the NCCL watchdog's trigger, and a standby's GPU warm-up on a machine without one."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hostile import KINDS, bounded, plant
from worker.contract import ENV_ATTEMPT, ENV_RUN_DIR, RunLayout
from worker.recovery import _read_order, peer_failure, watch_for_unwind
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
