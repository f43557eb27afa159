"""`trainwarden plot`'s reading and downsampling: the timeline of a run dir, bounded series, hostile files."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import main
from supervisor.observe import plot
from supervisor.observe.plot import MAX_MARKS, MAX_POINTS, Mark, cluster, downsample, read_timeline, steps_per_s
from tests.hostile import KINDS, bounded, plant
from worker.contract import RunLayout

T0 = 1_800_000_000.0  # epoch seconds of the run's first event


def at(seconds: float) -> str:
    """structlog's `time` (ISO-8601, UTC) `seconds` after T0."""
    import datetime

    moment = datetime.datetime.fromtimestamp(T0 + seconds, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def line(event: str, seconds: float, **fields: Any) -> str:
    return json.dumps({**fields, "event": event, "level": "info", "time": at(seconds)}) + "\n"


def step(rank: int, n: int, seconds: float, *, skipped: bool = False, loss: float = 2.0) -> str:
    """A rank's `step` event as the worker library writes it."""
    return line(
        "step",
        seconds,
        rank=rank,
        attempt=0,
        step=n,
        batch=n - 1 + skipped,
        skipped=skipped,
        loss=loss,
        grad_norm=0.8,
        step_time_s=0.1,
    )


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def small_run(root: Path) -> RunLayout:
    """Two ranks, 40 steps; rank 1 killed after step 30, relaunched from step 20 at t=5; step 15's batch skipped."""
    layout = RunLayout(root)
    write(
        layout.journal,
        "".join(
            [
                line("supervisor_started", 0.0, pid=1),
                line("ranks_launched", 0.1, attempt=0, pids=[2, 3], resume_step=None),
                line("rank_crashed", 4.0, rank=1, attempt=0, step=30, returncode=-9, description="killed by SIGKILL"),
                line("ranks_launched", 5.0, attempt=1, pids=[4, 5], resume_step=20),
                line("run_finished", 9.0, attempt=1, restarts=1),
            ]
        ),
    )
    for rank in (0, 1):
        events = []
        for n in range(1, 31):  # attempt 0: steps at 1.0 + 0.1 n; batch 14 is skipped before step 15
            t = 1.0 + 0.1 * n
            if n == 15:
                events.append(step(rank, 14, t - 0.05, skipped=True, loss=1e4))
                events.append(line("step_skipped", t - 0.05, rank=rank, step=15, batch=14, is_skip=True))
            events.append(step(rank, n, t))
            if n % 10 == 0 and rank == 0:
                events.append(line("checkpoint_saved", t, rank=0, step=n, duration_s=0.01))
        events += [step(rank, n, 5.0 + 0.1 * (n - 20)) for n in range(21, 41)]
        write(layout.rank_events(rank), "".join(events))
    return layout


def test_a_run_dir_becomes_its_series_and_events(tmp_path: Path) -> None:
    """The crash (rank 1), the relaunch from step 20, one skip for both ranks, rank 0's checkpoints and the work
    redone between step 20 and the crash are read, at their times since the first event."""
    timeline = read_timeline(small_run(tmp_path))

    assert timeline.start == T0
    assert timeline.counts == {
        "crash": 1,
        "hang": 0,
        "rollback": 0,
        "skipped": 1,
        "checkpoint": 3,
        "stop": 0,
        "launch": 2,
        "straggler": 0,
    }
    assert timeline.summary() == "40 steps, 1 crash, 1 skipped step, 3 checkpoints"
    (crash,) = [m for m in timeline.marks if m.kind == "crash"]
    assert (crash.rank, crash.step, crash.label, crash.t) == (1, 30, "rank 1 @ step 30", 4.0)
    assert [m.label for m in timeline.marks if m.kind == "launch"] == ["fresh", "from step 20"]
    assert [m.step for m in timeline.marks if m.kind == "checkpoint"] == [10, 20, 30]
    (skip,) = [m for m in timeline.marks if m.kind == "skipped"]
    assert skip.step == 15 and skip.t == pytest.approx(2.45)
    assert timeline.redone == (pytest.approx((3.0, 4.0)),)  # step 20 done at 3.0 s, step 30 (the last) at 4.0 s
    assert len(timeline.loss.x) == 50 and set(timeline.loss.y) == {2.0}  # applied steps only: no 1e4 loss
    assert sorted(timeline.step_time) == [0, 1] and len(timeline.step_time[1].x) == 51
    assert timeline.notes == ()


def test_downsampling_bounds_a_series_and_keeps_its_extremes() -> None:
    """100,000 points become at most MAX_POINTS, x ascending, with the global min and max still in the envelope."""
    rng = random.Random(0)
    xs = [i * 0.5 for i in range(100_000)]
    ys = [rng.gauss(3.0, 0.2) for _ in xs]
    ys[12_345], ys[67_890] = 250.0, -7.0
    rng.shuffle(order := list(range(len(xs))))

    series = downsample([xs[i] for i in order], [ys[i] for i in order])

    assert 0 < len(series.x) <= MAX_POINTS
    assert list(series.x) == sorted(series.x)
    assert (min(series.low), max(series.high)) == (-7.0, 250.0)
    assert all(lo <= y <= hi for lo, y, hi in zip(series.low, series.y, series.high, strict=True))
    assert downsample([2.0, 1.0], [5.0, 6.0]) == plot.Series((1.0, 2.0), (6.0, 5.0), (6.0, 5.0), (6.0, 5.0))


def test_steps_per_s_reads_zero_through_downtime() -> None:
    """Steps at 10/s, then 5 s without a step, then 10/s again: the bins in the gap read 0, the others about 10."""
    times = [i * 0.1 for i in range(100)] + [15.0 + i * 0.1 for i in range(100)]

    series = steps_per_s(times)

    assert len(series.x) == 20
    gap = [y for x, y in zip(series.x, series.y, strict=True) if 11 < x < 14]
    busy = [y for x, y in zip(series.x, series.y, strict=True) if x < 9 or x > 16]
    assert gap and set(gap) == {0.0}
    assert all(9 <= y <= 11 for y in busy)


def test_dense_events_are_clustered_with_their_count() -> None:
    """10,000 checkpoints become at most MAX_MARKS marks whose counts add up to 10,000; a few stay as they are."""
    marks = [Mark("checkpoint", float(i)) for i in range(10_000)]

    clustered = cluster(marks)

    assert len(clustered) <= MAX_MARKS
    assert sum(m.count for m in clustered) == 10_000
    assert clustered[0].t == 0.0 and clustered[-1].t_end == 9_999.0
    assert cluster(marks[:5]) == marks[:5]


GARBAGE = [
    "",
    "not json at all",
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": 3',  # torn
    "[1, 2, 3]",
    '{"event": "step", "time": "yesterday", "step": 1, "skipped": false, "loss": 1.0}',
    '{"event": "step", "time": 12, "step": 1}',
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": 1' + "0" * 400 + ', "skipped": false}',
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": -4, "skipped": false, "loss": 1.0}',
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": true, "skipped": false, "loss": 1.0}',
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": 2, "skipped": false, "loss": "x", "step_time_s": -1}',
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "step": 3, "skipped": false, "loss": NaN, "step_time_s": 1e999}',
    '{"event": "rank_crashed", "time": "2027-01-15T08:00:02Z", "rank": "1; rm -rf /", "node": "\\u001b[2J"}',
    '{"event": "checkpoint_saved", "time": "2027-01-15T08:00:02Z", "step": 1.5}',
    '{"event": "step_skipped", "time": "2027-01-15T08:00:02Z", "step": 4}',
    "[" * 30_000 + "]" * 30_000,  # nested past the parser's recursion limit
    '{"event": "step", "time": "2027-01-15T08:00:01Z", "pad": "' + "x" * 100_000 + '", "step": 9, "skipped": false}',
]


def test_garbage_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    """Torn, non-object, oversized, deeply nested and ill-typed lines are skipped; odd fields are ignored; the
    readable events between them still count."""
    layout = RunLayout(tmp_path)
    good = [line("step", 1.0, step=1, skipped=False, loss=1.0, step_time_s=0.1), line("checkpoint_saved", 1.5, step=1)]
    garbage = "\n".join(GARBAGE).encode() + b"\n\xff\xfe not UTF-8\n"
    layout.rank_events(0).parent.mkdir(parents=True)
    layout.rank_events(0).write_bytes(good[0].encode() + garbage + good[1].encode() + b'{"event": "step", "ti')
    layout.journal.parent.mkdir(parents=True)
    layout.journal.write_bytes(garbage + line("ranks_launched", 0.0, resume_step="7").encode())

    timeline = read_timeline(layout)

    assert timeline.steps == 3  # the odd-typed step 2 and NaN-loss step 3 lines are valid events
    assert [(round(x, 3), y) for x, y in zip(timeline.loss.x, timeline.loss.y, strict=True)] == [(1.0, 1.0)]
    assert [(m.kind, m.label) for m in timeline.marks] == [("crash", ""), ("checkpoint", "step 1"), ("launch", "fresh")]
    assert timeline.counts["checkpoint"] == 1 and timeline.counts["skipped"] == 0
    assert timeline.notes == ("19 unreadable line(s) skipped",)  # 9 in each file, and rank 0's torn tail


def test_only_the_newest_part_of_an_oversized_log_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log over MAX_LOG_BYTES is read from its last MAX_LOG_BYTES, dropping the partial first line, and said so."""
    layout = RunLayout(tmp_path)
    text = "".join(step(0, n, n * 0.1) for n in range(1, 1001))
    write(layout.rank_events(0), text)
    monkeypatch.setattr(plot, "MAX_LOG_BYTES", len(text) // 4 + 7)

    timeline = read_timeline(layout)

    assert timeline.steps == 1000
    assert 240 <= len(timeline.loss.x) < 250  # a quarter of the steps, less the torn first line
    assert any("only its last" in note for note in timeline.notes)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_file_in_place_of_a_log_is_not_followed_nor_waited_on(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO, directory, symlink, huge sparse file or device where the journal and a rank log go: the timeline is
    read within a bounded time, with a note for what was refused, and the other rank's steps are still there."""
    monkeypatch.setattr(plot, "MAX_LOG_BYTES", 8 << 20)  # the huge file's newest 8 MiB of zeros, not 256
    layout = small_run(tmp_path / "run")
    for path in (layout.journal, layout.rank_events(0)):
        path.unlink()
        plant(path, kind, tmp_path)

    outcome, timeline = bounded(lambda: read_timeline(layout), timeout=20)

    assert outcome == "returned", timeline
    assert timeline.steps == 40  # rank 1's log
    assert timeline.counts["crash"] == 0 and not any("secret" in note for note in timeline.notes)
    if kind != "huge":
        assert any(note.startswith("supervisor/events.jsonl: not read") for note in timeline.notes)


def test_a_symlinked_rank_dir_is_not_followed(tmp_path: Path) -> None:
    """ranks/rank_0 as a symlink to another run's rank dir: not read, and said so."""
    other = small_run(tmp_path / "other")
    layout = RunLayout(tmp_path / "run")
    write(layout.journal, line("supervisor_started", 0.0))
    (tmp_path / "run" / "ranks").mkdir()
    layout.rank_dir(0).symlink_to(other.rank_dir(0))

    timeline = read_timeline(layout)

    assert timeline.steps == 0 and timeline.step_time == {0: plot.Series()}
    assert any(note.startswith("ranks/rank_0/events.jsonl: not read") for note in timeline.notes)


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where matplotlib cannot be imported, `trainwarden plot` prints one line naming the extra and exits 1."""
    small_run(tmp_path)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)

    assert main(["plot", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", "trainwarden: plot needs matplotlib: pip install 'trainwarden[plot]'\n")
    assert not (tmp_path / "plot.png").exists()


def test_plot_of_a_folder_that_is_no_run_dir_fails_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory without supervisor/ or ranks/ is refused in one line, exit 1, nothing written."""
    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"trainwarden: {tmp_path} is not a trainwarden run dir (no supervisor/ or ranks/ folder in it)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_stragglers_flagged_in_the_journal_or_the_state_file_are_marked(tmp_path: Path) -> None:
    """A `straggler_flagged` journal event becomes a mark with the rank and how much slower; ranks flagged in
    state.json now count as flagged too."""
    layout = small_run(tmp_path)
    with layout.journal.open("a") as journal:
        journal.write(line("straggler_flagged", 3.5, rank=1, compute_s=0.2, median_s=0.1, slower_by=1.0))
    write(layout.state_file, json.dumps({"state": "running", "stragglers": [{"rank": 0}, {"rank": "x"}, 7]}))

    timeline = read_timeline(layout)

    assert [(m.label, m.t) for m in timeline.marks if m.kind == "straggler"] == [("rank 1 +100%", 3.5)]
    assert timeline.flagged == (0, 1) and timeline.state == "running"
    assert timeline.summary() == "40 steps, 1 crash, 1 skipped step, 3 checkpoints, 1 straggler flag"


def test_render_writes_a_png_of_a_dense_run_with_many_ranks(tmp_path: Path) -> None:
    """12 ranks, 3000 steps each, 300 checkpoints and a loss spanning 1000x: drawn (8 ranks' step times, clustered
    checkpoints, log-scale loss) into a PNG in place of a symlink, which is replaced, not followed."""
    pytest.importorskip("matplotlib")
    layout = RunLayout(tmp_path / "run")
    write(layout.journal, line("ranks_launched", 0.0, resume_step=None))
    for rank in range(12):
        events = [step(rank, n, n * 0.1, loss=1000.0 / n) for n in range(1, 3001)]
        if rank == 0:
            events += [line("checkpoint_saved", n * 0.1, step=n) for n in range(10, 3001, 10)]
        write(layout.rank_events(rank), "".join(events))
    target = tmp_path / "elsewhere.png"
    (tmp_path / "run" / "plot.png").symlink_to(target)
    timeline = read_timeline(layout)
    assert len([m for m in timeline.marks if m.kind == "checkpoint"]) <= MAX_MARKS

    plot.render(timeline, tmp_path / "run" / "plot.png")

    assert (tmp_path / "run" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not target.exists()
