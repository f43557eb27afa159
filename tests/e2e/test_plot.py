"""`trainwarden plot` on a real fault-injected 2-rank run: the PNG is written and its timeline holds the events."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.observe.plot import read_timeline
from tests.e2e.conftest import GUARDED, REPO, run_supervisor, write_config
from worker.contract import RunLayout

image = pytest.importorskip("matplotlib.image")  # the plot extra

pytestmark = pytest.mark.timeout(180)

STEPS = 40  # two launches of two torch ranks are most of the test's time; steps are cheap but not free


def test_plot_of_a_run_with_a_kill_and_a_spike_shows_them(tmp_path: Path) -> None:
    """Rank 0's spike at step 15 is skipped and rank 1 is SIGKILLed after step 25: `plot` exits 0 with its summary,
    writes a real PNG, and the run's timeline holds the crash of rank 1, the skip, the checkpoints, the relaunch
    from step 20 and the work redone from there."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "job.yaml",
        steps=STEPS,
        worker=GUARDED,
        env={"OMP_NUM_THREADS": "1", "TRAINWARDEN_FAULTS": "1:sigkill@25,0:spike@15"},
    )
    done = run_supervisor(config, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out.png"

    plotted = subprocess.run(
        [sys.executable, "-m", "supervisor", "plot", str(run_dir), "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert plotted.returncode == 0, plotted.stderr
    assert plotted.stderr == ""
    timeline = read_timeline(RunLayout(run_dir))
    assert plotted.stdout == f"wrote {out}: {timeline.summary()}\n"
    assert re.fullmatch(
        rf"{STEPS} steps, 1 crash, 1 skipped step, 4 checkpoints, goodput \d+\.\d %, start-up \S+", timeline.summary()
    )
    assert [m.step for m in timeline.marks if m.kind == "checkpoint"] == [10, 20, 30, 40]
    (crash,) = [m for m in timeline.marks if m.kind == "crash"]
    assert (crash.rank, crash.step) == (1, 25)
    assert [m.step for m in timeline.marks if m.kind == "skipped"] == [15]
    launches = [m for m in timeline.marks if m.kind == "launch"]
    assert [m.label for m in launches] == ["fresh", "from step 20"]
    assert crash.t < launches[1].t
    (redone,) = timeline.redone  # steps 21-25, done again after the relaunch
    assert redone[0] < redone[1] <= crash.t
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(out)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 1000
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::97]}) > 20  # curves, not a blank canvas
