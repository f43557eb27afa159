"""Shared fixtures: every spawned process is tagged, and a test that leaves one behind fails."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest

TAG_ENV = "TRAINWARDEN_TEST_TAG"
# Where the environment forbids bytecode files (some sandboxes set PYTHONDONTWRITEBYTECODE), each of the suite's
# few hundred supervisors and ranks would compile the project from source again: let them write it once.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than cores. End-to-end tests spend part of their time waiting (timeouts, sleeping
    ranks, a slow save); the spare worker fills it (on 2 cores: 200 s instead of 222 s, the same CPU)."""
    return len(os.sched_getaffinity(0)) + 1


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "") -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries `tag` (ranks, grandchildren, orphans alike)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TAG_ENV) == tag and proc.status() != "zombie":
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(autouse=True)
def no_leaked_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tag this test's environment; afterwards fail if any tagged process is still alive (and kill it)."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)
    yield
    leaked = tagged_processes(tag)
    if leaked:
        # Give exiting processes a moment; anything left is a real leak.
        _, alive = psutil.wait_procs(leaked, timeout=3)
        for proc in alive:
            proc.kill()
        assert not alive, f"test leaked processes: {[(p.pid, p.name()) for p in alive]}"
