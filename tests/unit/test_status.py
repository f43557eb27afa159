"""The run's state file: snapshot of the core state, atomic write and read back, human summary."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

import pytest

from supervisor.core import (
    ChildExited,
    HeartbeatSeen,
    Phase,
    Policy,
    RanksLaunched,
    State,
    TimeLimitRead,
    decide,
    initial_state,
)
from supervisor.core.causes import Cause, CauseKind
from supervisor.observe.console import status_line
from supervisor.observe.plot import read_timeline
from supervisor.observe.status import (
    FAILURES_SHOWN,
    MAX_STATE_BYTES,
    StatusError,
    read_history,
    read_status,
    render,
    shown_state,
    snapshot,
    write_status,
)
from worker.contract import RunLayout

NOW = 1000.0
POLICY = Policy(
    nproc=2, max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=5.0, kill_grace_s=10.0
)
SOLO = replace(POLICY, nproc=1)


def running(resume_step: int | None = None) -> State:
    state, _ = decide(initial_state(POLICY), RanksLaunched(0, (100, 101), resume_step), NOW)
    return state


def test_snapshot_of_running_state_with_heartbeat():
    """A snapshot carries phase, counters and, per rank, pid, step, heartbeat age and phase; heartbeats are on."""
    state, _ = decide(running(resume_step=25), HeartbeatSeen(0, 1, seq=4, step=30, phase="train"), NOW + 1)
    before = time.time()
    status = snapshot(state, now=NOW + 3.5, extra={"run_dir": "runs/x"})
    assert before <= status.pop("updated_at") <= time.time()
    assert status == {
        "state": "running",
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 3,
        "ranks": [
            {"rank": 0, "pid": 100, "step": None, "heartbeat_age_s": None, "heartbeat_phase": None, "returncode": None},
            {"rank": 1, "pid": 101, "step": 30, "heartbeat_age_s": 2.5, "heartbeat_phase": "train", "returncode": None},
        ],
        "heartbeats": "on",
        "heartbeat_mode": "auto",
        "resumed_from": {"step": 25},
        "passed_over": [],
        "recovery": None,
        "hang": None,
        "rollback": None,
        "stop_order": None,
        "stopped_at": None,
        "calibration": {"enabled": False, "train_timeout_s": 300.0, "samples": 0, "step_gaps": []},
        "last_failure": None,
        "cause": None,
        "failures": [],
        "history": {"attempt": 0, "restarts": 0, "failures": []},
        "reason": None,
        "exit_code": None,
        "time_limit": None,
        "run_dir": "runs/x",
    }


def test_snapshot_without_heartbeats_says_off():
    """With no heartbeat from any rank, the snapshot says heartbeats are off and nothing was resumed."""
    status = snapshot(running(), now=NOW, extra={})
    assert status["heartbeats"] == "off"
    assert status["resumed_from"] is None
    assert [r["heartbeat_age_s"] for r in status["ranks"]] == [None, None]


def test_snapshot_after_crash_carries_failure_and_returncode():
    """After a crash the snapshot shows the stopping phase, the failure and the rank's exit code."""
    state, _ = decide(running(), ChildExited(0, 1, -9), NOW)
    status = snapshot(state, now=NOW, extra={})
    assert status["state"] == "stopping"
    assert status["last_failure"] == "rank 1 killed by SIGKILL in attempt 0"
    assert [r["returncode"] for r in status["ranks"]] == [None, -9]


def test_write_then_read_status_round_trips(tmp_path):
    """A written status reads back unchanged, marked not alive when it names no supervisor pid."""
    layout = RunLayout(tmp_path)
    status = snapshot(running(), now=NOW, extra={"run_dir": str(tmp_path), "supervisor_pid": None})
    write_status(layout, status, durable=False)
    assert os.listdir(layout.state_file.parent) == ["state.json"]
    read = read_status(layout)
    assert read.pop("supervisor")["alive"] is False
    assert 0 <= read.pop("written_s_ago") < 5  # how old the file is, as read
    assert read == {**status, "supervisor_alive": False}


def test_read_status_of_live_supervisor_ages_heartbeats(tmp_path):
    """With the supervisor alive, heartbeat ages grow by the time since the status was written."""
    layout = RunLayout(tmp_path)
    state, _ = decide(running(), HeartbeatSeen(0, 0, seq=1, step=5, phase="train"), NOW)
    status = snapshot(state, now=NOW + 1.0, extra={"supervisor_pid": os.getpid()})
    status["updated_at"] = time.time() - 10.0
    write_status(layout, status, durable=True)
    read = read_status(layout)
    assert read["supervisor_alive"] is True
    assert read["ranks"][0]["heartbeat_age_s"] == pytest.approx(11.0, abs=1.0)
    assert read["ranks"][1]["heartbeat_age_s"] is None


def test_read_status_missing_dir_raises(tmp_path):
    """Reading a directory that holds no run raises StatusError naming the missing state file."""
    layout = RunLayout(tmp_path / "nowhere")
    with pytest.raises(StatusError) as info:
        read_status(layout)
    assert str(info.value) == f"{layout.root}: no trainwarden run here (missing {layout.state_file})"


@pytest.mark.parametrize("content", [b"", b'{"state": "runn', b"\xff\xfe garbage"])
def test_read_status_garbage_file_raises(tmp_path, content):
    """An empty, truncated or binary state file raises StatusError saying it is unreadable."""
    layout = RunLayout(tmp_path)
    layout.state_file.parent.mkdir(parents=True)
    layout.state_file.write_bytes(content)
    with pytest.raises(StatusError) as info:
        read_status(layout)
    assert str(info.value).startswith(f"{layout.state_file}: unreadable: ")


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"running"'])
def test_read_status_non_object_json_raises(tmp_path, content):
    """A state file holding valid JSON that is not an object raises StatusError."""
    layout = RunLayout(tmp_path)
    layout.state_file.parent.mkdir(parents=True)
    layout.state_file.write_text(content)
    with pytest.raises(StatusError):
        read_status(layout)


def test_render_says_heartbeats_off():
    """With no heartbeat seen, the summary says hang detection is off and each rank has no heartbeat."""
    status = {
        **snapshot(running(), now=NOW, extra={"run_dir": "runs/x", "last_checkpoint": None}),
        "supervisor_alive": True,
    }
    text = render(status)
    assert text.splitlines() == [
        "run runs/x: running, attempt 0, restarts 0/3",
        "  last checkpoint: none",
        "  heartbeats: none seen (script does not use the worker library?): hang detection is off",
        "  rank 0: pid 100, step None, no heartbeat",
        "  rank 1: pid 101, step None, no heartbeat",
    ]


def test_render_with_heartbeats_and_failure():
    """With heartbeats, a checkpoint and a failure, the summary shows them and no heartbeats-off line."""
    state, _ = decide(running(resume_step=25), HeartbeatSeen(0, 0, seq=2, step=40, phase="train"), NOW)
    state, _ = decide(state, ChildExited(0, 1, 3), NOW)
    status = {
        **snapshot(state, now=NOW + 1.5, extra={"run_dir": "runs/x", "last_checkpoint": {"step": 25}}),
        "supervisor_alive": True,
    }
    assert render(status).splitlines() == [
        "run runs/x: stopping, attempt 0, restarts 0/3",
        "  last checkpoint: step 25; resumed from step 25",
        "  rank 0: pid 100, step 40, heartbeat 1.5 s ago (train)",
        "  rank 1: pid 101, step None, no heartbeat, exit 3",
        "  last failure: rank 1 exited with code 3 in attempt 0",
        "  cause: exited with code 3",
    ]


def test_render_says_which_ranks_resumed_inexactly_and_why():
    """A line for each reason, with the ranks that gave it; a tampered list shows nothing."""
    base = {**snapshot(running(), now=NOW, extra={"run_dir": "runs/x", "last_checkpoint": {"step": 25}})}
    said = [{"reason": "numpy RNG state not restored: no numpy", "ranks": [0, 1]}, {"reason": "differs", "ranks": [1]}]
    lines = render({**base, "resume_inexact": said}).splitlines()
    assert "  resume not exact (ranks 0, 1): numpy RNG state not restored: no numpy" in lines
    assert "  resume not exact (rank 1): differs" in lines
    for tampered in ([], ["x"], "rank 0", None, [{"reason": "\x1b[2J", "ranks": [0]}], [{"reason": 3}]):
        assert "resume not exact" not in render({**base, "resume_inexact": tampered})


def test_render_shows_the_re_run_verdicts_and_the_ledger_s_verdicts_on_devices():
    """The count of each verdict the ranks saw, then each verdict on a device the ledger holds; a tampered entry
    (a reason with control characters, no time) is left out."""
    base = {**snapshot(running(), now=NOW, extra={"run_dir": "runs/x", "last_checkpoint": None})}
    anomalies = {"spike": 2, "sdc_data": 1, "sdc_transient": 2}
    reason = "persistent silent data corruption on rank 1 (GPU 0 of node7) at step 60 (batch 59): came back"
    devices = [
        {"node": "node7", "verdict": "persistent", "reason": reason, "at": 0.0},
        {"node": "node8", "verdict": "transient", "reason": "\x1b[2J", "at": 0.0},
        {"node": "node9", "verdict": "transient", "reason": "ok", "at": None},
    ]
    lines = render({**base, "anomalies": anomalies, "device_verdicts": devices}).splitlines()
    assert "  re-run verdicts: 1 data, 2 transient" in lines
    (shown,) = [line for line in lines if " on node" in line]
    assert shown.startswith("  device verdict on node7 at ") and shown.endswith(f": {reason}")
    assert "verdict" not in render(base)


def test_render_names_the_slowest_rank_whose_saves_wait_for_the_previous_write_and_what_to_set():
    """The slowest rank's write, the training between saves and its setting, with how many ranks said so; a
    tampered block shows nothing."""
    base = {**snapshot(running(), now=NOW, extra={"run_dir": "runs/x", "last_checkpoint": {"step": 25}})}
    slowest = {"rank": 1, "write_s": 3.21, "interval_s": 0.4, "setting": "worker.save_checkpoint_steps: 41 or more"}
    lines = render({**base, "save_slower_than_interval": {"ranks": 2, "slowest": [slowest]}}).splitlines()
    assert (
        "  saves wait for the previous write (2 ranks): rank 1's took 3.21 s, with 0.4 s of training between saves; "
        "set worker.save_checkpoint_steps: 41 or more"
    ) in lines
    for tampered in (None, [], {"ranks": 1}, {"slowest": [{**slowest, "setting": "\x1b[2J"}]}, {"slowest": ["x"]}):
        assert "saves wait" not in render({**base, "save_slower_than_interval": tampered})


def crash_looping() -> State:
    """Two attempts of a 1-rank run that raised ValueError at step 40 after resuming from 25; the second is failing."""
    boom = Cause(CauseKind.EXCEPTION, "ValueError: boom (train.py:12 in step)", "ValueError (train.py:12 in step)")
    state, _ = decide(initial_state(SOLO), RanksLaunched(0, (100,), 25), NOW)
    state, _ = decide(state, ChildExited(0, 0, 1, cause=boom, step=40), NOW + 1)
    state, _ = decide(state, RanksLaunched(1, (200,), 25), NOW + 2)
    state, _ = decide(state, ChildExited(1, 0, 1, cause=boom, step=40), NOW + 3)
    return state


def test_snapshot_carries_the_cause_and_the_failure_history():
    """The snapshot has the newest cause in one line and each failed attempt: rank, step, resume step, cause."""
    status = snapshot(crash_looping(), now=NOW + 4, extra={})
    assert status["cause"] == "ValueError: boom (train.py:12 in step)"
    assert status["failures"] == [
        {
            "attempt": a,
            "rank": 0,
            "step": 40,
            "resume_step": 25,
            "progressed": True,
            "kind": "exception",
            "cause": "ValueError: boom (train.py:12 in step)",
        }
        for a in (0, 1)
    ]


def test_snapshot_shows_only_the_newest_failures():
    """Of a long failure history, the status shows the newest FAILURES_SHOWN."""
    state = crash_looping()
    many = tuple(replace(state.failures[0], attempt=a) for a in range(FAILURES_SHOWN + 3))
    status = snapshot(replace(state, failures=many), now=NOW, extra={})
    assert [f["attempt"] for f in status["failures"]] == list(range(3, FAILURES_SHOWN + 3))


def test_render_lists_failed_attempts_after_the_cause():
    """With more than one failed attempt, the summary lists each one's rank, step and cause under the cause."""
    status = {
        **snapshot(crash_looping(), now=NOW + 4, extra={"run_dir": "runs/x", "last_checkpoint": None}),
        "supervisor_alive": True,
    }
    assert render(status).splitlines()[-6:] == [
        "  last failure: rank 0 exited with code 1 in attempt 1",
        "  cause: ValueError: boom (train.py:12 in step)",
        "  failed attempts:",
        "    attempt 0: rank 0 at step 40 (resumed from 25): ValueError: boom (train.py:12 in step)",
        "    attempt 1: rank 0 at step 40 (resumed from 25): ValueError: boom (train.py:12 in step)",
        "  recovered: every rank relaunched: restart.in_place is false",  # how attempt 1 followed attempt 0
    ]


def test_render_of_an_older_state_file_without_causes():
    """A state file written before causes existed (no `cause`, no `failures`) still renders."""
    status = {**snapshot(running(), now=NOW, extra={}), "supervisor_alive": True}
    del status["cause"], status["failures"]
    assert "cause" not in render(status)


def test_render_flags_stale_state_of_dead_supervisor():
    """A non-terminal status whose supervisor is gone is flagged as stale."""
    status = {**snapshot(running(), now=NOW, extra={"supervisor_pid": 4242}), "supervisor_alive": False}
    assert "  supervisor (pid 4242) is gone; this state is stale" in render(status).splitlines()


def test_render_terminal_state_not_flagged_stale():
    """A finished run's status is not called stale, and its reason is shown."""
    status = {
        **snapshot(running(), now=NOW, extra={"supervisor_pid": 4242}),
        "supervisor_alive": False,
        "state": "failed",
        "reason": "restarts exhausted",
    }
    lines = render(status).splitlines()
    assert not any("stale" in line for line in lines)
    assert lines[-1] == "  reason: restarts exhausted"


def test_status_file_is_json(tmp_path):
    """The state file on disk is plain JSON that other tools can read."""
    layout = RunLayout(tmp_path)
    write_status(layout, {"state": "running", "attempt": 0}, durable=False)
    assert json.loads(layout.state_file.read_text()) == {"state": "running", "attempt": 0}


def _leased(tmp_path, host: str, *, age_s: float, state: str = "held", pid: int = 4242) -> RunLayout:
    from supervisor.rundir.lease import Lease, claim

    layout = RunLayout(tmp_path)
    write_status(layout, snapshot(running(), now=NOW, extra={"supervisor_pid": pid}), durable=False)
    claim(layout, Lease(1, host, pid, time.time() - age_s, 10.0, state))
    return layout


def test_a_supervisor_on_another_host_is_alive_while_its_lease_is_fresh_whatever_its_pid_means_here(tmp_path):
    """Seen from another host a pid means nothing: the lease's age decides, and status says where it runs."""
    status = read_status(_leased(tmp_path, "twnode2", age_s=0.5, pid=os.getpid() + 10**6))
    assert status["supervisor_alive"] is True
    assert (status["supervisor"]["host"], status["supervisor"]["pid"]) == ("twnode2", os.getpid() + 10**6)


def test_a_supervisor_on_another_host_silent_past_its_lease_is_gone_however_alive_a_pid_here(tmp_path):
    """The batch host died: its lease is 43 s old; a live process here with the same pid changes nothing."""
    status = read_status(_leased(tmp_path, "twnode1", age_s=43, pid=os.getpid()))
    assert status["supervisor_alive"] is False
    gone = f"  supervisor (pid {os.getpid()} on twnode1) is gone, last heard 43 s ago; this state is stale"
    assert gone in render(status).splitlines()


def test_a_supervisor_that_abdicated_is_said_to_have_handed_over(tmp_path):
    """Cut off, it gave up its lease: status says no successor has taken the run yet."""
    status = read_status(_leased(tmp_path, "twnode1", age_s=1, state="abdicated"))
    assert not status["supervisor_alive"] and "lost its link and handed over" in render(status)


def test_render_says_when_a_multi_node_run_goes_on_shrunk():
    """slurm.min_nodes: an attempt on fewer nodes than configured is one line under the job's."""
    extra = {
        "run_dir": "runs/x",
        "last_checkpoint": None,
        "slurm_job": "42",
        "world_size": 2,
        "full_world_size": 4,
        "nodes": [{"node": "n1", "group_rank": 0, "state": "running", "ranks": [0, 1]}],
    }
    lines = render({**snapshot(running(), now=NOW, extra=extra), "supervisor_alive": True}).splitlines()
    assert lines[lines.index("  slurm job 42") + 1] == (
        "  shrunk: 2 of 4 ranks (slurm.min_nodes; a job with every node grows back)"
    )
    extra.update(world_size=4)
    assert "shrunk" not in render({**snapshot(running(), now=NOW, extra=extra), "supervisor_alive": True})


def test_status_shows_the_jobs_end_time_and_when_the_run_ends_for_it():
    """The end time the supervisor read from Slurm (a successor's too) is in `status` under the job's line, with
    the margin; once the run is ending for it, status says so; junk in the file shows no line."""
    extra = {"run_dir": "runs/x", "last_checkpoint": None, "slurm_job": "42", "nodes": []}
    limit = TimeLimitRead(NOW + 3600, 300.0, "2026-11-28T14:00:00+0000")
    state = replace(running(), time_limit=limit)
    status = {**snapshot(state, now=NOW, extra=extra), "supervisor_alive": True}
    assert status["time_limit"] == {"end_time": "2026-11-28T14:00:00+0000", "margin_s": 300.0, "ending": False}
    lines = render(json.loads(json.dumps(status))).splitlines()
    assert lines[lines.index("  slurm job 42") + 1] == (
        "  time limit: the job ends 2026-11-28T14:00:00+0000; the run saves and exits 75 300 s before"
    )
    ending = {**snapshot(replace(state, time_limit_near=True), now=NOW, extra=extra), "supervisor_alive": True}
    assert "the run is saving to exit 75 (resubmit) 300 s before" in render(ending)
    assert snapshot(replace(state, time_limit=TimeLimitRead(None, 300.0)), now=NOW, extra=extra)["time_limit"] is None
    assert "time limit" not in render({**status, "time_limit": {"end_time": 5, "margin_s": "x"}})


def test_history_of_a_supervisor_that_died_mid_run_round_trips_through_the_state_file():
    """The attempt, restarts and failures (causes with their keys) a snapshot writes are read back whole, through
    JSON; the next supervisor's first attempt is the one after the newest."""
    state = running()
    for attempt in range(3):
        state = replace(state, attempt=attempt, restarts=attempt, phase=Phase.RUNNING, ranks=state.ranks)
        state, _ = decide(
            state,
            ChildExited(
                attempt, 1, 1, cause=Cause(CauseKind.EXCEPTION, f"boom in /tmp/x{attempt}", "boom in TMP"), step=7
            ),
            NOW,
        )
    status = json.loads(json.dumps(snapshot(state, now=NOW, extra={})))
    history = read_history(status)
    assert history is not None and history.attempt == 2 and history.restarts == 2
    assert history.failures == state.failures
    carried = initial_state(POLICY, history=history)
    assert (carried.attempt, carried.restarts, carried.failures) == (3, 2, state.failures)


@pytest.mark.parametrize(
    "garbage",
    [
        {"state": "failed", "history": {"attempt": 2, "restarts": 2, "failures": []}},  # an ended run starts afresh
        {"state": "running"},
        {"state": "running", "history": []},
        {"state": "running", "history": {"attempt": -1, "restarts": 0, "failures": []}},
        {"state": "running", "history": {"attempt": 1, "restarts": True, "failures": []}},
        {"state": "running", "history": {"attempt": 1, "restarts": 0, "failures": [{"attempt": 0}]}},
        {
            "state": "running",
            "history": {
                "attempt": 1,
                "restarts": 0,
                "failures": [
                    {
                        "attempt": 0,
                        "rank": 0,
                        "step": None,
                        "resume_step": None,
                        "progressed": None,
                        "kind": "nonsense",
                        "cause": "x",
                    }
                ],
            },
        },
        {
            "state": "running",
            "history": {
                "attempt": 1,
                "restarts": 0,
                "failures": [
                    {
                        "attempt": 0,
                        "rank": 0,
                        "step": None,
                        "resume_step": None,
                        "progressed": None,
                        "kind": "exit",
                        "cause": "x" * 100000,
                    }
                ],
            },
        },
    ],
)
def test_history_that_is_not_sane_or_of_an_ended_run_is_not_carried(garbage):
    """Garbage (or a tampered file) loses the history, never the run; an ended run's history is not carried."""
    assert read_history(garbage) is None


@pytest.mark.parametrize("state", [["failed"], {"failed": 1}])
def test_history_under_a_state_of_any_json_type_is_read_not_raised(state):
    """A tampered state, even unhashable JSON, is no ended run: the history is judged as under any other state."""
    history = read_history({"state": state, "history": {"attempt": 1, "restarts": 0, "failures": []}})
    assert history is not None and (history.attempt, history.restarts, history.failures) == (1, 0, ())


def thousand_node_status() -> dict[str, Any]:
    """A state file's content for 1,024 nodes x 8 ranks: rank 4000 quiet, rank 17 failed, node n0002 lost."""
    ranks = [
        {
            "rank": r,
            "pid": 1000 + r,
            "step": 500 + r % 3,
            "heartbeat_age_s": 0.5,
            "heartbeat_phase": "train",
            "returncode": None,
        }
        for r in range(8192)
    ]
    ranks[4000] = {**ranks[4000], "heartbeat_age_s": 9.5, "step": 480}
    ranks[17] = {**ranks[17], "returncode": -9}
    nodes = [
        {"node": f"n{i:04d}", "state": "running", "ranks": list(range(8 * i, 8 * i + 8)), "heartbeat_age_s": 0.4}
        for i in range(1024)
    ]
    nodes[2] = {**nodes[2], "state": "lost"}
    nodes += [{"node": "spare1", "state": "spare"}, {"node": "bad", "state": "excluded", "why": "failed 3 times"}]
    return {
        "state": "running",
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 3,
        "run_dir": "runs/big",
        "supervisor_alive": True,
        "ranks": ranks,
        "nodes": nodes,
        "slurm_job": "7",
        "rank_compute_s": {str(r): 0.1 for r in range(8192)} | {"123": 0.9},
    }


def test_status_of_a_thousand_node_run_is_a_summary_naming_what_is_worth_a_look():
    """1,024 nodes x 8 ranks: one line for the ranks (counts, steps, heartbeat ages), the quietest and failed
    ranks, the most compute, one line for the nodes by state and the nodes not running; not 9,000 lines."""
    status = thousand_node_status()
    lines = render(status).splitlines()
    assert len(lines) < 30, lines
    assert "  ranks: 8192, 8191 running, 1 failed; steps 480-502; heartbeat ages: median 0.5 s, oldest 9.5 s" in lines
    assert lines.index("  rank 17: pid 1017, step 502, heartbeat 0.5 s ago (train), exit -9") < lines.index(
        "  rank 4000: pid 5000, step 480, heartbeat 9.5 s ago (train)"
    )
    assert any(line.startswith("  most compute per step: rank 123 0.9 s") for line in lines)
    assert "  nodes: 1 excluded, 1 lost, 1023 running, 1 spare" in lines
    assert "  node n0002: lost, ranks 16-23, agent heard 0.4 s ago" in lines
    assert "  node bad: excluded (failed 3 times)" in lines


def test_each_running_node_says_how_much_its_memory_tier_holds():
    status = thousand_node_status()
    status["nodes"] = [
        {**status["nodes"][0], "memory_bytes": 5_600_000},
        {**status["nodes"][1], "memory_bytes": 0},
    ]
    lines = render(status).splitlines()
    assert "  node n0000: running, ranks 0-7, agent heard 0.4 s ago, 5.6 MB of snapshots in memory" in lines
    assert "  node n0001: running, ranks 8-15, agent heard 0.4 s ago" in lines


def test_the_state_file_of_a_thousand_node_run_is_read_back_whole(tmp_path):
    """Its state file is over the 1 MiB other JSON files are held to (a record per rank and node): `status`, a
    restarted supervisor (its failure history) and the plot read it whole, and `status` says how old it is (it is
    rewritten every few seconds at this size); a file past MAX_STATE_BYTES is refused."""
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    failure = {"attempt": 0, "rank": 17, "step": 502, "resume_step": None, "progressed": True, "kind": "signal"}
    failure |= {"cause": "rank 17 killed by SIGKILL", "key": "signal:9", "node": "n0002"}
    status = {**thousand_node_status(), "history": {"attempt": 1, "restarts": 1, "failures": [failure]}}
    write_status(layout, status, durable=False)
    assert layout.state_file.stat().st_size > 1 << 20

    read = read_status(layout)
    assert len(read["ranks"]) == 8192 and len(read["nodes"]) == 1026
    history = read_history(read)
    assert history is not None and (history.attempt, history.restarts, len(history.failures)) == (1, 1, 1)
    assert read_timeline(layout).state == "running"  # the plot's title says how the run stands

    write_status(layout, {**status, "supervisor_pid": os.getpid(), "updated_at": time.time() - 7}, durable=False)
    (supervisor,) = [line for line in render(read_status(layout)).splitlines() if "supervisor:" in line]
    assert supervisor.endswith("; this status is 7 s old")  # rewritten every few seconds at this size

    with layout.state_file.open("ab") as file:
        file.truncate(MAX_STATE_BYTES + 1)
    with pytest.raises(StatusError, match="larger than"):
        read_status(layout)


@pytest.mark.parametrize(
    ("state", "code", "shown"),
    [
        ("failed", 75, "interrupted (resubmit)"),  # too few healthy nodes
        ("stopped", 75, "interrupted (resubmit)"),  # the time limit, the save done
        ("failed", 1, "failed"),
        ("stopped", 0, "stopped"),
        ("running", None, "running"),
        ("failed", "75", "failed"),  # a tampered file: no number, no reading
    ],
)
def test_an_end_with_exit_75_reads_interrupted_resubmit_not_failed(state: str, code: Any, shown: str):
    assert shown_state(state, code) == shown
    status = {**snapshot(running(), now=NOW, extra={}), "state": state, "exit_code": code, "supervisor_alive": False}
    assert render(status).splitlines()[0].startswith(f"run None: {shown}, attempt 0,")
    assert status_line(status).startswith(f"{shown} | ")
