"""The supervisor's terminal: journal events as readable lines and, on a TTY, a live status line below them.

Machines (systemd, CI, `| tee`) get the journal's JSON lines unchanged; people at a terminal get structlog's
console rendering of the same events and one line, redrawn in place, that says where training stands.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import IO, Any

import structlog

from supervisor.observe.status import shown_state

__all__ = ["ENV_LOG_FORMAT", "LOG_FORMATS", "Console", "choose_format", "status_line"]

ENV_LOG_FORMAT = "TRAINWARDEN_LOG_FORMAT"
LOG_FORMATS = ("auto", "console", "json")
_CLEAR_LINE = "\r\x1b[2K"  # back to column 0, erase the line: the live line is redrawn in place


def choose_format(requested: str | None, stream: IO[str]) -> str:
    """`console` or `json`: the flag, else TRAINWARDEN_LOG_FORMAT, else console on a TTY and json elsewhere."""
    wanted = requested or os.environ.get(ENV_LOG_FORMAT) or "auto"
    if wanted not in LOG_FORMATS:
        raise ValueError(f"log format {wanted!r} is not one of {', '.join(LOG_FORMATS)} ({ENV_LOG_FORMAT})")
    if wanted != "auto":
        return wanted
    try:
        return "console" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # closed or not a real stream
        return "json"


class Console:
    """Writes event lines to `stream`; with `live`, keeps one status line at the bottom, redrawn in place."""

    def __init__(self, stream: IO[str], *, live: bool) -> None:
        self._stream = stream
        self._live = live
        self._line = ""  # the status line now shown, "" when none
        self._lock = threading.Lock()  # journal lines come from any thread
        colors = live and "NO_COLOR" not in os.environ
        self._render = structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=24, sort_keys=False)

    def event(self, event_dict: dict[str, Any]) -> None:
        """One journal event, rendered for people."""
        fields = dict(event_dict)
        stamp = fields.pop("time", None)
        if isinstance(stamp, str):  # ISO 8601, UTC: the time of day is enough on a terminal
            fields["timestamp"] = stamp[11:19]
        text = self._render(None, "", fields)
        self._write(text)

    def status(self, status: dict[str, Any]) -> None:
        """Redraw the live line from the state file's content (nothing unless live)."""
        if not self._live:
            return
        width = shutil.get_terminal_size((120, 24)).columns
        line = status_line(status)[: max(20, width - 1)]
        with self._lock:
            self._line = line
            self._put(f"{_CLEAR_LINE}{line}")

    def close(self) -> None:
        """Leave the last status line on screen and the cursor below it."""
        with self._lock:
            if self._line:
                self._put("\n")
                self._line = ""

    def _write(self, text: str) -> None:
        with self._lock:
            prefix = _CLEAR_LINE if self._line else ""
            self._put(f"{prefix}{text}\n{self._line}")

    def _put(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a closed terminal must not take the supervisor down
            pass


def status_line(status: dict[str, Any]) -> str:
    """One line: state, step/total, loss, steps/s, ETA, last checkpoint, attempt, restarts, goodput."""
    progress = status.get("progress") or {}
    parts = [shown_state(status.get("state", "?"), status.get("exit_code"))]
    step, total = progress.get("step"), progress.get("total_steps")
    if step is not None:
        parts.append(f"step {step}/{total}" if total else f"step {step}")
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4g}")
    if progress.get("steps_per_s"):
        parts.append(f"{progress['steps_per_s']:.3g} steps/s")
    if progress.get("eta_s") is not None:
        parts.append(f"ETA {_duration(progress['eta_s'])}")
    checkpoint = status.get("last_checkpoint") or {}
    parts.append(f"ckpt {checkpoint.get('step', '-')}")
    parts.append(f"attempt {status.get('attempt', 0)}")
    parts.append(f"restarts {status.get('restarts', 0)}/{status.get('max_restarts', '?')}")
    goodput = status.get("goodput") or {}
    if goodput.get("ratio") is not None:
        parts.append(f"goodput {100 * goodput['ratio']:.1f}%")
    stragglers = status.get("stragglers") or []
    if stragglers:
        parts.append("slow rank " + ",".join(str(s.get("rank")) for s in stragglers))
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
