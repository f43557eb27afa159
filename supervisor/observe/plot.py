"""`trainwarden plot`: one PNG of a run — loss, steps/s, every crash, hang, rollback, skip, checkpoint, stop and
relaunch on a shared time axis, and per-rank step time — drawn from the run dir's files alone.

The run dir is untrusted: files are read bounded (a log's newest MAX_LOG_BYTES), from regular files reached through
no symlink, and a line that is torn, too long or not a JSON object is skipped. Reading (`read_timeline`) and
downsampling are pure Python and give a `Timeline`; only `render` needs matplotlib, an optional extra.
"""

from __future__ import annotations

import bisect
import datetime
import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeGuard

from supervisor.core.model import duration
from supervisor.observe.status import MAX_STATE_BYTES
from supervisor.rundir.journal import journal_files
from worker.contract import RunLayout
from worker.files import Refused, atomic_write, open_dir

__all__ = [
    "KINDS",
    "MAX_POINTS",
    "Mark",
    "PlotError",
    "Series",
    "Timeline",
    "cluster",
    "downsample",
    "plot_run",
    "read_timeline",
    "render",
    "steps_per_s",
]

MAX_LOG_BYTES = 256 << 20  # a week at a step a second is about 120 MiB of step events; past this, the newest part
MAX_LINE_BYTES = 64 << 10  # every line trainwarden writes is far shorter
MAX_RANKS = 1024  # rank logs read; a larger run dir is not one of ours
MAX_POINTS = 2000  # per series: more than a 1200-pixel-wide panel shows
MAX_MARKS = 60  # per kind of event: denser ones are drawn as clusters with their count
RANKS_DRAWN = 8  # step-time lines: more are unreadable (rank 0, stragglers and the slowest are kept)
_CHUNK = 1 << 20
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_RANK_DIR = re.compile(r"rank_(\d{1,6})")
NEEDS_MATPLOTLIB = "plot needs matplotlib: pip install 'trainwarden[plot]'"

# Event lanes, top to bottom, and the journal events drawn in each.
KINDS = ("crash", "hang", "rollback", "skipped", "checkpoint", "stop", "launch", "straggler")
_JOURNAL_KINDS = {
    "rank_crashed": "crash",
    "node_lost": "crash",
    "hang_detected": "hang",
    "rollback_scheduled": "rollback",
    "stop_ordered": "stop",
    "run_stopped": "stop",
    "restarts_exhausted": "stop",
    "crash_loop": "stop",
    "rollbacks_exhausted": "stop",
    "not_retryable": "stop",
    "ranks_launched": "launch",
    "straggler_flagged": "straggler",
}


class PlotError(Exception):
    """The plot cannot be made: no run dir, no matplotlib, an output that cannot be written."""


@dataclass(frozen=True)
class Series:
    """Points of one curve, x ascending; `low`/`high` the min and max of the raw points behind each (downsampled)."""

    x: tuple[float, ...] = ()
    y: tuple[float, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()


@dataclass(frozen=True)
class Mark:
    """One event on the time axis (seconds since the run's first event), or `count` of one kind clustered."""

    kind: str
    t: float
    label: str = ""
    count: int = 1
    t_end: float | None = None  # a cluster's last event
    rank: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Timeline:
    """Everything the picture shows, times in seconds since `start` (epoch seconds, None: no event at all)."""

    start: float | None
    loss: Series
    steps_per_s: Series
    step_time: dict[int, Series]  # per rank
    marks: tuple[Mark, ...]
    redone: tuple[tuple[float, float], ...]  # spans of work lost to a failure (computed again after a relaunch)
    counts: dict[str, int]  # events of each kind, before clustering
    steps: int  # the highest applied step logged
    state: str | None  # the supervisor's last phase (state.json)
    goodput: float | None  # the supervisor's goodput ratio (state.json): kept steps at the ideal rate over wall time
    startup_s: float | None  # of the wall time, the run's start-up (state.json's goodput block)
    flagged: tuple[int, ...]  # ranks flagged as stragglers (state.json or the journal)
    notes: tuple[str, ...]  # files not read whole, lines skipped

    def summary(self) -> str:
        """`600 steps, 1 crash, 2 skipped steps, 24 checkpoints` (hangs, rollbacks, stragglers where any)."""
        parts = [_count(self.steps, "step"), _count(self.counts["crash"], "crash")]
        parts += [_count(self.counts[kind], kind) for kind in ("hang", "rollback") if self.counts[kind]]
        parts += [_count(self.counts["skipped"], "skipped step"), _count(self.counts["checkpoint"], "checkpoint")]
        if self.counts["straggler"]:
            parts.append(_count(self.counts["straggler"], "straggler flag"))
        if self.goodput is not None:
            parts.append(f"goodput {100 * self.goodput:.1f} %")
        if self.startup_s is not None:
            parts.append(f"start-up {duration(self.startup_s)}")
        return ", ".join(parts)


def _count(n: int, noun: str) -> str:
    plural = noun + ("es" if noun.endswith("sh") else "s")
    return f"{n} {noun if n == 1 else plural}"


# ---- reading --------------------------------------------------------------------------------------------------


def plot_run(run_dir: Path, output: Path | None = None) -> tuple[str, tuple[str, ...]]:
    """Write the picture of `run_dir` to `output` (default RUN_DIR/plot.png), atomically; the one-line summary and
    the notes on what was not read. PlotError for what stops it."""
    layout = RunLayout(Path(run_dir))
    if not (layout.root / "supervisor").is_dir() and not (layout.root / "ranks").is_dir():
        raise PlotError(f"{run_dir} is not a trainwarden run dir (no supervisor/ or ranks/ folder in it)")
    _matplotlib()  # before reading a week of logs
    path = Path(output) if output is not None else layout.root / "plot.png"
    if not path.parent.is_dir():
        raise PlotError(f"cannot write {path}: no directory {path.parent}")
    timeline = read_timeline(layout)
    try:
        render(timeline, path, title=layout.root.name or str(layout.root))
    except (OSError, ValueError) as exc:
        raise PlotError(f"cannot write {path}: {exc}") from None
    return f"wrote {path}: {timeline.summary()}", timeline.notes


def read_timeline(layout: RunLayout) -> Timeline:
    """The run's series and events, read from its journal, rank event logs and state file, downsampled."""
    notes: list[str] = []
    reader = _Reader(layout.root, notes)
    journal = [
        (t, e)
        for path in journal_files(layout.journal)
        for t, e in reader.events(path)
        if isinstance(e.get("event"), str)
    ]
    launches = sorted(t for t, e in journal if e["event"] == "ranks_launched")
    ranks = reader.ranks()
    raw: dict[str, list[tuple[float, dict[str, Any]]]] = {kind: [] for kind in KINDS}
    for t, event in journal:
        kind = _JOURNAL_KINDS.get(event["event"])
        if kind is not None:
            raw[kind].append((t, event))
    logs = {rank: _RankLog.read(reader, layout.rank_events(rank), launches) for rank in ranks}
    first = min((rank for rank, log in logs.items() if log.applied), default=min(logs, default=None))
    if first is not None:
        raw["checkpoint"] = logs[first].saves
    raw["skipped"] = sorted(_unique_skips(logs.values()), key=lambda item: item[0])
    status = reader.state(layout.state_file)
    starts = [t for t, _ in journal] + [log.first for log in logs.values() if log.first is not None]
    start = min(starts) if starts else None
    return _assemble(start, raw, logs, first, status, notes, reader.skipped)


def _assemble(
    start: float | None,
    raw: dict[str, list[tuple[float, dict[str, Any]]]],
    logs: dict[int, _RankLog],
    first: int | None,
    status: dict[str, Any],
    notes: list[str],
    skipped: int,
) -> Timeline:
    origin = start or 0.0
    marks: list[Mark] = []
    for kind in KINDS:
        marks += cluster([_mark(kind, t - origin, event) for t, event in raw[kind]])
    lead = logs[first] if first is not None else _RankLog()
    applied = [(t - origin, loss) for t, loss in lead.losses]
    flagged = sorted({m.rank for m in marks if m.kind == "straggler" and m.rank is not None} | _flagged(status))
    if skipped:
        notes.append(f"{skipped} unreadable line(s) skipped")
    return Timeline(
        start=start,
        loss=downsample([x for x, _ in applied], [y for _, y in applied]),
        steps_per_s=steps_per_s([t - origin for t, _ in lead.applied]),
        redone=tuple((a - origin, b - origin) for a, b in _redone(lead.applied, raw["launch"])),
        step_time={
            rank: downsample([t - origin for t, _ in log.step_times], [s for _, s in log.step_times], center="median")
            for rank, log in logs.items()
        },
        marks=tuple(marks),
        counts={kind: len(raw[kind]) for kind in KINDS},
        steps=lead.steps,
        state=status.get("state") if isinstance(status.get("state"), str) else None,
        goodput=_ratio(status.get("goodput")),
        startup_s=_startup(status.get("goodput")),
        flagged=tuple(flagged),
        notes=tuple(notes),
    )


def _redone(
    applied: list[tuple[float, int]], launches: list[tuple[float, dict[str, Any]]]
) -> Iterator[tuple[float, float]]:
    """For each relaunch from step R, the span of the attempt before it that trained past R: work done again."""
    applied = sorted(applied)
    times = [t for t, _ in applied]
    previous: float | None = None
    for launched, event in sorted(launches, key=lambda item: item[0]):
        resume = event["resume_step"] if _is_count(event.get("resume_step")) else 0
        begin = 0 if previous is None else bisect.bisect_left(times, previous)  # the attempt before this launch
        end = i = bisect.bisect_left(times, launched)
        while i > begin and applied[i - 1][1] > resume:
            i -= 1
        if i < end:  # from its step R (or its first step) to its last
            yield times[max(i - 1, begin)], times[end - 1]
        previous = launched


def _flagged(status: dict[str, Any]) -> set[int]:
    entries = status.get("stragglers")
    if not isinstance(entries, list):
        return set()
    return {e["rank"] for e in entries if isinstance(e, dict) and _is_count(e.get("rank"))}


def _mark(kind: str, t: float, event: dict[str, Any]) -> Mark:
    rank = event.get("rank") if _is_count(event.get("rank")) and kind != "skipped" else None  # skipped: all ranks
    step = event.get("step") if _is_count(event.get("step")) else None
    return Mark(kind, t, label=_label(kind, event, rank, step), rank=rank, step=step)


def _label(kind: str, event: dict[str, Any], rank: int | None, step: int | None) -> str:
    at = f" @ step {step}" if step is not None else ""
    if kind in ("crash", "hang"):
        who = f"rank {rank}" if rank is not None else _text(event.get("node"), "node ")
        return f"{who}{at}"
    if kind == "straggler":
        slower = _number(event.get("slower_by"))
        return f"rank {rank}" + (f" {slower:+.0%}" if slower is not None else "") if rank is not None else ""
    if kind == "rollback":
        resume, batch = event.get("resume_at_most"), event.get("skip_to_batch")
        if _is_count(resume) and _is_count(batch):
            return f"back to <= {resume}, skip to batch {batch}"
        return "rollback"
    if kind == "launch":
        resume, source = event.get("resume_step"), _text(event.get("resume_source"), " (")
        return f"from step {resume}{source and source + ')'}" if _is_count(resume) else "fresh"
    if kind == "stop":
        return f"{event.get('event')}{at}"
    return f"step {step}" if step is not None else ""


def _text(value: object, prefix: str) -> str:
    if isinstance(value, str) and value.isprintable():
        return prefix + value[:40]
    return ""


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 53


def _unique_skips(logs: Iterable[_RankLog]) -> Iterator[tuple[float, dict[str, Any]]]:
    """Every rank logs a step the guard skipped: once per (attempt, step, batch), at its first rank's time."""
    seen: set[tuple[int, int, int]] = set()
    for log in logs:
        for t, event, launch in log.skips:
            key = (launch, event["step"], event["batch"])
            if key not in seen:
                seen.add(key)
                yield t, event


class _Reader:
    """Bounded, symlink-refusing reads of one run dir's files; what could not be read goes to `notes`."""

    def __init__(self, root: Path, notes: list[str]) -> None:
        self.root, self.notes, self.skipped = root, notes, 0

    def events(self, path: Path) -> Iterator[tuple[float, dict[str, Any]]]:
        """(epoch seconds, event) for each line that is a JSON object with a readable `time`."""
        for line in self._lines(path):
            event = _parse(line)
            t = _epoch(event.get("time")) if event is not None else None
            if event is None or t is None:
                self.skipped += 1
                continue
            yield t, event

    def ranks(self) -> list[int]:
        try:
            fd = open_dir(self.root, self.root / "ranks", create=False)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            self.notes.append(f"ranks/: not read: {_why(exc)}")
            return []
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        ranks = sorted(int(m.group(1)) for name in names if (m := _RANK_DIR.fullmatch(name)))
        if len(ranks) > MAX_RANKS:
            self.notes.append(f"ranks/: only the first {MAX_RANKS} of {len(ranks)} ranks read")
        return ranks[:MAX_RANKS]

    def state(self, path: Path) -> dict[str, Any]:
        data = b"".join(line + b"\n" for line in self._lines(path, MAX_STATE_BYTES))
        parsed = _parse(data) if data else None
        return parsed or {}

    def _lines(self, path: Path, limit: int | None = None) -> Iterator[bytes]:
        limit = MAX_LOG_BYTES if limit is None else limit
        relative = path.relative_to(self.root)
        try:
            fd = _open_regular_in(self.root, path)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.notes.append(f"{relative}: not read: {_why(exc)}")
            return
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                self.notes.append(f"{relative}: only its last {limit >> 20} MiB read (of {size >> 20} MiB)")
            yield from _split_lines(fd, size, limit)
        except OSError as exc:
            self.notes.append(f"{relative}: read failed: {_why(exc)}")
        finally:
            os.close(fd)


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))[:200]


def _open_regular_in(root: Path, path: Path) -> int:
    """A read-only descriptor for the regular file `path`, reached from `root` through no symlink, never waiting."""
    dir_fd = open_dir(root, path.parent, create=False)
    try:
        fd = os.open(path.name, _READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(errno.ELOOP, "a symbolic link (not followed)", str(path)) from None
        raise
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(errno.EINVAL, "not a regular file", str(path))
    return fd


def _split_lines(fd: int, size: int, limit: int) -> Iterator[bytes]:
    """The lines of the file's last `limit` bytes, a partial first line dropped; a line over MAX_LINE_BYTES comes
    out empty (so it is counted as unreadable)."""
    fragment = size > limit  # starting mid-file: the first line is a fragment
    if fragment:
        os.lseek(fd, size - limit, os.SEEK_SET)
    budget, pending, overlong = limit, b"", False
    while budget > 0 and (chunk := os.read(fd, min(_CHUNK, budget))):
        budget -= len(chunk)
        *complete, tail = chunk.split(b"\n")
        if complete:
            complete[0], pending = pending + complete[0], b""
            for line in complete:
                if fragment:
                    fragment = False
                else:
                    yield b"" if overlong or len(line) > MAX_LINE_BYTES else line
                overlong = False
        pending += tail
        if len(pending) > MAX_LINE_BYTES:  # no end in sight: skip up to the next newline
            pending, overlong = b"", True
    if (pending or overlong) and not fragment:
        yield b"" if overlong else pending


def _parse(line: bytes) -> dict[str, Any] | None:
    """A JSON object, or None. NaN and Infinity are read as floats (a rank logs a NaN loss as NaN); an integer past
    Python's digit limit and nesting past its recursion limit are refused; values are checked where used."""
    try:
        value = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return value if isinstance(value, dict) else None


def _epoch(value: object) -> float | None:
    """ISO-8601 (structlog's `time`, UTC) as epoch seconds; None for anything else."""
    if not isinstance(value, str) or len(value) > 40:
        return None
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def _number(value: object) -> float | None:
    if not _is_number(value) or not math.isfinite(value):
        return None
    return float(value)


def _is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return type(value) in (int, float)


@dataclass
class _RankLog:
    """What one rank's event log says, in epoch seconds."""

    first: float | None = None
    steps: int = 0
    losses: list[tuple[float, float]] = field(default_factory=list)  # applied steps with a finite loss
    applied: list[tuple[float, int]] = field(default_factory=list)  # (time, step) of each applied step
    step_times: list[tuple[float, float]] = field(default_factory=list)
    saves: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    skips: list[tuple[float, dict[str, Any], int]] = field(default_factory=list)  # with the launch it belongs to

    @classmethod
    def read(cls, reader: _Reader, path: Path, launches: list[float]) -> _RankLog:
        log = cls()
        for t, event in reader.events(path):
            if log.first is None:
                log.first = t
            name = event.get("event")
            if name == "step":
                log._step(t, event)
            elif name == "checkpoint_saved" and _is_count(event.get("step")):
                log.saves.append((t, event))
            elif name == "step_skipped" and _is_count(event.get("step")) and _is_count(event.get("batch")):
                log.skips.append((t, event, sum(1 for launched in launches if launched <= t)))
        return log

    def _step(self, t: float, event: dict[str, Any]) -> None:
        step_time = _number(event.get("step_time_s"))
        if step_time is not None and step_time >= 0:
            self.step_times.append((t, step_time))
        if event.get("skipped") is not False or not _is_count(event.get("step")):
            return
        self.steps = max(self.steps, event["step"])
        self.applied.append((t, event["step"]))
        loss = _number(event.get("loss"))
        if loss is not None:
            self.losses.append((t, loss))


# ---- downsampling ---------------------------------------------------------------------------------------------


def downsample(xs: Sequence[float], ys: Sequence[float], max_points: int = MAX_POINTS, center: str = "mean") -> Series:
    """At most `max_points` points: the points themselves (sorted by x) where there are few, else one per non-empty
    equal-width x bin: its mean or median, with the bin's min and max (so the extremes survive)."""
    points = sorted(zip(xs, ys, strict=True))
    if len(points) <= max_points:
        ys_sorted = tuple(y for _, y in points)
        return Series(tuple(x for x, _ in points), ys_sorted, ys_sorted, ys_sorted)
    lo, hi = points[0][0], points[-1][0]
    width = (hi - lo) / max_points or 1.0
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        bins.setdefault(min(int((x - lo) / width), max_points - 1), []).append((x, y))
    out: list[tuple[float, float, float, float]] = []
    for members in bins.values():  # filled in x order
        values = sorted(y for _, y in members)
        middle = values[len(values) // 2] if center == "median" else sum(values) / len(values)
        out.append((sum(x for x, _ in members) / len(members), middle, values[0], values[-1]))
    return Series(*(tuple(column) for column in zip(*out, strict=True)))


def steps_per_s(times: Sequence[float], max_points: int = 500) -> Series:
    """Applied steps per second in equal time bins of about 10 steps each (at most `max_points` bins); a bin
    with no step (a restart, a hang) reads 0."""
    times = sorted(times)
    if len(times) < 2 or times[-1] <= times[0]:
        return Series()
    bins = max(1, min(max_points, len(times) // 10))
    width = (times[-1] - times[0]) / bins
    counts = [0] * bins
    for t in times:
        counts[min(int((t - times[0]) / width), bins - 1)] += 1
    xs = tuple(times[0] + (i + 0.5) * width for i in range(bins))
    rates = tuple(c / width for c in counts)
    return Series(xs, rates, rates, rates)


def cluster(marks: Sequence[Mark], max_marks: int = MAX_MARKS) -> list[Mark]:
    """The marks as they are where at most `max_marks`, else one per non-empty equal time bin, with its count."""
    if len(marks) <= max_marks:
        return list(marks)
    marks = sorted(marks, key=lambda m: m.t)
    lo, hi = marks[0].t, marks[-1].t
    width = (hi - lo) / max_marks or 1.0
    bins: dict[int, list[Mark]] = {}
    for mark in marks:
        bins.setdefault(min(int((mark.t - lo) / width), max_marks - 1), []).append(mark)
    return [
        Mark(group[0].kind, group[0].t, label=f"x{len(group)}", count=len(group), t_end=group[-1].t)
        for group in bins.values()
    ]


# ---- drawing --------------------------------------------------------------------------------------------------

_STYLE = {  # kind: (marker, colour)
    "crash": ("X", "tab:red"),
    "hang": ("D", "tab:orange"),
    "rollback": ("<", "tab:purple"),
    "skipped": ("v", "goldenrod"),
    "checkpoint": ("|", "tab:green"),
    "stop": ("s", "black"),
    "launch": ("^", "tab:blue"),
    "straggler": ("o", "tab:brown"),
}
_LINED = ("crash", "hang", "rollback", "stop", "launch")  # also drawn as a faint line through every panel
_LABELLED = ("crash", "hang", "rollback", "skipped", "stop", "launch", "straggler")


def _matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(NEEDS_MATPLOTLIB) from None
    return Figure, FigureCanvasAgg


def render(timeline: Timeline, path: Path, *, title: str = "run", dpi: int = 100) -> None:
    """Draw `timeline` (Agg, no display) and write it to `path` as a PNG, atomically."""
    figure_class, canvas_class = _matplotlib()
    fig = figure_class(figsize=(12, 9.5), layout="constrained")
    canvas_class(fig)
    loss_ax, rate_ax, event_ax, time_ax = fig.subplots(4, 1, sharex=True, height_ratios=[3, 2, 2.2, 2.2])
    scale, unit = _time_unit(timeline)
    _draw_loss(loss_ax, timeline.loss, scale)
    _draw_series(rate_ax, timeline.steps_per_s, scale, "tab:blue", steps=True)
    rate_ax.set_ylabel("steps/s (applied)")
    rate_ax.set_ylim(bottom=0)
    _draw_events(event_ax, timeline, scale)
    _draw_step_times(time_ax, timeline, scale)
    time_ax.set_xlabel(f"time since the run's first event ({unit})")
    for ax in (loss_ax, rate_ax, time_ax):
        _draw_lines(ax, timeline.marks, scale)
        ax.grid(True, alpha=0.3)
    for ax in (loss_ax, rate_ax):
        for i, (begin, end) in enumerate(timeline.redone):
            ax.axvspan(
                begin / scale,
                end / scale,
                color="tab:red",
                alpha=0.1,
                linewidth=0,
                label="lost work: done again after a failure" if i == 0 and ax is loss_ax else None,
            )
    if timeline.redone:
        loss_ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(_title(timeline, title), fontsize=11)
    root = path.parent.resolve()
    atomic_write(root / path.name, lambda f: _save(fig, f, dpi), root=root, durable=False)


def _save(fig: Any, f: IO[bytes], dpi: int) -> None:
    fig.savefig(f, format="png", dpi=dpi)


def _ratio(goodput: Any) -> float | None:
    """The goodput block's ratio, if it is one (state.json is untrusted)."""
    ratio = goodput.get("ratio") if isinstance(goodput, dict) else None
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 <= ratio <= 1:
        return float(ratio)
    return None


def _startup(goodput: Any) -> float | None:
    """The goodput block's start-up seconds, if they are a finite number."""
    seconds = goodput.get("startup_s") if isinstance(goodput, dict) else None
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < math.inf:
        return float(seconds)
    return None


def _title(timeline: Timeline, name: str) -> str:
    when = ""
    if timeline.start is not None:
        moment = datetime.datetime.fromtimestamp(timeline.start, datetime.timezone.utc)
        when = f", started {moment:%Y-%m-%d %H:%M} UTC"
    state = f" ({timeline.state})" if timeline.state else ""
    return f"{name}{state}: {timeline.summary()}{when}"


def _time_unit(timeline: Timeline) -> tuple[float, str]:
    ends = [m.t for m in timeline.marks] + list(timeline.loss.x[-1:]) + list(timeline.steps_per_s.x[-1:])
    span = max(ends, default=0.0)
    for limit, scale, unit in ((900, 1, "s"), (36_000, 60, "min"), (3 * 86_400, 3600, "h")):
        if span <= limit:
            return scale, unit
    return 86_400, "days"


def _breaks(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """NaN between points far apart (downtime), so the line shows a gap instead of bridging it."""
    gaps = sorted(b - a for a, b in zip(xs, xs[1:], strict=False))
    if not gaps:
        return list(xs), list(ys)
    limit = 20 * max(gaps[len(gaps) // 2], 1e-9)
    out_x, out_y = [xs[0]], [ys[0]]
    for a, b, y in zip(xs, xs[1:], ys[1:], strict=False):
        if b - a > limit:
            out_x.append((a + b) / 2)
            out_y.append(math.nan)
        out_x.append(b)
        out_y.append(y)
    return out_x, out_y


def _draw_series(
    ax: Any,
    series: Series,
    scale: float,
    colour: str,
    *,
    steps: bool = False,
    label: str | None = None,
    width: float = 1.2,
) -> None:
    xs = [x / scale for x in series.x]
    if steps:
        ax.plot(xs, series.y, color=colour, drawstyle="steps-mid", linewidth=width, label=label)
        return
    line_x, line_y = _breaks(xs, series.y)
    ax.plot(line_x, line_y, color=colour, linewidth=width, label=label)


def _draw_loss(ax: Any, loss: Series, scale: float) -> None:
    xs = [x / scale for x in loss.x]
    if loss.low != loss.y:  # downsampled: the spread of each bin behind its mean
        ax.fill_between(xs, loss.low, loss.high, color="tab:blue", alpha=0.2, linewidth=0)
    _draw_series(ax, loss, scale, "tab:blue")
    ax.set_ylabel("loss (rank 0)")
    if loss.low and min(loss.low) > 0 and max(loss.high) / min(loss.low) > 50:
        ax.set_yscale("log")
    if not loss.x:
        ax.text(0.5, 0.5, "no step events", transform=ax.transAxes, ha="center", color="grey")


def _draw_events(ax: Any, timeline: Timeline, scale: float) -> None:
    lanes = {kind: len(KINDS) - 1 - i for i, kind in enumerate(KINDS)}
    for kind in KINDS:
        marks = [m for m in timeline.marks if m.kind == kind]
        marker, colour = _STYLE[kind]
        if marks:
            sizes = [36 * (1 + math.log2(m.count)) for m in marks]
            ax.scatter(
                [m.t / scale for m in marks], [lanes[kind]] * len(marks), s=sizes, marker=marker, color=colour, zorder=3
            )
        if kind in _LABELLED and 0 < len(marks) <= 12:
            for m in marks:
                ax.annotate(
                    m.label,
                    (m.t / scale, lanes[kind]),
                    xytext=(4, 5),
                    textcoords="offset points",
                    fontsize=7,
                    color=colour,
                )
    ax.set_yticks(list(lanes.values()), [f"{kind} ({timeline.counts[kind]})" for kind in KINDS], fontsize=8)
    ax.set_ylim(-0.7, len(KINDS) - 0.3)
    ax.grid(True, axis="x", alpha=0.3)


def _draw_lines(ax: Any, marks: Sequence[Mark], scale: float) -> None:
    lined = [m for m in marks if m.kind in _LINED]
    if len(lined) > 50:  # a line per event would hide the curves
        return
    for m in lined:
        ax.axvline(
            m.t / scale,
            color=_STYLE[m.kind][1],
            alpha=0.35,
            linewidth=0.8,
            linestyle=":" if m.kind == "launch" else "--",
        )


def _draw_step_times(ax: Any, timeline: Timeline, scale: float) -> None:
    shown = _ranks_shown(timeline)
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan", "tab:pink", "tab:olive"]
    for i, rank in enumerate(shown):
        flagged = rank in timeline.flagged
        _draw_series(
            ax,
            timeline.step_time[rank],
            scale,
            "tab:brown" if flagged else palette[i % len(palette)],
            label=f"rank {rank}" + (" (straggler)" if flagged else ""),
            width=2.0 if flagged else 1.0,
        )
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    if shown:
        hidden = len(timeline.step_time) - len(shown)
        ax.legend(
            loc="upper right",
            fontsize=7,
            ncols=min(4, len(shown)),
            title=f"{hidden} more ranks not drawn" if hidden else None,
            title_fontsize=7,
        )


def _ranks_shown(timeline: Timeline) -> list[int]:
    """Every rank where few; else rank 0, the flagged ones and the slowest (by median step time)."""
    ranks = [r for r, s in timeline.step_time.items() if s.x]
    if len(ranks) <= RANKS_DRAWN:
        return ranks
    slowest = sorted(ranks, key=lambda r: -_median(timeline.step_time[r].y))
    chosen = list(dict.fromkeys([min(ranks), *[r for r in timeline.flagged if r in ranks], *slowest]))
    return sorted(chosen[:RANKS_DRAWN])


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
