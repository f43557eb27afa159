"""`trainwarden stop` while no rank runs says so, and where the run then ends, from the state file."""

from __future__ import annotations

import json
from typing import Any

import pytest

from supervisor import cli
from worker.contract import RunLayout

RUNNING_RANKS = [{"rank": 0, "pid": 10, "returncode": None}, {"rank": 1, "pid": 11, "returncode": None}]
ENDS = "the run ends stopped at its newest complete state, step 100; the steps trained past it, up to step 110"


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ({"state": "running", "supervisor_alive": True, "ranks": RUNNING_RANKS}, None),
        ({"state": "running", "supervisor_alive": True, "ranks": RUNNING_RANKS, "stop_order": {}}, None),
        ({"state": "backoff", "supervisor_alive": True}, "the run is between attempts: backoff"),
        ({"state": "starting", "supervisor_alive": True}, "the run is between attempts: starting"),
        ({"state": "stopping", "supervisor_alive": True}, "the ranks of a failed attempt are going down"),
        ({"state": "stopping", "supervisor_alive": True, "stop_order": {"step": 5}, "ranks": RUNNING_RANKS}, None),
        ({"state": "running", "supervisor_alive": False, "ranks": RUNNING_RANKS}, "no supervisor holds the run now"),
        ({"state": "running", "supervisor_alive": True, "ranks": [{"pid": 10, "returncode": 0}]}, "every rank"),
        (  # a successor holds the lease and has not written its state: the ranks listed are its predecessor's
            {
                "state": "running",
                "supervisor_alive": True,
                "ranks": RUNNING_RANKS,
                "lease_generation": 1,
                "supervisor": {"generation": 2},
            },
            "a new supervisor has just taken the run over",
        ),
        (
            {
                "state": "running",
                "supervisor_alive": True,
                "ranks": RUNNING_RANKS,
                "lease_generation": 2,
                "supervisor": {"generation": 2},
            },
            None,
        ),
        ({"state": "stopped", "supervisor_alive": False}, None),  # ended: the stop file only blocks a later start
    ],
)
def test_no_rank_running_says_why_and_where_the_run_ends(monkeypatch, status: dict[str, Any], why: str | None):
    full = {"last_checkpoint": {"step": 100}, "progress": {"step": 110}, **status}
    monkeypatch.setattr(cli, "read_status", lambda _layout: full)
    found = cli._no_rank_running(RunLayout("/nowhere"))
    if why is None:
        assert found is None
    else:
        assert found is not None and found[0].startswith(why) and found[1].startswith(ENDS)


def test_without_a_complete_checkpoint_the_run_ends_with_nothing_saved(monkeypatch):
    monkeypatch.setattr(cli, "read_status", lambda _layout: {"state": "backoff", "supervisor_alive": True})
    found = cli._no_rank_running(RunLayout("/nowhere"))
    assert found is not None and found[1].startswith("no checkpoint is complete, so the run ends with nothing saved")


def test_the_supervisors_own_newest_state_wins_over_the_last_checkpoint(monkeypatch):
    """While no rank runs the supervisor publishes where a stop would end the run (a memory snapshot newer than the
    last regular checkpoint included): the command names that step."""
    status = {"state": "backoff", "supervisor_alive": True, "last_checkpoint": {"step": 100}, "newest_state": 105}
    monkeypatch.setattr(cli, "read_status", lambda _layout: status)
    found = cli._no_rank_running(RunLayout("/nowhere"))
    assert found is not None and "newest complete state, step 105;" in found[1]


def test_ranks_their_agents_fenced_are_not_running(monkeypatch, tmp_path):
    """After a supervisor's crash its lease still looks held for a while, and the state file lists its ranks as
    running; an agent that fenced the ranks of that attempt (the journal's agent_fenced) says no rank can save."""
    (tmp_path / "supervisor").mkdir()
    fenced = {"event": "agent_fenced", "node": "twnode2", "attempt": 3, "ranks_killed": [2, 3]}
    (tmp_path / "supervisor" / "events.jsonl").write_text(json.dumps({**fenced, "attempt": 2}) + "\n")
    status = {"state": "running", "supervisor_alive": True, "attempt": 3, "ranks": RUNNING_RANKS}
    status |= {"last_checkpoint": {"step": 100}, "progress": {"step": 110}}
    monkeypatch.setattr(cli, "read_status", lambda _layout: status)
    assert cli._no_rank_running(RunLayout(tmp_path)) is None  # an older attempt's fencing
    with (tmp_path / "supervisor" / "events.jsonl").open("a") as journal:
        journal.write(json.dumps(fenced) + "\n")
    found = cli._no_rank_running(RunLayout(tmp_path))
    assert (
        found is not None
        and found[0].startswith("the agents on twnode2 fenced their ranks")
        and found[1].startswith(ENDS)
    )


def test_with_no_supervisor_alive_the_run_dir_says_the_newest_complete_state_not_the_stale_state_file(
    monkeypatch, tmp_path
):
    """The supervisor died after a save completed but before it wrote its state: the next supervisor will find that
    save, so `stop` names it too (read from the checkpoint directory: complete on every rank), not the state file's."""
    layout = RunLayout(tmp_path)
    for rank in (0, 1):
        for step in (100, 120):
            layout.checkpoints.rank_dir(rank).mkdir(parents=True, exist_ok=True)
            layout.checkpoints.file(rank, step, "demo").write_bytes(b"x")
            if (rank, step) != (1, 120):  # rank 1's record of 120 missing: 120 is not complete
                layout.checkpoints.record(rank, step, "demo").write_text("{}")
        layout.checkpoints.file(rank, 110, "demo").write_bytes(b"x")
        layout.checkpoints.record(rank, 110, "demo").write_text("{}")
    status = {"state": "running", "supervisor_alive": False, "ranks": RUNNING_RANKS, "checkpoint_prefix": "demo"}
    status |= {"last_checkpoint": {"step": 100}, "progress": {"step": 115}}
    monkeypatch.setattr(cli, "read_status", lambda _layout: status)
    found = cli._no_rank_running(layout)
    assert (
        found is not None and "newest complete state, step 110; the steps trained past it, up to step 115" in found[1]
    )
