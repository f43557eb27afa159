"""One run of the real 2-rank demo through a stream of faults, each firing once: how each was seen and answered, and
that every relaunch resumed from the newest intact checkpoint and the run ended bitwise as an uninterrupted one."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    DEMO_STEPS,
    FAST_HANG,
    SAVE_TIMEOUT_S,
    TRAIN_TIMEOUT_S,
    assert_same_training_state,
    journal,
    run_to_the_end,
    trainwarden_status,
)

pytestmark = pytest.mark.timeout(300)

# The faults, each firing once (TRAINWARDEN_FAULTS_ONCE), and what ends each attempt:
#   0: rank 1 stops before an all-reduce after step 15, rank 0 blocks in it (a gloo hang);
#   1: rank 0 saves step 20 for 4 s (past the train timeout, inside the save timeout) and rank 1 dies right after
#      its own save of 20, 1 s in (the save in flight is waited for);
#   2: rank 1 is killed halfway through writing checkpoint 30;
#   3: rank 1 hangs inside its save of 40; attempt 4 finishes.
# (A rank frozen with SIGSTOP: test_warm_standby.py.)
FAULT_STREAM = {
    "env": {
        "TRAINWARDEN_FAULTS_ONCE": "1",
        "TRAINWARDEN_FAULTS": "1:hang@15,0:slow_save@20:4,1:slow_save@20:1,1:sigkill_after_save@20,"
        "1:sigkill_in_save@30,1:hang_in_save@40",
    },
    "hang": FAST_HANG,
    # Every rank relaunched, as for a script without worker.run (recovery in place: test_in_place.py).
    "restart": {"max_restarts": 10, "backoff_factor": 1.0, "in_place": False},
    "standby": {"enabled": True},  # four relaunches: fork-served standbys cost one import, cold ranks eight
}
RESUMES = [None, 10, 20, 20, 30]  # each attempt's resume step


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of a run through FAULT_STREAM that exited 0."""
    return run_to_the_end(tmp_path_factory.mktemp("fault_stream"), **FAULT_STREAM)


def events(run_dir: Path, name: str, attempt: int | None = None) -> list[dict[str, Any]]:
    return [e for e in journal(run_dir) if e["event"] == name and attempt in (None, e.get("attempt"))]


def failure(run_dir: Path, attempt: int) -> dict[str, Any]:
    (found,) = [f for f in trainwarden_status(run_dir)["failures"] if f["attempt"] == attempt]
    return found


def test_gloo_hang_is_detected_stacks_name_the_frames_and_run_resumes(stream: Path) -> None:
    """Rank 1 stops before an all-reduce after step 15, rank 0 blocks in it: the hang is declared after the 3 s
    train timeout, both ranks' stacks are saved, and the flight recorders name the culprit (host-side: it issued no
    more collectives); rank 0, blocked in the collective (it could not act on SIGTERM), is SIGKILLed at once, the
    culprit SIGTERMed; the relaunch resumes from 10."""
    (detected,) = events(stream, "hang_detected", attempt=0)
    assert (detected["phase"], detected["timeout_s"]) == ("train", TRAIN_TIMEOUT_S)
    assert (detected["rank"], detected["class"], detected["named_by"]) == (1, "host-side", "flight_recorder")
    assert TRAIN_TIMEOUT_S <= detected["silent_s"] < TRAIN_TIMEOUT_S + 2
    # Heartbeats cannot tell a collective hang's culprit from its victims; the stacks can.
    (stacks,) = events(stream, "stacks_collected", attempt=0)
    assert (stacks["culprit"], stacks["last_steps"]) == (1, {"0": 15, "1": 15})
    faulthandler = {rank: stream / "ranks" / f"rank_{rank}" / "stacks_attempt_0.txt" for rank in (0, 1)}
    assert {str(path) for path in faulthandler.values()} <= set(stacks["paths"]), "both dumps are referenced"
    assert "in hang_forever" in faulthandler[1].read_text()  # the rank that stopped before the all-reduce
    assert "in backward" in faulthandler[0].read_text()  # the rank blocked inside it
    hang = failure(stream, 0)
    assert (hang["rank"], hang["step"], hang["kind"]) == (1, 15, "hang")
    assert hang["cause"].startswith("hang: rank 1 (host-side: process group 0: rank 1 completed collective #")
    assert "and issued no more, while its peers wait in #" in hang["cause"]
    (killed,) = events(stream, "ranks_killed_at_once", attempt=0)
    assert (killed["ranks"], killed["why"]) == ([0], "blocked in a collective waiting for rank 1")
    stopped = events(stream, "rank_stopped", attempt=0)
    assert sorted((e["rank"], e["description"]) for e in stopped) == [
        (0, "killed by SIGKILL"),
        (1, "killed by SIGTERM"),
    ]
    assert [e["resume_step"] for e in events(stream, "ranks_launched", attempt=1)] == [10]


def test_slow_save_inside_its_phase_timeout_is_not_killed(stream: Path) -> None:
    """Rank 0 saving step 20 for 4 s, longer than the 3 s train timeout but inside the 8 s save timeout, is not
    declared hung: that attempt ends with its peer's crash, and the save completes."""
    rank_events = (stream / "ranks" / "rank_0" / "events.jsonl").read_text().splitlines()
    slow = [e for e in map(json.loads, rank_events) if e["event"] == "checkpoint_saved" and e["step"] == 20]
    assert [e["attempt"] for e in slow][:1] == [1] and slow[0]["duration_s"] >= 4.0
    assert events(stream, "hang_detected", attempt=1) == []
    assert (failure(stream, 1)["kind"], failure(stream, 1)["step"]) == ("signal", 20)


def test_a_peer_crash_does_not_cost_the_save_in_flight(stream: Path) -> None:
    """Rank 1 dies right after saving step 20 while rank 0 is in its 4 s save of 20, with a 1 s kill grace: the
    supervisor waits for the save (up to the save timeout), rank 0 finishes it and then obeys SIGTERM, and the
    relaunch resumes from 20. Rank 1's save takes 1 s more, so rank 0 is surely inside its save when rank 1 dies (on
    a busy machine rank 0 may otherwise still be in its step: then no save is in flight, and the SIGTERM rightly ends
    it there)."""
    journaled = journal(stream)
    (crash,) = [i for i, e in enumerate(journaled) if e["event"] == "rank_crashed" and e["attempt"] == 1]
    assert (journaled[crash]["rank"], journaled[crash]["step"]) == (1, 20)
    wait = next(e for e in journaled[crash:] if e["event"] == "stop_waits_for_save")
    assert wait["ranks"] == [0] and 0 < wait["wait_s"] <= SAVE_TIMEOUT_S  # what is left of the save timeout
    assert [(e["rank"], e["description"]) for e in events(stream, "rank_stopped", attempt=1)] == [
        (0, "killed by SIGTERM")
    ]
    rank0 = [json.loads(line) for line in (stream / "ranks" / "rank_0" / "events.jsonl").open()]
    assert [e["event"] for e in rank0 if e["attempt"] == 1][-2:] == ["checkpoint_saved", "stopped_after_save"]
    assert [e["resume_step"] for e in events(stream, "ranks_launched", attempt=2)] == [20]


def test_sigkill_while_writing_a_checkpoint_leaves_it_incomplete_and_its_temporary_removed(stream: Path) -> None:
    """Rank 1 killed halfway through writing checkpoint 30 leaves it incomplete: the relaunch passes over it,
    resumes from 20, and the killed save's temporary file (ours) is removed."""
    passed = [(e["step"], e["reason"]) for e in events(stream, "checkpoint_passed_over", attempt=3)]
    assert passed == [(30, "incomplete: rank 1 has no completion record")]
    assert [e["resume_step"] for e in events(stream, "ranks_launched", attempt=3)] == [20]
    removed = [e["path"] for e in events(stream, "torn_temporary_removed")]
    assert len(removed) == 1 and Path(removed[0]).name.startswith(".demo_rank_1-30.ckpt."), removed
    assert not list((stream / "checkpoint").rglob("*.tmp"))


def test_hang_inside_a_save_is_declared_after_the_save_timeout(stream: Path) -> None:
    """A rank stuck inside its save of step 40 is declared hung in phase save after 8 s; its checkpoint is
    incomplete, so the relaunch resumes from 30."""
    (detected,) = events(stream, "hang_detected", attempt=3)
    assert (detected["rank"], detected["phase"], detected["step"]) == (1, "save", 40)
    assert detected["timeout_s"] == SAVE_TIMEOUT_S
    assert (failure(stream, 3)["rank"], failure(stream, 3)["kind"]) == (1, "hang")
    assert [e["resume_step"] for e in events(stream, "ranks_launched", attempt=4)] == [30]


def test_every_fault_is_relaunched_from_the_newest_intact_checkpoint_and_the_run_ends_bitwise_equal(
    stream: Path, reference_run: Path
) -> None:
    """The four failures (two kills, two hangs), each relaunching every rank from the newest intact checkpoint;
    the run finishes with the same final state as the uninterrupted one."""
    status = trainwarden_status(stream)
    assert (status["state"], status["restarts"], status["attempt"]) == ("finished", 4, 4)
    assert status["last_checkpoint"] == {"step": DEMO_STEPS}
    assert [(f["attempt"], f["rank"], f["kind"]) for f in status["failures"]] == [
        (0, 1, "hang"),
        (1, 1, "signal"),
        (2, 1, "signal"),
        (3, 1, "hang"),
    ]
    assert [e["resume_step"] for e in events(stream, "ranks_launched")] == RESUMES
    assert [(e["attempt"], e["reason"]) for e in events(stream, "relaunched")] == [
        (attempt, "restart.in_place is false") for attempt in (1, 2, 3, 4)
    ]
    crashes = events(stream, "rank_crashed")
    assert [(e["attempt"], e["rank"], e["returncode"], e["step"]) for e in crashes] == [
        (1, 1, -signal.SIGKILL, 20),
        (2, 1, -signal.SIGKILL, 30),
    ]
    assert_same_training_state(stream, reference_run)
