"""Graceful stops of a real 2-rank run: stop files (seed 004), `trainwarden stop`, SIGTERM and SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from supervisor.observe.status import StatusError
from tests.conftest import wait_until
from tests.e2e.conftest import (
    REPO,
    fake_job,
    finish,
    heartbeat,
    journal,
    run_supervisor,
    start_supervisor,
    trainwarden_status,
    write_config,
)
from worker.contract import EXIT_SAVE_LOST, RunLayout

pytestmark = pytest.mark.timeout(240)


def long_job(tmp_path: Path, steps: int = 2000, **overrides: Any) -> Path:
    """The demo job with far more steps than any test waits for: only a stop ends it early."""
    return write_config(tmp_path / "job.yaml", steps=steps, **overrides)


def wait_for_save(run_dir: Path, rank: int, step: int) -> None:
    """Block until `rank`'s heartbeat says it is inside its save of `step`."""
    wait_until(
        lambda: (hb := heartbeat(run_dir, rank)) and hb["phase"] == "save" and hb["step"] == step,
        timeout=90,
        what=f"rank {rank} saving step {step}",
    )


def wait_for_step(run_dir: Path, step: int) -> int:
    """Block until both ranks have passed `step`; returns the furthest step seen."""

    def reached() -> int | None:
        beats = [heartbeat(run_dir, rank) for rank in (0, 1)]
        steps = [b["step"] for b in beats if b and b["phase"] == "train"]
        return max(steps) if len(steps) == 2 and min(steps) >= step else None

    return int(wait_until(reached, timeout=90, what=f"both ranks past step {step}"))


def events_named(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in journal(run_dir) if e["event"] == name]


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def checkpoint_steps(run_dir: Path, rank: int) -> set[int]:
    folder = run_dir / "checkpoint" / f"rank_{rank}"
    return {int(p.stem.rsplit("-", 1)[1]) for p in folder.glob("demo_rank_*.json")}


def assert_stopped_at(run_dir: Path, done: Any, step: int) -> None:
    """Exit 0, state stopped at `step` with its checkpoint complete on both ranks, and nothing relaunched."""
    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"]) == ("stopped", 0)
    assert status["stopped_at"]["step"] == step
    assert f"at step {step}, checkpoint {step} saved" in status["reason"]
    assert status["last_checkpoint"] == {"step": step}
    for rank in (0, 1):
        assert step in checkpoint_steps(run_dir, rank)
        assert [e["step"] for e in rank_events(run_dir, rank, "stop_order_done")][-1] == step


def test_stop_orders_in_turn_garbage_a_continue_one_a_step_already_passed_and_an_empty_file(tmp_path: Path) -> None:
    """One run, four writes of its stop file: `12abc` is a warning naming the file and changes nothing; `-N` saves
    at N on both ranks and training goes on (the file does not retrigger); `trainwarden stop --at-step 5
    --continue`, past already, is warned about and saves at the next agreed step instead, going on; an empty file
    saves at the next agreed step and ends the run: exit 0, stopped, no relaunch."""
    run_dir = tmp_path / "run"
    # Steps of 30 ms or more: the 73 steps of lead the continue order gets are time enough for it to reach them.
    proc = start_supervisor(long_job(tmp_path, env={"TRAINWARDEN_FAULTS": "0:slow@1:0.03,1:slow@1:0.03"}), run_dir)
    at = wait_for_step(run_dir, 10)
    stop_file = run_dir / "stop"
    stop_file.write_text("12abc\n")
    warned = wait_until(lambda: events_named(run_dir, "stop_file_unparsable"), timeout=30, what="the warning")
    assert warned[0]["path"] == str(stop_file) and "'12abc'" in warned[0]["error"]

    keep_going = at + 73
    stop_file.write_text(f"-{keep_going}\n")
    past = wait_for_step(run_dir, keep_going + 5)
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(run_dir), "--at-step", "5", "--continue"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert f"wrote -5 to {stop_file}" in out.stdout
    assert "the stop file stays: while it is there, a new start of this run dir" in out.stdout
    assert f"once that checkpoint is saved, remove it (rm {stop_file})" in out.stdout
    (early,) = wait_until(lambda: events_named(run_dir, "stop_step_too_early"), timeout=30, what="the warning")
    assert early["requested"] == 5 and early["step"] > past
    wait_for_step(run_dir, early["step"] + 1)
    stop_file.unlink()
    stop_file.touch()
    done = finish(proc, run_dir)

    ordered = [(e["step"], e["exit"]) for e in events_named(run_dir, "stop_ordered")]
    assert ordered[:2] == [(keep_going, False), (early["step"], False)] and len(ordered) == 3
    final = ordered[2][0]
    assert ordered[2] == (final, True) and final > early["step"]
    assert_stopped_at(run_dir, done, final)
    assert [e["step"] for e in events_named(run_dir, "stop_order_done")] == [keep_going, early["step"]]
    for rank in (0, 1):
        assert {keep_going, early["step"]} <= checkpoint_steps(run_dir, rank)  # not multiples of the save interval
        assert [(e["step"], e["exit"]) for e in rank_events(run_dir, rank, "stop_order_done")] == [
            (keep_going, False),
            (early["step"], False),
            (final, True),
        ]


def test_a_stop_file_present_at_start_refuses_to_launch_unless_told_to_ignore_it(tmp_path: Path) -> None:
    """An automatic restart must not undo a stop: exit 0 naming the file, nothing launched; with
    --ignore-stop-file the run starts and the old content is not acted on (ranks that beat, without torch)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stop").write_text("\n")
    config = fake_job(tmp_path, env={"STEPS": "40"})
    refused = run_supervisor(config, run_dir, timeout=60)

    assert refused.returncode == 0, refused.stderr[-3000:]
    assert str(run_dir / "stop") in refused.stderr
    assert refused.status()["state"] == "stopped"
    assert not (run_dir / "logs").exists()

    done = finish(start_supervisor(config, run_dir, "--ignore-stop-file"), run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.status()["state"] == "finished"
    assert events_named(run_dir, "stop_ordered") == []


def test_sigterm_during_a_checkpoint_save_stops_gracefully_at_one_agreed_step(tmp_path: Path) -> None:
    """`systemctl stop` or `kill` while rank 0 is 0.5 s into a 3 s save of step 20: both ranks finish that save,
    save again at one agreed step, exit 0, nobody killed. (Runs resumed from a stop: test_warm_standby.py and
    test_gpt_example.py.)"""
    run_dir = tmp_path / "run"
    config = long_job(tmp_path, env={"TRAINWARDEN_FAULTS": "0:slow_save@20:3", "OMP_NUM_THREADS": "1"})
    proc = start_supervisor(config, run_dir)
    wait_for_save(run_dir, 0, 20)
    proc.send_signal(signal.SIGTERM)
    done = finish(proc, run_dir)

    (ordered,) = events_named(run_dir, "stop_ordered")
    assert ordered["source"] == "SIGTERM" and ordered["step"] > 20
    assert_stopped_at(run_dir, done, ordered["step"])
    assert {20, ordered["step"]} <= checkpoint_steps(run_dir, 0)
    assert [e["signal"] for e in events_named(run_dir, "ranks_signalled")] == []  # nobody was killed


def test_a_second_sigint_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C asks for a graceful stop; a second Ctrl-C kills the ranks without waiting for the agreed step."""
    run_dir = tmp_path / "run"
    # Steps of 0.3 s from step 11 on: the second Ctrl-C lands well before the agreed step (at full speed on a loaded
    # machine the ranks could reach it, and begin its save, between the two).
    slow = {"TRAINWARDEN_FAULTS": "0:slow@11:0.3", "OMP_NUM_THREADS": "1"}
    proc = start_supervisor(long_job(tmp_path, worker={"save_checkpoint_steps": 0}, env=slow), run_dir)
    wait_for_step(run_dir, 10)
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: events_named(run_dir, "stop_ordered"), timeout=30, what="the stop order")
    proc.send_signal(signal.SIGINT)
    done = finish(proc, run_dir, timeout=60)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.status()["state"] == "stopped"
    assert [e["signal"] for e in events_named(run_dir, "ranks_signalled")] == ["SIGTERM", "SIGKILL"]
    assert rank_events(run_dir, 0, "stop_order_done") == []


def test_a_second_sigint_during_a_save_waits_for_it_and_a_third_abandons_it_saying_so(tmp_path: Path) -> None:
    """Ctrl-C twice while rank 0 is in a 60 s save: SIGTERM only and one `save_in_flight` warning; a third Ctrl-C
    SIGKILLs, and the run ends stopped with EXIT_SAVE_LOST and a reason naming the lost save, never exit 0."""
    run_dir = tmp_path / "run"
    config = long_job(tmp_path, env={"TRAINWARDEN_FAULTS": "0:slow_save@20:60", "OMP_NUM_THREADS": "1"})
    proc = start_supervisor(config, run_dir)
    wait_for_save(run_dir, 0, 20)
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: events_named(run_dir, "stop_ordered"), timeout=30, what="the stop order")
    state_file = run_dir / "supervisor" / "state.json"  # replaced atomically: always whole
    wait_until(  # rank 1's own save of 20 is quick but may be in flight still: the warning is about rank 0's;
        # and the file may be one written during the saves of step 10
        lambda: (
            [(r["heartbeat_phase"], r["step"]) for r in json.loads(state_file.read_text())["ranks"]]
            == [("save", 20), ("train", 20)]
        ),
        timeout=30,
        what="the supervisor seeing rank 0 in its save, rank 1 past its own",
    )
    proc.send_signal(signal.SIGINT)
    (warned,) = wait_until(lambda: events_named(run_dir, "save_in_flight"), timeout=30, what="the warning")
    assert (warned["ranks"], warned["message"]) == ([0], "saving, press Ctrl-C again to abandon the save")
    assert [e["signal"] for e in events_named(run_dir, "ranks_signalled")] == ["SIGTERM"]
    proc.send_signal(signal.SIGINT)
    done = finish(proc, run_dir, timeout=60)

    assert done.returncode == EXIT_SAVE_LOST, done.stderr[-3000:]
    status = done.status()
    assert status["state"] == "stopped" and "rank 0 (step 20) went down inside it" in status["reason"]
    assert [e["signal"] for e in events_named(run_dir, "ranks_signalled")] == ["SIGTERM", "SIGKILL"]
    assert 20 not in checkpoint_steps(run_dir, 0)


def plant_checkpoint(run_dir: Path, step: int, ranks: int = 2, prefix: str = "demo") -> None:
    """A checkpoint of `step` complete on every rank (a file and its completion record), as an earlier run left it."""
    layout = RunLayout(run_dir)
    for rank in range(ranks):
        data = b"weights"
        path = layout.checkpoints.file(rank, step, prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record = {"step": step, "file": path.name, "size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        layout.checkpoints.record(rank, step, prefix).write_text(json.dumps(record))


def test_a_stop_while_no_rank_runs_says_so_and_ends_the_run_at_its_newest_complete_state(tmp_path: Path) -> None:
    """Between attempts (a 60 s backoff after two crashes past checkpoint 10), `trainwarden stop` says that no rank
    is running and that the run ends at its newest complete state, naming step 10; the supervisor ends the run
    stopped there at once (exit 0), and goodput counts the steps trained past it as lost work, not `lost 0s`."""
    run_dir = tmp_path / "run"
    plant_checkpoint(run_dir, 10)
    config = fake_job(
        tmp_path,
        env={"STEPS": "20", "EXIT": "1"},
        restart={"max_restarts": 3, "backoff_initial_s": 60.0},
        worker={"prefix": "demo"},
    )
    proc = start_supervisor(config, run_dir)

    def in_backoff() -> bool:
        try:
            status = trainwarden_status(run_dir)
        except StatusError:  # not written yet
            return False
        return status["state"] == "backoff" and status["last_checkpoint"] == {"step": 10}

    try:
        wait_until(in_backoff, timeout=60, what="the backoff, checkpoint 10 seen")
        out = subprocess.run(
            [sys.executable, "-m", "supervisor", "stop", str(run_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    finally:
        done = finish(proc, run_dir, timeout=60)
    assert "no rank is running (the run is between attempts: backoff), so none can save now" in out.stdout
    assert "the run ends stopped at its newest complete state, step 10; the steps trained past it" in out.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    status = done.status()
    assert (status["state"], status["restarts"], status["stopped_at"]["step"]) == ("stopped", 1, 10)
    assert "with no rank running: the run ends at its newest complete state, step 10" in status["reason"]
    (stopped,) = events_named(run_dir, "run_stopped")
    assert (stopped["step"], stopped["ranks"]) == (10, "none")
    (lost,) = [e for e in events_named(run_dir, "work_lost") if "stopped_at" in e]
    assert lost["stopped_at"] == 10 and lost["last_step"] > 10 and lost["lost_s"] > 0
    assert events_named(run_dir, "goodput")[-1]["lost_s"] >= lost["lost_s"]
