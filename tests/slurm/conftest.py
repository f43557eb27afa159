"""Fixtures for tests on the simulated Slurm cluster (tests/slurm/sim; helpers in cluster.py).

    pytestmark = pytest.mark.slurm     # plain `pytest` deselects these; run: pytest -m slurm tests/slurm

    def test_x(slurm, tmp_path):       # slurm is the cluster module
        job = slurm.sbatch(["-N2"], script, cwd=tmp_path)

`slurm` (session) skips the test when the cluster cannot run here (not root, no apt-get, ...),
else makes sure a 3-node cluster is up and idle, and tears it down at the end only if it started
it. After each test that used it, every job is cancelled and every node restored, healed, idle.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.slurm import cluster

_ready: list[bool] = []  # the session fixture got a cluster up (else there is nothing to reset)


@pytest.fixture(scope="session")
def slurm() -> Iterator[ModuleType]:
    reason = cluster.available()
    if reason:
        pytest.skip(reason)
    # one test session at a time on the cluster: another one's reset() would cancel our jobs
    lock = cluster.lock_session(timeout=120)
    try:
        started = cluster.ensure_up(cluster.NODES)
    except BaseException as e:
        lock.close()
        if isinstance(e, RuntimeError) and not shutil.which("slurmd"):  # apt-get install failed (offline?)
            pytest.skip(f"slurm-wlm could not be installed: {str(e)[-500:]}")
        raise
    _ready.append(True)
    try:
        yield cluster
    finally:
        _ready.clear()
        if started:
            cluster.down()
        lock.close()


@pytest.fixture(autouse=True)
def _slurm_reset(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used `slurm`: no job, crashed node or partition leaks into the next."""
    yield
    if _ready and "slurm" in request.fixturenames:
        cluster.reset(cluster.NODES)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with what its runs' journals said (heartbeats left out): the run dir is gone
    by the time someone reads a CI log."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and isinstance(tmp_path, Path):
        for journal in sorted(tmp_path.glob("**/supervisor/events.jsonl")):
            report.sections.append((f"journal {journal.relative_to(tmp_path)}", journal_tail(journal)))
        # What agents and successors said once their srun was gone (a fencing agent's stall dumps among it).
        for log in sorted([*tmp_path.glob("**/logs/agent_*.log"), *tmp_path.glob("**/supervisor/successor_*.log")]):
            tail = log.read_text(errors="replace").splitlines()[-40:]
            report.sections.append((f"log {log.relative_to(tmp_path)}", "\n".join(tail)))
    return report


def journal_tail(journal: Path, lines: int = 60) -> str:
    kept = []
    for line in journal.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") != "heartbeat":
            kept.append(" ".join(f"{k}={str(v)[:160]}" for k, v in event.items() if k not in ("level", "pid")))
    return "\n".join(kept[-lines:])


@pytest.fixture(scope="session")
def reference(slurm: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """An uninterrupted 2x2 run on the cluster: the state every interrupted run must end in, bitwise."""
    from tests.slurm.test_multinode import final_states, finished, status, submit

    tmp = tmp_path_factory.mktemp("reference")
    job, run_dir = submit(slurm, tmp)
    code, out = finished(slurm, job, tmp)
    assert code == 0, out[-3000:]
    assert status(run_dir)["restarts"] == 0
    return final_states(run_dir)
