"""bench/crash_relaunch.py's last line, the issue's figure: against plain torchrun, or torchrun ns where plain
torchrun's restarts never resumed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from crash_relaunch import Trial, last_line  # noqa: E402 - the benchmark lives with the benchmarks


def trial(launcher: str, first_step_s: float | None) -> Trial:
    resumed = first_step_s is not None
    return Trial(launcher, 3.0, 0.1, first_step_s, 1 if resumed else None, resumed, "", 9.0)


def test_the_figure_is_against_plain_torchrun_when_it_resumed() -> None:
    line = last_line(0.1, {"torchrun": 2.5, "torchrun ns": 2.0}, [trial("torchrun", 2.5)])
    assert line == "crash→first step, in place / torchrun: 0.040"


def test_against_torchrun_ns_when_plain_torchrun_never_resumed_saying_so() -> None:
    results = [trial("torchrun", None), trial("torchrun", None), trial("torchrun ns", 2.8)]
    line = last_line(0.14, {"torchrun": None, "torchrun ns": 2.8}, results)
    why = "against torchrun ns: plain torchrun resumed in 0/2 trials"
    assert line == f"crash→first step, in place / torchrun: 0.050 ({why})"


def test_no_figure_without_a_resumed_trial() -> None:
    assert last_line(None, {"torchrun": 2.5, "torchrun ns": 2.0}, []).endswith(": n/a (no trial of either resumed)")
    assert last_line(0.1, {"torchrun": None, "torchrun ns": None}, []).endswith("n/a (no trial of either resumed)")
