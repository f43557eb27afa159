"""Property-based fuzzing of every reader of a run-dir file: whatever bytes a file holds, the reader returns a
value or its own documented error, and never lets another exception escape into the supervisor."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.stop_requests import StopFileUnparsable, StopRequest, parse_stop_file
from supervisor.launch.trees import kill_predecessor_leftovers
from supervisor.observe.status import StatusError, read_history, read_status, render
from supervisor.rundir.rank_logs import abort_info, last_event, last_step
from supervisor.rundir.watch import HeartbeatUnreadable, read_heartbeat
from supervisor.runner import _previous_status, _previous_step_gaps
from worker.contract import RunLayout, StopOrder
from worker.files import parse_json
from worker.orders import StopOrders
from worker.store import Choice, choose_resume, health_entries

# A fixed budget per property, so the whole file runs in CI in seconds, the same examples every time.
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=25,
)
HEARTBEAT_KEYS = ("attempt", "rank", "seq", "step", "phase", "step_time_s", "pid", "time", "inexact", "slow_saves")
HOSTILE_TEXT = st.sampled_from(
    [
        "NaN",
        "Infinity",
        "-Infinity",
        "1e999",
        "1" * 400,
        "[" * 2000,
        '{"a":1,"a":2}',
        "\ud800",
        "\x00",
        "null",
        "[]",
        '"x"',
        "-1",
        "true",
    ]
)


def _raw(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogatepass")  # a lone surrogate: bytes that are not UTF-8


def records(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects made mostly of the keys a reader looks for, holding values of every type."""
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), JSON, max_size=len(keys) + 2)


def contents(keys: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """What a hostile process may leave in a JSON file: records of the right shape with wrong values,
    any JSON, JSON that is not strict, and raw bytes."""
    as_json = (records(keys) | JSON).map(lambda value: json.dumps(value).encode())
    spliced = st.tuples(records(keys), st.sampled_from(keys), HOSTILE_TEXT).map(
        lambda t: json.dumps({**t[0], t[1]: 0}).replace(f'"{t[1]}": 0', f'"{t[1]}": {t[2]}')
    )
    return as_json | spliced.map(_raw) | HOSTILE_TEXT.map(_raw) | st.binary(max_size=300)


@pytest.fixture
def run() -> Iterator[RunLayout]:
    """A fresh run dir per fixture use (hypothesis reuses the fixture, so each example rewrites its file)."""
    root = Path(tempfile.mkdtemp(prefix="tw-fuzz-"))
    yield RunLayout(root)
    shutil.rmtree(root, ignore_errors=True)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@FUZZ
@given(data=contents(HEARTBEAT_KEYS))
def test_heartbeat_reader_returns_a_beat_or_says_unreadable(run: RunLayout, data: bytes) -> None:
    """Any heartbeat.json content gives a well-typed beat for rank 0 or HeartbeatUnreadable."""
    _write(run.heartbeat(0), data)
    try:
        beat = read_heartbeat(run.heartbeat(0), 0)
    except HeartbeatUnreadable:
        return
    assert beat is not None and beat.rank == 0
    assert all(type(v) is int and v >= 0 for v in (beat.attempt, beat.seq, beat.step))
    assert isinstance(beat.phase, str) and beat.phase.isprintable()
    assert beat.step_time_s is None or beat.step_time_s > 0
    assert beat.inexact is None or (isinstance(beat.inexact, str) and beat.inexact.isprintable())
    slow = beat.slow_saves
    assert slow is None or (min(slow.write_s, slow.interval_s) >= 0 and slow.setting.isprintable())


ABORT_KEYS = ("event", "attempt", "step", "batch", "first_anomaly_step", "first_anomaly_batch", "suspect_ranks")


@FUZZ
@given(lines=st.lists(contents(ABORT_KEYS), max_size=6))
def test_rank_event_log_readers_never_raise(run: RunLayout, lines: list[bytes]) -> None:
    """Any lines in a rank's events.jsonl give an event dict or None, and abort/step readers a value or ValueError."""
    _write(run.rank_events(0), b"\n".join(line.replace(b"\n", b" ") for line in lines))
    for name in ("anomaly_abort", "step", "stop_order_done"):
        event = last_event(run, 0, 0, name)
        assert event is None or (isinstance(event, dict) and event["event"] == name)
    step = last_step(run, 0, 0)
    assert step is None or (type(step) is int and step >= 0)
    try:
        abort = abort_info(last_event(run, 0, 0, "anomaly_abort"))
    except ValueError:
        return
    assert min(abort.first_step, abort.abort_step, abort.first_batch, abort.abort_batch) >= 0


@FUZZ
@given(data=st.binary(max_size=64) | HOSTILE_TEXT.map(_raw) | st.text(max_size=30).map(str.encode))
def test_stop_file_parser_gives_a_request_or_says_why_not(data: bytes) -> None:
    """Any stop file content is a well-formed request or StopFileUnparsable; control bytes never mean 'stop now'."""
    try:
        request = parse_stop_file(data, "stop file")
    except StopFileUnparsable:
        return
    assert isinstance(request, StopRequest) and (request.step is None or request.step > 0)
    text = data.decode("utf-8")
    assert all(c.isprintable() or c.isspace() for c in text)


STATUS_KEYS = (
    "state",
    "attempt",
    "restarts",
    "max_restarts",
    "ranks",
    "run_dir",
    "supervisor_pid",
    "updated_at",
    "last_checkpoint",
    "resumed_from",
    "passed_over",
    "heartbeats",
    "hang",
    "rollback",
    "stop_order",
    "last_failure",
    "cause",
    "failures",
    "reason",
    "calibration",
)


@FUZZ
@given(
    data=contents(STATUS_KEYS),
    ranks=st.lists(records(("rank", "pid", "step", "heartbeat_age_s", "heartbeat_phase", "returncode")), max_size=3),
)
def test_state_file_reader_gives_a_renderable_status_or_status_error(
    run: RunLayout, data: bytes, ranks: list[dict[str, Any]]
) -> None:
    """Any state.json is a status `render` can print, or StatusError; calibration reads only positive numbers."""
    with contextlib.suppress(ValueError):
        record = parse_json(data)
        if isinstance(record, dict):  # a whole state object, with rank entries of every shape
            data = json.dumps({**record, "ranks": ranks}).encode()
    _write(run.state_file, data)
    with contextlib.suppress(StatusError):
        assert isinstance(render(read_status(run)), str)
    previous = _previous_status(run)  # {} for a state file read_status refuses, as the runner takes it
    gaps = _previous_step_gaps(previous, 50)
    assert len(gaps) <= 50 and all(isinstance(g, float) and g > 0 for g in gaps)
    history = read_history(previous)
    assert history is None or history.attempt >= 0


@FUZZ
@given(
    data=contents(("supervisor_pid", "processes", "pid", "create_time", "name")),
    processes=st.lists(records(("pid", "create_time", "name")), max_size=4),
)
def test_pids_file_reader_kills_nothing_that_is_not_of_this_run(
    run: RunLayout, data: bytes, processes: list[dict[str, Any]]
) -> None:
    """Forged pids.json records (this process's pid, pid 1, garbage) never lead to a kill."""
    forged = [{"pid": 1, "create_time": 0.0}, *processes]
    _write(run.pids_file, data if processes == [] else json.dumps({"processes": forged}).encode())
    assert kill_predecessor_leftovers(run) == []


RECORD_KEYS = ("step", "file", "size", "crc32", "is_health", "health_reasons", "embedding_local_norm")


@FUZZ
@given(record=contents(RECORD_KEYS), checkpoint=st.binary(max_size=64))
def test_checkpoint_choice_survives_any_completion_record(run: RunLayout, record: bytes, checkpoint: bytes) -> None:
    """Any completion record makes its checkpoint chosen only if it matches the file, else passed over with a reason."""
    store = run.checkpoints
    _write(store.file(0, 10, "demo"), checkpoint)
    _write(store.record(0, 10, "demo"), record)
    choice = choose_resume([store], 1, "demo")
    assert isinstance(choice, Choice)
    if choice.step is None:
        assert [step for step, _ in choice.passed_over] == [10] and isinstance(choice.passed_over[0][1], str)
    else:
        assert parse_json(record)["size"] == len(checkpoint)
    [entry] = health_entries(store, 1, "demo", [10])
    assert entry["is_health"] in (0, 1)


@FUZZ
@given(data=contents(("id", "step", "exit")))
def test_stop_order_poll_gives_an_order_or_none(run: RunLayout, data: bytes) -> None:
    """A rank polling any stop_order.json content gets a StopOrder or None, never an exception."""
    _write(run.stop_order, data)
    order = StopOrders(run.stop_order).poll()
    assert order is None or isinstance(order, StopOrder)
