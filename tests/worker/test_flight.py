"""The worker library's flight recorder dumps: asked for by the stack dump growing, and at an uncaught exception.
PyTorch's recorder itself is read by the e2e tests (test_hang_blame.py); here it stands in as plain values."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import worker.flight
from tests.conftest import wait_until
from worker.flight import FlightRecorderDumps

RECORD = {
    "entries": [{"pg_id": 0, "collective_seq_id": 7, "profiling_name": "gloo:all_reduce", "retired": True}],
    "pg_status": {},
    "pg_config": {},
}


@pytest.fixture
def dumps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    record = {"now": RECORD}
    monkeypatch.setattr(worker.flight, "flight_record", lambda: record["now"])
    stacks = (tmp_path / "stacks.txt").open("a")
    dumper = FlightRecorderDumps(stacks, tmp_path / "flight.json", tmp_path)
    yield dumper, stacks, tmp_path / "flight.json", record
    dumper.close()
    stacks.close()


def test_the_stack_dump_growing_is_the_request(dumps):
    """faulthandler appends to the stacks file from C; the helper thread sees it and writes the record."""
    _, stacks, flight, _ = dumps
    time.sleep(0.3)
    assert not flight.exists()  # nothing asked, nothing written
    stacks.write("Thread 0x1 (most recent call first):\n")
    stacks.flush()
    assert wait_until(lambda: flight.exists() and json.loads(flight.read_text()) == RECORD, timeout=5)


def test_a_rank_with_no_record_answers_with_an_empty_one_but_not_at_an_exception(dumps):
    dumper, stacks, flight, record = dumps
    record["now"] = None
    assert dumper.dump(empty_too=False) is False and not flight.exists()
    stacks.write("x\n")
    stacks.flush()
    assert wait_until(lambda: flight.exists() and json.loads(flight.read_text()) == {"entries": []}, timeout=5)


def test_an_uncaught_exception_dumps_the_record_then_the_previous_hook_runs(dumps, monkeypatch):
    """A collective that raised (a peer gone, a desync) ends the rank: its record is written first."""
    dumper, _, flight, _ = dumps
    seen = []
    monkeypatch.setattr(dumper, "_previous_hook", lambda *args: seen.append(args[0]))
    sys.excepthook(RuntimeError, RuntimeError("Connection reset by peer"), None)
    assert json.loads(flight.read_text()) == RECORD and seen == [RuntimeError]
    dumper.close()
    assert sys.excepthook != dumper._on_uncaught
