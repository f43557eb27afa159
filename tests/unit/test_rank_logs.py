"""Reading a rank's newest events from the end of its JSON-lines log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.rundir.rank_logs import TAIL_BYTES, device_verdict, device_verdicts, last_event, last_step
from worker.contract import RunLayout


def write_log(layout: RunLayout, rank: int, events: list[dict], tail: str = "") -> None:
    """Rank `rank`'s event log holding `events`, one JSON object a line, then `tail` verbatim."""
    path = layout.rank_events(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail, encoding="utf-8")


ABORT_0 = {
    "event": "anomaly_abort",
    "attempt": 0,
    "step": 9,
    "batch": 11,
    "first_anomaly_step": 9,
    "first_anomaly_batch": 9,
}
ABORT_1 = {
    "event": "anomaly_abort",
    "attempt": 1,
    "step": 30,
    "batch": 52,
    "first_anomaly_step": 30,
    "first_anomaly_batch": 50,
}


def test_last_event_finds_the_newest_event_of_its_name_and_attempt(tmp_path: Path):
    """Of several events named alike in one attempt, the newest is returned whole."""
    layout = RunLayout(tmp_path)
    older = {**ABORT_0, "step": 5}
    write_log(
        layout,
        0,
        [
            older,
            {"event": "step", "attempt": 0, "step": 8},
            ABORT_0,
            {"event": "rank_finished", "attempt": 0, "step": 9},
        ],
    )
    assert last_event(layout, 0, 0, "anomaly_abort") == ABORT_0


def test_last_event_skips_other_attempts(tmp_path: Path):
    """An event of a later or earlier attempt is not taken for the asked attempt's."""
    layout = RunLayout(tmp_path)
    write_log(
        layout,
        0,
        [ABORT_0, {"event": "step", "attempt": 1, "step": 1}, ABORT_1, {"event": "step", "attempt": 2, "step": 1}],
    )
    assert last_event(layout, 0, 0, "anomaly_abort") == ABORT_0
    assert last_event(layout, 0, 1, "anomaly_abort") == ABORT_1
    assert last_event(layout, 0, 2, "anomaly_abort") is None


def test_last_event_skips_other_names(tmp_path: Path):
    """Events with another name, or none, are passed over."""
    layout = RunLayout(tmp_path)
    write_log(layout, 0, [{"event": "step", "attempt": 0, "step": 3}, {"attempt": 0, "step": 4}])
    assert last_event(layout, 0, 0, "anomaly_abort") is None
    assert last_event(layout, 0, 0, "step") == {"event": "step", "attempt": 0, "step": 3}


def test_last_event_passes_over_a_line_that_only_mentions_the_name(tmp_path: Path):
    """A line is parsed only where the name could be its event's; one that names it elsewhere is still not it."""
    layout = RunLayout(tmp_path)
    mentions = {"event": "step", "attempt": 0, "step": 10, "note": "anomaly_abort"}
    write_log(layout, 0, [ABORT_0, mentions, {"event": "step", "attempt": 0, "step": 11}])
    assert last_event(layout, 0, 0, "anomaly_abort") == ABORT_0


def test_last_event_skips_torn_and_non_object_lines(tmp_path: Path):
    """A torn last line, a garbage line and a bare JSON value are skipped on the way to the newest event."""
    layout = RunLayout(tmp_path)
    write_log(layout, 0, [ABORT_0], tail='17\n[1, 2]\nnot json\n{"event": "anomaly_abort", "attempt": 0, "st')
    assert last_event(layout, 0, 0, "anomaly_abort") == ABORT_0


def test_last_event_reads_only_the_asked_rank(tmp_path: Path):
    """Each rank's log is read on its own: rank 1's event is not rank 0's."""
    layout = RunLayout(tmp_path)
    write_log(layout, 1, [ABORT_0])
    write_log(layout, 0, [{"event": "step", "attempt": 0, "step": 9}])
    assert last_event(layout, 1, 0, "anomaly_abort") == ABORT_0
    assert last_event(layout, 0, 0, "anomaly_abort") is None


def test_last_event_of_a_missing_file_is_none(tmp_path: Path):
    """A rank that never wrote an event log has no last event."""
    assert last_event(RunLayout(tmp_path), 0, 0, "anomaly_abort") is None


def test_last_event_of_an_empty_file_is_none(tmp_path: Path):
    """An empty event log has no last event."""
    layout = RunLayout(tmp_path)
    write_log(layout, 0, [])
    assert last_event(layout, 0, 0, "step") is None


def test_last_event_in_a_log_longer_than_the_tail(tmp_path: Path):
    """In a log longer than TAIL_BYTES the newest event is found past the torn line the tail starts in."""
    layout = RunLayout(tmp_path)
    steps = [{"event": "step", "attempt": 0, "step": s, "pad": "x" * 100} for s in range(1, 2 * TAIL_BYTES // 100)]
    write_log(layout, 0, [*steps, ABORT_0])
    assert layout.rank_events(0).stat().st_size > TAIL_BYTES
    assert last_event(layout, 0, 0, "anomaly_abort") == ABORT_0
    assert last_event(layout, 0, 0, "step") == steps[-1]


def test_last_event_beyond_the_tail_is_not_found(tmp_path: Path):
    """An event older than the log's last TAIL_BYTES is not looked for."""
    layout = RunLayout(tmp_path)
    steps = [{"event": "step", "attempt": 0, "step": s, "pad": "x" * 100} for s in range(1, 2 * TAIL_BYTES // 100)]
    write_log(layout, 0, [ABORT_0, *steps])
    assert last_event(layout, 0, 0, "anomaly_abort") is None


def test_last_step_is_the_newest_step_event_of_the_attempt(tmp_path: Path):
    """`last_step` is the `step` field of the attempt's newest `step` event, as an int."""
    layout = RunLayout(tmp_path)
    write_log(
        layout,
        0,
        [
            {"event": "step", "attempt": 0, "step": 4},
            {"event": "step", "attempt": 0, "step": 5},
            {"event": "checkpoint_saved", "attempt": 0, "step": 6},
            {"event": "step", "attempt": 1, "step": 2},
        ],
    )
    assert last_step(layout, 0, 0) == 5
    assert last_step(layout, 0, 1) == 2
    assert last_step(layout, 0, 2) is None


def verdict_event(**fields) -> dict:
    """An `sdc_verdict` event as the suspect rank 1 logs it about its own device."""
    event = {"event": "sdc_verdict", "attempt": 0, "step": 7, "batch": 6, "suspect": 1, "verdict": "transient"}
    return {**event, "evidence": "gone on a re-run", "node": "node7", "gpu": 0, **fields}


def test_device_verdicts_are_those_the_heartbeat_counted_as_new_on_the_rank_itself_oldest_first(tmp_path: Path):
    """The verdicts a rank's process counted as its (after, upto]th, by their `count`: later ones the log already
    holds and an earlier process's below are left out; another kind, and an event that does not read as a verdict
    (a gpu that is no index), are passed over."""
    layout = RunLayout(tmp_path)
    events = [
        verdict_event(step=2, count=1),  # an earlier process's
        verdict_event(step=3, count=1),
        verdict_event(step=5, verdict="persistent", count=1),
        verdict_event(step=6, gpu="0; rm -rf /", count=2),
        verdict_event(step=7, count=3),
        verdict_event(step=8, node=None, gpu=None, count=4),
        verdict_event(step=9, count=5),  # logged before the beat that counts it
    ]
    write_log(layout, 1, events, tail='{"event": "sdc_verdict", "attem')
    found = device_verdicts(layout, 1, "transient", 2, 4)
    assert [(v.step, v.node, v.gpu) for v in found] == [(7, "node7", 0), (8, None, None)]
    assert [v.step for v in device_verdicts(layout, 1, "transient", 0, 4)] == [3, 7, 8]  # 6 does not read
    assert device_verdicts(layout, 1, "persistent", 0, 1)[0].device == "GPU 0 of node7"
    assert device_verdicts(layout, 3, "transient", 0, 1) == []  # no log at all
    # Rank 0 counts the verdicts that name no rank too; they charge no device, and are not mistaken for older ones.
    write_log(layout, 0, [verdict_event(step=3, suspect=0, count=1), verdict_event(step=9, suspect=None, count=2)])
    assert device_verdicts(layout, 0, "transient", 1, 2) == []
    assert [v.step for v in device_verdicts(layout, 0, "transient", 0, 2)] == [3]


def test_a_verdict_with_fields_of_the_wrong_kind_is_refused_by_name():
    """What the rank wrote is not trusted: each field is checked, and a long one is cut."""
    for bad, word in (({"verdict": "data"}, "verdict"), ({"node": 7}, "node"), ({"step": -1}, "step")):
        with pytest.raises(ValueError, match=word):
            device_verdict(verdict_event(**bad))
    assert len(device_verdict(verdict_event(evidence="x" * 10_000)).evidence) == 1000
