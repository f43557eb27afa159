"""The console: which format is chosen, the live status line's content, and lines redrawn around it."""

from __future__ import annotations

import io

import pytest

from supervisor.observe.console import Console, choose_format, status_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_console_on_a_terminal_and_json_elsewhere(monkeypatch):
    monkeypatch.delenv("TRAINWARDEN_LOG_FORMAT", raising=False)
    assert choose_format(None, Terminal()) == "console"
    assert choose_format(None, io.StringIO()) == "json"
    assert choose_format("json", Terminal()) == "json"
    monkeypatch.setenv("TRAINWARDEN_LOG_FORMAT", "console")
    assert choose_format(None, io.StringIO()) == "console"
    assert choose_format("json", io.StringIO()) == "json"  # the flag wins over the environment


def test_an_unknown_format_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("TRAINWARDEN_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="'xml' is not one of auto, console, json"):
        choose_format(None, io.StringIO())


def test_the_status_line_says_where_training_stands():
    status = {
        "state": "running",
        "attempt": 1,
        "restarts": 1,
        "max_restarts": 3,
        "last_checkpoint": {"step": 300},
        "progress": {"step": 312, "total_steps": 600, "loss": 2.13456, "steps_per_s": 21.3, "eta_s": 754.0},
        "goodput": {"ratio": 0.9134},
        "stragglers": [{"rank": 3}],
    }
    assert status_line(status) == (
        "running | step 312/600 | loss 2.135 | 21.3 steps/s | ETA 12:34 | ckpt 300 | "
        "attempt 1 | restarts 1/3 | goodput 91.3% | slow rank 3"
    )


def test_the_status_line_of_a_run_that_has_not_stepped_yet():
    assert (
        status_line({"state": "starting", "attempt": 0, "restarts": 0, "max_restarts": 3, "last_checkpoint": None})
        == "starting | ckpt - | attempt 0 | restarts 0/3"
    )


def test_an_event_line_is_printed_above_the_live_line_which_is_redrawn():
    terminal = Terminal()
    console = Console(terminal, live=True)
    console.status({"state": "running", "progress": {"step": 5}})
    console.event({"event": "rank_crashed", "level": "error", "rank": 1, "time": "2026-11-23T15:43:44.1Z"})
    console.close()
    shown = terminal.getvalue()
    event_at, redrawn_at = shown.index("rank_crashed"), shown.rindex("running | step 5")
    assert "15:43:44" in shown and event_at < redrawn_at and shown.endswith("\n")


def test_without_a_terminal_there_is_no_live_line():
    stream = io.StringIO()
    console = Console(stream, live=False)
    console.status({"state": "running"})
    console.event({"event": "run_finished", "level": "info"})
    console.close()
    assert "running" not in stream.getvalue() and "run_finished" in stream.getvalue()
