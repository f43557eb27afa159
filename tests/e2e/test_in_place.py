"""Recovery in place on the real demo: a rank SIGKILLed at each point of a step is replaced, its peer stays (same
pid), every rank resumes from the same step, and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import wait_until
from tests.e2e.conftest import (
    FAST_HANG,
    assert_same_training_state,
    finish,
    heartbeat,
    journal,
    run_to_the_end,
    signal_rank_at_step,
    start_supervisor,
    write_config,
)

pytestmark = pytest.mark.timeout(240)

# One kill at each point of a step, alternating ranks; each fires once (TRAINWARDEN_FAULTS_ONCE). Snapshots every
# step to memory: the step a kill leaves half-applied (the killed rank's optimizer stepped, or its peer's did) is in
# no snapshot complete on every rank.
KILLS = {
    2: (1, "sigkill_in_forward"),  # so soon after the launch that the supervisor may not have read a beat yet
    16: (0, "sigkill_in_backward"),
    24: (1, "sigkill_in_guard"),
    32: (0, "sigkill_in_optimizer"),
    40: (1, "sigkill"),  # after its step, before its snapshot
}
LOST_AT = 48  # rank 0's collective fails after step 48 with both ranks alive: both recover in place, none replaced
HUNG_AT = 52  # rank 0 hangs after step 52: it alone is killed, rank 1 recovers in place
IN_PLACE_STREAM = {
    "env": {
        "TRAINWARDEN_FAULTS_ONCE": "1",
        "TRAINWARDEN_FAULTS": ",".join(
            [
                *(f"{rank}:{kind}@{step}" for step, (rank, kind) in KILLS.items()),
                f"0:peer_gone@{LOST_AT}",
                f"0:hang@{HUNG_AT}",
            ]
        ),
    },
    "restart": {"max_restarts": 10, "backoff_factor": 1.0},
    "worker": {"snapshot_steps": 1},
    "hang": FAST_HANG,
}


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_to_the_end(tmp_path_factory.mktemp("in_place"), **IN_PLACE_STREAM)


def rank_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_each_kill_is_recovered_in_place_with_the_survivor_kept(stream: Path) -> None:
    records = journal(stream)
    launches = [e for e in records if e["event"] == "ranks_launched"]
    recoveries = [e for e in records if e["event"] == "recovered_in_place"]
    assert [e["attempt"] for e in recoveries] == [1, 2, 3, 4, 5, 6, 7]
    assert not [e for e in records if e["event"] == "relaunched"]
    *kills, lost, hung = recoveries
    started = {e["attempt"]: e for e in records if e["event"] == "replacement_started"}
    for recovery, (step, (killed, _kind)) in zip(kills, KILLS.items(), strict=True):
        survivor, failed = 1 - killed, recovery["attempt"] - 1
        before = launches[failed]["pids"]
        assert (recovery["kept"], recovery["replaced"]) == ([survivor], [killed])
        assert recovery["pids"][survivor] == before[survivor], "the survivor's process goes on"
        assert recovery["pids"][killed] != before[killed]
        # Its replacement ran the script while the survivor unwound, and waited for the new attempt beside it.
        assert (started[failed]["rank"], started[failed]["pid"]) == (killed, recovery["pids"][killed])
        waited = (stream / "logs" / f"attempt_{failed + 1}" / f"rank_{killed}.err").read_text()
        assert f"trainwarden: replacing rank {killed}, lost in attempt {failed}" in waited
        # The newest step both ranks snapshotted; none, from scratch, when the first kill (step 2) comes before the
        # survivor's snapshot of step 1 (it was told to unwind between its step and its snapshot).
        assert step - 2 <= (recovery["resume_step"] or 0) < step, recovery
    assert (lost["kept"], lost["replaced"], lost["pids"]) == ([0, 1], [], launches[5]["pids"])
    assert lost["resume_step"] == LOST_AT - 1  # the fault strikes before step 48's snapshot
    (collective,) = [e for e in records if e["event"] == "collective_lost"]
    assert (collective["attempt"], collective["rank"]) == (5, 0)
    # The hang: its culprit named by the flight recorders and killed alone; rank 1's process goes on.
    (detected,) = [e for e in records if e["event"] == "hang_detected"]
    assert (detected["attempt"], detected["rank"], detected["named_by"]) == (6, 0, "flight_recorder")
    (killed,) = [e for e in records if e["event"] == "hang_culprit_killed"]
    assert (killed["attempt"], killed["rank"]) == (6, 0)
    assert (hung["kept"], hung["replaced"], hung["resume_step"]) == ([1], [0], HUNG_AT - 1)
    assert hung["pids"][1] == launches[6]["pids"][1]


def test_every_rank_resumes_each_attempt_from_the_same_step(stream: Path) -> None:
    """No half-applied step survives: both ranks load the step the supervisor chose and train on from it."""
    chosen = {e["attempt"]: e["resume_step"] for e in journal(stream) if e["event"] == "ranks_launched"}
    for rank in (0, 1):
        events = rank_events(stream, rank)
        starts = {e["attempt"]: e.get("step") for e in events if e["event"] in ("resumed", "fresh_start")}
        assert starts == chosen, f"rank {rank}"  # every attempt, from the step chosen (None: from scratch)
        for attempt, step in starts.items():
            first = next(e for e in events if e["event"] == "step" and e["attempt"] == attempt)
            assert first["step"] == (step or 0) + 1


def test_the_survivor_said_why_it_unwound(stream: Path) -> None:
    failed = [e for e in rank_events(stream, 0) if e["event"] == "peer_failed"]
    assert [e["attempt"] for e in failed] == [0, 2, 4, 5]  # rank 1 killed; then rank 0's own lost connection
    # The supervisor's word (UNWIND_SIGNAL), or the collective's own error if it came first.
    assert all(e["error"].startswith("PeerFailed: ") or "Connection" in e["error"] for e in failed[:3]), failed
    assert failed[3]["error"].startswith("DistNetworkError: peer_gone fault after step 48")


def test_the_run_ends_bitwise_equal_to_an_uninterrupted_one(stream: Path, reference_run: Path) -> None:
    assert_same_training_state(stream, reference_run)


def test_a_replacement_started_for_a_recovery_in_place_goes_when_every_rank_is_relaunched(tmp_path: Path) -> None:
    """Rank 0 frozen (SIGSTOP) when rank 1 dies: it cannot unwind, so every rank is relaunched after
    restart.in_place_timeout_s, and the standby already running the script for rank 1 is ended, not used or kept."""
    slow = {"TRAINWARDEN_FAULTS": "0:slow@1:0.05,1:slow@1:0.05"}  # time for the signals below, and for the wait after
    config = write_config(tmp_path / "job.yaml", steps=40, env=slow, restart={"in_place_timeout_s": 1.0})
    proc = start_supervisor(config, tmp_path / "run")
    # Rank 1's beat past step 3 first (signal 0 sends nothing): beats are throttled, and once rank 0 is frozen rank 1
    # waits in a collective and writes none, so a beat behind then would stay behind.
    signal_rank_at_step(tmp_path / "run", 1, 3, 0)
    signal_rank_at_step(tmp_path / "run", 0, 3, signal.SIGSTOP)
    signal_rank_at_step(tmp_path / "run", 1, 3, signal.SIGKILL)
    wait_until(lambda: (beat := heartbeat(tmp_path / "run", 0)) and beat["attempt"] == 1 and beat["step"], timeout=60)
    (started,) = [e for e in journal(tmp_path / "run") if e["event"] == "replacement_started"]
    gone = not psutil.pid_exists(started["pid"]) or psutil.Process(started["pid"]).status() == psutil.STATUS_ZOMBIE
    done = finish(proc, tmp_path / "run")

    assert done.returncode == 0, done.stderr[-3000:]
    assert gone, "the unused replacement still runs while the relaunched attempt trains"
    records = journal(tmp_path / "run")
    (relaunched,) = [e for e in records if e["event"] == "relaunched"]
    assert relaunched["reason"].startswith("ranks [0] did not unwind within restart.in_place_timeout_s"), relaunched
    (launch,) = [e for e in records if e["event"] == "ranks_launched" and e["attempt"] == 1]
    assert started["pid"] not in launch["pids"]
