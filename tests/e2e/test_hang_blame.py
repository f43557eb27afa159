"""The culprit of each kind of hang, named with its class and evidence: one run of the real 3-rank demo through a
stream of faults, each firing once (the other classes: a host-side hang in test_fault_stream.py, a silent, frozen
rank in test_warm_standby.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.observe.status import render
from tests.e2e.conftest import FAST_HANG, Finished, journal, run_supervisor, trainwarden_status, write_config

pytestmark = pytest.mark.timeout(240)

# Attempt 0: rank 1's all-reduce of step 12 never completes on its side (in-collective);
# attempt 1: rank 2 issues one extra all-reduce at step 14: gloo aborts a rank on the size mismatch (desync); with
# one restart allowed, the run ends there, and its final message must name the desync's culprit.
FAULTS = "1:stall_in_collective@12,2:extra_collective@14"
STREAM = {
    "nproc_per_node": 3,
    "env": {"TRAINWARDEN_FAULTS_ONCE": "1", "TRAINWARDEN_FAULTS": FAULTS, "OMP_NUM_THREADS": "1"},
    "hang": {**FAST_HANG, "phase_timeouts_s": {"train": 2.0, "save": 8.0}},
    "restart": {"max_restarts": 1},
}


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """A run through STREAM, ended by its second failure."""
    tmp = tmp_path_factory.mktemp("hang_blame")
    return run_supervisor(write_config(tmp / "job.yaml", steps=16, **STREAM), tmp / "run", timeout=200)


def verdict(run_dir: Path, event: str, attempt: int) -> dict[str, Any]:
    (found,) = [e for e in journal(run_dir) if e["event"] == event and e["attempt"] == attempt]
    return found


def failure(run_dir: Path, attempt: int) -> dict[str, Any]:
    (found,) = [f for f in trainwarden_status(run_dir)["failures"] if f["attempt"] == attempt]
    return found


def test_a_collective_that_never_completes_on_one_rank_is_named_in_collective_by_the_flight_recorder(done):
    """Every rank's stack is inside a collective (the stacks cannot tell), its heartbeat silent like its peers'; the
    flight recorders show rank 1 never completed the all-reduce its peers completed."""
    blamed = done.run_dir
    hang = verdict(blamed, "hang_detected", 0)
    assert (hang["rank"], hang["class"], hang["named_by"], hang["step"]) == (1, "in-collective", "flight_recorder", 11)
    assert hang["evidence"].startswith("process group 0 collective #") and hang["evidence"].endswith(
        ": enqueued but never completed on rank 1, while its peers completed it and wait in #"
        + hang["evidence"].rsplit("#", 1)[1]
    )
    assert failure(blamed, 0)["rank"] == 1 and failure(blamed, 0)["cause"].startswith("hang: rank 1 (in-collective: ")
    assert (blamed / "ranks" / "rank_1" / "flight_recorder_attempt_0.json").stat().st_size > 0


def test_an_extra_collective_that_aborts_a_peer_is_named_a_desync_of_the_rank_that_issued_it(done):
    """Gloo ends the desync with a C++ abort in whichever rank meets the mismatch; the rank that crashed first is
    not the culprit: the flight recorders left by the others name rank 2, and the failure is charged to it."""
    blamed = done.run_dir
    crash = verdict(blamed, "rank_crashed", 1)
    assert crash["cause"].startswith("desync: Received data size doesn't match expected size")
    named = verdict(blamed, "culprit_named", 1)
    assert (named["rank"], named["class"], named["named_by"]) == (2, "desync", "flight_recorder")
    assert "rank 2" in named["evidence"]
    assert (failure(blamed, 1)["rank"], failure(blamed, 1)["kind"]) == (2, "collective")


def test_the_final_message_and_status_name_the_culprits(done):
    """The run ends on the desync: its reason names rank 2 and the class; status shows the hang's culprit too."""
    assert done.returncode == 1
    status = trainwarden_status(done.run_dir)
    assert (status["state"], status["restarts"]) == ("failed", 1)
    assert status["reason"].startswith("rank 2 (desync) failed a collective in attempt 1: ")
    assert "rank 2 (desync) failed a collective" in done.stderr
    shown = [line for line in render(status).splitlines() if line.startswith("  culprit: ")]
    assert shown == ["  culprit: in-collective, named by flight_recorder: " + status["hang"]["evidence"]]
    assert [e["resume_step"] for e in journal(done.run_dir) if e["event"] == "ranks_launched"] == [None, 10]
