"""A real supervisor whose run dir is full of hostile files keeps supervising, or refuses cleanly, and loses nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import REPO, journal, run_supervisor, start_supervisor
from worker.contract import RunLayout

pytestmark = pytest.mark.timeout(120)

# Beats like the worker library (without torch). Rank 0 of attempt 0 plants each hostile heartbeat in turn
# where its own heartbeat goes, long enough for the supervisor's once-a-second look to meet it; rank 1 of
# attempt 0 with ABORT logs an anomaly_abort whose numbers are strings and exits 65.
HOSTILE_RANK = """
import json, os, sys, time
from pathlib import Path
from worker.contract import RunLayout
from worker.heartbeat import Heartbeat
rank, attempt = int(os.environ["RANK"]), int(os.environ["TRAINWARDEN_ATTEMPT"])
layout = RunLayout(Path(os.environ["TRAINWARDEN_RUN_DIR"]))
path = layout.heartbeat(rank)
beat = Heartbeat(path, root=layout.root, rank=rank, attempt=attempt, interval_s=0.1)
beat.beat(0, "train", force=True)
if attempt == 0 and rank == 1 and os.environ.get("ABORT"):
    line = {"event": "anomaly_abort", "attempt": 0, "step": "abc", "batch": None, "first_anomaly_step": 1e308,
            "first_anomaly_batch": [], "suspect_ranks": []}
    with open(layout.rank_events(rank), "a") as log:
        log.write(json.dumps(line) + "\\n")
    sys.exit(65)
if attempt == 0 and rank == 0 and os.environ.get("PLANT"):
    forged = {"rank": 1, "attempt": 0, "seq": 10**6, "step": 10**6, "phase": "train", "pid": 1}
    def put(text):  # whole at once, as an atomic writer would: the supervisor sees only this content
        (layout.rank_dir(rank) / "tmp").write_text(text)
        os.rename(layout.rank_dir(rank) / "tmp", path)
    plants = [lambda: os.mkfifo(path), lambda: os.symlink("/dev/zero", path), lambda: os.mkdir(path),
              lambda: put("[" * 100000), lambda: put('{"seq": 1e999}'), lambda: put(json.dumps(forged))]
    (layout.rank_dir(rank) / "planting").touch()  # tells the test that planting has begun
    for plant in plants:
        os.unlink(path)  # the last good beat
        plant()
        time.sleep(1.1)  # past one of the supervisor's once-a-second looks, whatever inotify says
        os.rmdir(path) if path.is_dir() and not path.is_symlink() else os.unlink(path)
        beat.beat(0, "train", force=True)  # readable again: the next plant is a new streak, warned anew
        time.sleep(0.6)  # past the supervisor's look at it (it reads a burst of beats a quarter second after)
for step in range(1, 11):
    beat.beat(step, "train")
    time.sleep(0.05)
beat.beat(10, "done", force=True)
"""


def hostile_job(tmp_path: Path, **overrides: object) -> Path:
    config = {
        "command": [sys.executable, "-c", HOSTILE_RANK],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 1, "backoff_initial_s": 0.1},
        "stop": {"kill_grace_s": 2.0},
        "hang": {"heartbeat": "required", "first_heartbeat_s": 30.0, "phase_timeouts_s": {"train": 30.0}},
        **overrides,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def warnings(run_dir: Path, name: str) -> list[dict[str, object]]:
    return [e for e in journal(run_dir) if e["event"] == name]


def test_hostile_heartbeats_and_stop_files_are_warned_about_and_supervision_goes_on(tmp_path: Path) -> None:
    """FIFO, /dev/zero symlink, directory, deep nesting, 1e999 and a forged heartbeat, then a FIFO and control bytes
    as stop file: each is one warning, nothing blocks, no hang or stop is made up, and the run finishes."""
    run_dir = tmp_path / "run"
    proc = start_supervisor(hostile_job(tmp_path, env={"PLANT": "1"}), run_dir)
    stop_file = RunLayout(run_dir).default_stop_file
    wait_until(lambda: (run_dir / "ranks" / "rank_0" / "planting").exists(), timeout=30, what="the first plant")
    os.mkfifo(stop_file)  # opening it for reading would block until a writer came
    wait_until(lambda: warnings(run_dir, "stop_file_unparsable"), timeout=10, what="the FIFO stop file warned")
    os.unlink(stop_file)
    stop_file.write_bytes(b"\x1b[2J\x07")  # no digit, yet not an empty kill switch either
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()

    assert proc.returncode == 0, stderr[-3000:]
    events = journal(run_dir)
    names = [e["event"] for e in events]
    assert "hang_detected" not in names and "stop_ordered" not in names and "rank_crashed" not in names
    unreadable = " ".join(str(e["error"]) for e in events if e["event"] == "heartbeat_unreadable")
    for why in (
        "a FIFO",
        "a symbolic link",
        "a directory",
        "larger than 4096 bytes",
        "1e999 is out of range",
        "holds rank 1's heartbeat",
    ):
        assert why in unreadable, (why, unreadable)
    refused = [str(e["error"]) for e in events if e["event"] == "stop_file_unparsable"]
    assert any("a FIFO" in r for r in refused) and any("control characters" in r for r in refused), refused
    status = json.loads((run_dir / "supervisor" / "state.json").read_text())
    assert (status["state"], status["restarts"]) == ("finished", 0)


def test_forged_records_before_start_are_ignored_and_an_untyped_abort_is_a_crash(tmp_path: Path) -> None:
    """Checkpoint records `[]` and `null`, a state.json with 1e999 and a forged pids.json naming an unrelated live
    process are ignored with their reasons; an anomaly_abort with strings for numbers is relaunched as a crash."""
    layout = RunLayout(tmp_path / "run")
    for rank, record in ((0, "[]"), (1, "null")):
        layout.checkpoints.rank_dir(rank).mkdir(parents=True)
        layout.checkpoints.file(rank, 10, "ckpt").write_bytes(b"x")
        layout.checkpoints.record(rank, 10, "ckpt").write_text(record)
    layout.state_file.parent.mkdir(parents=True)
    layout.state_file.write_text('{"ranks": [], "calibration": {"step_gaps": [1e999]}}')
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(bystander.pid).create_time()
        layout.pids_file.write_text(json.dumps({"processes": [{"pid": bystander.pid, "create_time": started}]}))
        done = run_supervisor(hostile_job(tmp_path, env={"ABORT": "1"}), layout.root)
        assert bystander.poll() is None, "a forged pids.json made the supervisor kill an unrelated process"
    finally:
        bystander.kill()
        bystander.wait(timeout=10)

    assert done.returncode == 0, done.stderr[-3000:]
    events = journal(layout.root)
    assert not [e for e in events if e["event"] == "predecessor_leftover_killed"]
    passed = [e for e in events if e["event"] == "checkpoint_passed_over"]
    assert passed and passed[0]["step"] == 10 and "not a JSON object" in passed[0]["reason"]
    [unreadable] = [e for e in events if e["event"] == "anomaly_abort_unreadable"]
    assert unreadable["rank"] == 1 and "not a count" in unreadable["error"]
    [crash] = [e for e in events if e["event"] == "rank_crashed"]
    assert (crash["rank"], crash["returncode"]) == (1, 65)
    status = done.status()
    assert (status["state"], status["restarts"]) == ("finished", 1)


def test_a_symlink_where_the_journal_goes_refuses_to_start_and_writes_nothing_outside(tmp_path: Path) -> None:
    """A run dir whose supervisor/events.jsonl is a symlink to another file: exit 78, one line, the file untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    layout = RunLayout(tmp_path / "run")
    layout.journal.parent.mkdir(parents=True)
    layout.journal.symlink_to(victim)
    done = run_supervisor(hostile_job(tmp_path), layout.root, timeout=30)

    assert done.returncode == 78
    assert done.stderr.strip().splitlines() == [
        f"trainwarden: cannot use run dir {layout.root}: {layout.journal}: not a regular file (not opened)"
    ]
    assert victim.read_text() == "precious\n" and not (layout.root / "logs").exists()


def test_a_symlink_where_the_lease_goes_refuses_to_start_and_writes_nothing_outside(tmp_path: Path) -> None:
    """A run dir whose supervisor/lease is a symlink to another directory: exit 78, one line, nothing written there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    (layout.root / "supervisor" / "lease").symlink_to(elsewhere)
    done = run_supervisor(hostile_job(tmp_path), layout.root, timeout=30)

    assert done.returncode == 78
    assert done.stderr.strip().splitlines() == [
        f"trainwarden: cannot use run dir {layout.root}: lease: a symbolic link or not a directory (not followed)"
    ]
    assert list(elsewhere.iterdir()) == [] and not (layout.root / "logs").exists()


def test_stop_writes_only_into_a_run_dir(tmp_path: Path) -> None:
    """`trainwarden stop` on a path that is not a run dir fails and creates nothing; on a run watching another
    stop file it names that file and writes nowhere."""
    missing = tmp_path / "no-such-run"
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(missing)], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1 and "is not a trainwarden run dir" in out.stderr
    assert not missing.exists()

    layout = RunLayout(tmp_path / "run")
    layout.state_file.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere" / "stop"
    layout.state_file.write_text(
        json.dumps({"ranks": [], "state": "running", "attempt": 0, "restarts": 0, "stop_file": str(elsewhere)})
    )
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(layout.root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and str(elsewhere) in out.stderr
    assert not elsewhere.exists() and not layout.default_stop_file.exists()


def test_a_fifo_as_stop_file_at_start_is_warned_about_and_sigterm_still_stops_the_run(tmp_path: Path) -> None:
    """A FIFO where the stop file goes, present from the start, is no stop file: one warning, the run launches,
    and the main loop, never blocked on it, answers SIGTERM."""
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    os.mkfifo(layout.default_stop_file)
    proc = start_supervisor(
        hostile_job(tmp_path, command=[sys.executable, "-c", "import time; time.sleep(60)"]), layout.root
    )
    wait_until(
        lambda: layout.journal.exists() and any(e["event"] == "ranks_launched" for e in journal(layout.root)),
        timeout=30,
        what="ranks launched",
    )
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)

    assert proc.returncode == 0, stderr[-2000:]
    names = [e["event"] for e in journal(layout.root)]
    assert names.count("stop_file_unparsable") == 1 and "stop_file_present" not in names
    assert [name for name in names if name != "memory_tier_removed"][-2:] == ["run_stopped", "supervisor_exiting"]
