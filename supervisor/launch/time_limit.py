"""The job's time limit, known rather than only signalled: every supervisor inside a Slurm job (the first, and a
successor after a takeover, whose job's batch shell and its `--signal=B:USR1@N` warning may be gone) reads the
job's end time from the controller, off the main loop, and again every `REREAD_S` (`scontrol update TimeLimit=`
moves it). Each new reading reaches the core as a `TimeLimitRead` with the end time in the supervisor's monotonic
clock and the margin: the batch script's `--signal` lead when it has one, else `slurm.time_limit_margin_s`. The core
decides (a margin before the end: save at an agreed step, exit 75). An unreachable controller stops nothing: the
last reading stands, and the next try comes `REREAD_S` later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from supervisor.core import TimeLimitRead
from supervisor.launch import slurmctl

__all__ = ["TimeLimitWatch"]

REREAD_S = 30.0  # one bounded `scontrol show job` this often: nothing to a controller


class TimeLimitWatch:
    """Posts a TimeLimitRead whenever the job's end time (or the margin) is new; a thread until `stop`."""

    def __init__(self, job: str, margin_s: float, post: Callable[[object], None], log: Any) -> None:
        self._job = job
        self._margin_s = margin_s
        self._post = post
        self._log = log
        self._stop = threading.Event()
        self._lead: float | None = None  # the batch script's --signal lead, once read
        self._lead_read = False
        self._last: tuple[float | None, float] | None = None  # (end, margin) last posted
        self._failing = False  # the last reading failed (warned once per streak)

    @classmethod
    def in_job(cls, margin_s: float, post: Callable[[object], None], log: Any) -> TimeLimitWatch | None:
        """A watch for the Slurm job this supervisor runs in; None outside one."""
        job = slurmctl.job_id()
        return None if job is None else cls(job, margin_s, post, log)

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="time-limit").start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.read()
            self._stop.wait(REREAD_S)

    def read(self) -> None:
        """One reading: a TimeLimitRead posted when it says something new."""
        try:
            found = slurmctl.job_end(self._job, with_signal_lead=not self._lead_read)
        except slurmctl.SlurmError as exc:
            if not self._failing:
                self._log.warning(
                    "time_limit_unknown", error=str(exc), action=f"the run goes on; asked again every {REREAD_S:g} s"
                )
            self._failing = True
            return
        self._failing = False
        if not self._lead_read:
            self._lead, self._lead_read = found.signal_lead_s, True
        margin = self._margin_s if self._lead is None else self._lead
        half = None if found.limit_s is None else found.limit_s / 2
        capped = half is not None and margin > half
        if half is not None and capped:  # a short job (a test, a debug run) must train, not end at once
            margin = half
        if (found.end, margin) == self._last or self._stop.is_set():
            return
        self._last = (found.end, margin)
        at = None if found.end is None else time.monotonic() + (found.end - time.time())
        end_time = "" if found.end is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(found.end))
        self._log.info(
            "time_limit_read",
            end_time=end_time or None,
            margin_s=margin,
            margin_from="half the job's time limit"
            if capped
            else "slurm.time_limit_margin_s"
            if self._lead is None
            else "the batch script's --signal",
        )
        self._post(TimeLimitRead(at, margin, end_time))
