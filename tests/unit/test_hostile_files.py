"""Every reader of a run-dir file against a FIFO, directory, device, symlink or oversize file in its place, and
every writer against symlinked directories: no reader blocks or raises, no write lands outside the run dir."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import _unusable
from supervisor.core.causes import explain
from supervisor.core.stop_requests import MAX_STOP_FILE_BYTES
from supervisor.launch.stacks import MAX_DUMP_BYTES, _read_from
from supervisor.launch.trees import kill_predecessor_leftovers, record_pids
from supervisor.observe.status import StatusError, read_status, write_status
from supervisor.rundir.checkpoints import write_health_file
from supervisor.rundir.journal import open_journal
from supervisor.rundir.rank_logs import TAIL_BYTES, last_event, stderr_tail
from supervisor.rundir.watch import HeartbeatUnreadable, read_heartbeat
from supervisor.runner import RunDirBusy, _previous_status, _previous_step_gaps, _stop_file_signature, lock_run_dir
from tests.hostile import KINDS, bounded, plant
from worker.contract import EXIT_CONFIG, RunLayout
from worker.events import open_event_log
from worker.files import Refused
from worker.heartbeat import Heartbeat
from worker.orders import StopOrders
from worker.store import Choice, choose_resume


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    (tmp_path / "outside").mkdir()
    return RunLayout(tmp_path / "run")


def _outside(layout: RunLayout) -> Path:
    return layout.root.parent / "outside"


@pytest.mark.parametrize("kind", KINDS)
def test_heartbeat_reader_refuses_without_blocking(layout: RunLayout, kind: str) -> None:
    """A hostile heartbeat.json is reported unreadable, never read through or waited on."""
    plant(layout.heartbeat(0), kind, _outside(layout))
    how, what = bounded(lambda: read_heartbeat(layout.heartbeat(0), 0))
    assert how == "raised" and isinstance(what, HeartbeatUnreadable), what


@pytest.mark.parametrize("kind", KINDS)
def test_rank_event_log_reader_finds_nothing_in_a_hostile_file(layout: RunLayout, kind: str) -> None:
    """A hostile events.jsonl yields no event (the rank's exit is then taken at face value)."""
    plant(layout.rank_events(0), kind, _outside(layout))
    assert bounded(lambda: last_event(layout, 0, 0, "anomaly_abort")) == ("returned", None)


@pytest.mark.parametrize("kind", KINDS)
def test_rank_stderr_reader_reads_at_most_its_tail_from_a_hostile_file(layout: RunLayout, kind: str) -> None:
    """A hostile rank_R.err gives nothing (or, oversized, only its last 64 KiB): the cause is the exit code alone."""
    plant(layout.attempt_log(0, 0, "err"), kind, _outside(layout))
    how, tail = bounded(lambda: stderr_tail(layout, 0, 0))
    assert how == "returned" and tail == (b"\0" * TAIL_BYTES if kind == "huge" else b"")
    assert explain(tail, 1).text == "exited with code 1"


@pytest.mark.parametrize("kind", KINDS)
def test_stop_file_reader_reports_a_hostile_file_as_unreadable(layout: RunLayout, kind: str) -> None:
    """A hostile stop file is read as 'cannot read it', so the operator gets a warning and no stop happens."""
    plant(layout.default_stop_file, kind, _outside(layout))
    how, (signature, content, _) = bounded(lambda: _stop_file_signature(layout.default_stop_file))
    if kind == "huge":  # read up to one byte past the cap, which parse_stop_file refuses by its size
        assert how == "returned" and len(content) == MAX_STOP_FILE_BYTES + 1
        return
    assert how == "returned" and isinstance(content, OSError), content
    assert signature[0] == -1


@pytest.mark.parametrize("kind", KINDS)
def test_state_file_reader_refuses_a_hostile_file(layout: RunLayout, kind: str) -> None:
    """`trainwarden status` and a restarted supervisor's calibration refuse a hostile state.json cleanly."""
    plant(layout.state_file, kind, _outside(layout))
    how, what = bounded(lambda: read_status(layout))
    assert how == "raised" and isinstance(what, StatusError), what
    assert bounded(lambda: _previous_step_gaps(_previous_status(layout), 100)) == ("returned", ())


@pytest.mark.parametrize("kind", KINDS)
def test_pids_file_reader_kills_nothing_from_a_hostile_file(layout: RunLayout, kind: str) -> None:
    """A hostile pids.json makes a new supervisor kill nothing."""
    plant(layout.pids_file, kind, _outside(layout))
    assert bounded(lambda: kill_predecessor_leftovers(layout)) == ("returned", [])


@pytest.mark.parametrize("part", ["record", "file"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_reader_passes_over_a_hostile_record_or_file(layout: RunLayout, kind: str, part: str) -> None:
    """A hostile completion record or checkpoint file makes its checkpoint passed over with a reason."""
    store = layout.checkpoints
    store.rank_dir(0).mkdir(parents=True)
    data = b"checkpoint bytes"
    if part == "record":
        store.file(0, 10, "demo").write_bytes(data)
        plant(store.record(0, 10, "demo"), kind, _outside(layout))
    else:
        store.record(0, 10, "demo").write_text(json.dumps({"size": len(data), "crc32": "00000000"}))
        plant(store.file(0, 10, "demo"), kind, _outside(layout))
    how, choice = bounded(lambda: choose_resume([store], 1, "demo"))
    assert how == "returned" and isinstance(choice, Choice), choice
    assert choice.step is None and [step for step, _ in choice.passed_over] == [10]
    assert choice.passed_over[0][1].startswith(("unreadable", "incomplete", "truncated")), choice.passed_over


@pytest.mark.parametrize("kind", KINDS)
def test_stop_order_reader_in_the_worker_sees_no_order(layout: RunLayout, kind: str) -> None:
    """A rank polling a hostile stop_order.json sees no order and trains on."""
    plant(layout.stop_order, kind, _outside(layout))
    assert bounded(lambda: StopOrders(layout.stop_order).poll()) == ("returned", None)


@pytest.mark.parametrize("kind", KINDS)
def test_stack_dump_reader_reads_nothing_from_a_hostile_file(layout: RunLayout, kind: str) -> None:
    """A hostile stack dump file contributes no text to the hang's stacks (a huge one: its first MiB)."""
    plant(layout.stack_dump(0, 0), kind, _outside(layout))
    how, text = bounded(lambda: _read_from(layout.stack_dump(0, 0), 0))
    assert how == "returned" and text == ("\0" * MAX_DUMP_BYTES if kind == "huge" else "")


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink outside", "character device"])
def test_supervisor_refuses_a_hostile_lock_or_journal(layout: RunLayout, kind: str) -> None:
    """A FIFO, directory, device or symlink where the lock or journal goes is refused, not opened through."""
    plant(layout.lock_file, kind, _outside(layout))
    how, what = bounded(lambda: lock_run_dir(layout))
    assert how == "raised" and isinstance(what, Refused), what
    plant(layout.journal, kind, _outside(layout))
    how, what = bounded(lambda: open_journal(layout.journal, root=layout.root, echo=None))
    assert how == "raised" and isinstance(what, Refused), what
    if kind == "symlink outside":
        assert (_outside(layout) / "secret").read_text() == '{"step": 1}'


def test_a_held_lock_holding_bytes_that_are_not_text_is_a_busy_run_dir(layout: RunLayout) -> None:
    """The holder's pid is read from the lock file, which anyone may have written: garbage names no pid."""
    layout.lock_file.parent.mkdir(parents=True, exist_ok=True)
    layout.lock_file.write_bytes(b"\xff\xfe 4242")
    with open(layout.lock_file, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        how, what = bounded(lambda: lock_run_dir(layout))
    assert how == "raised" and isinstance(what, RunDirBusy), what
    assert str(what) == f"{layout.root} is already supervised by pid unknown"


def test_a_run_dir_file_that_is_not_valid_is_reported_not_a_traceback(
    layout: RunLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trainwarden run` says why it cannot use the run dir for a ValueError (a file's garbage) as for an OSError."""
    assert _unusable(layout, ValueError("a lease's host is not a host name")) == EXIT_CONFIG
    assert (
        capsys.readouterr().err
        == f"trainwarden: cannot use run dir {layout.root}: : a lease's host is not a host name\n"
    )


# ---- writers ---------------------------------------------------------------------------------------

WRITERS: dict[str, tuple[str, Callable[[RunLayout], Any]]] = {
    "state.json": ("supervisor", lambda lo: write_status(lo, {"ranks": []}, durable=False)),
    "pids.json": ("supervisor", lambda lo: record_pids(lo, [])),
    "journal": ("supervisor", lambda lo: open_journal(lo.journal, root=lo.root, echo=None).close()),
    "heartbeat": (
        "ranks",
        lambda lo: Heartbeat(lo.heartbeat(0), root=lo.root, rank=0, attempt=0, interval_s=1).beat(
            1, "train", force=True
        ),
    ),
    "rank event log": ("ranks", lambda lo: open_event_log(lo.rank_events(0), root=lo.root)[1].close()),
    "health file": ("", lambda lo: write_health_file(lo, [])),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_no_write_follows_a_symlinked_directory_out_of_the_run_dir(layout: RunLayout, writer: str) -> None:
    """With the writer's directory replaced by a symlink to elsewhere, nothing is written there."""
    directory, write = WRITERS[writer]
    outside = _outside(layout)
    layout.root.mkdir()
    if directory:
        (layout.root / directory).symlink_to(outside, target_is_directory=True)
    else:
        (layout.root / "health_ckpts.json").symlink_to(outside / "victim")
    with contextlib.suppress(OSError, ValueError):  # refusing is fine; writing outside is not
        write(layout)
    assert os.listdir(outside) == []


def test_heartbeat_write_through_a_symlinked_dir_never_raises_into_training(layout: RunLayout) -> None:
    """A rank whose ranks/ dir was swapped for a symlink keeps training: the beat is dropped, not raised."""
    layout.root.mkdir()
    (layout.root / "ranks").symlink_to(_outside(layout), target_is_directory=True)
    Heartbeat(layout.heartbeat(0), root=layout.root, rank=0, attempt=0, interval_s=1).beat(1, "train", force=True)
    assert os.listdir(_outside(layout)) == []
