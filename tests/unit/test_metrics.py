"""Prometheus metrics from the status dict: names, labels and values; absent or junk keys left out; restart counts."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import ConfigError, MetricsConfig, parse_config
from supervisor.core import Failure, Policy, RanksLaunched, decide, initial_state
from supervisor.core.causes import Cause, CauseKind
from supervisor.observe.metrics import CAUSES, PHASES, MetricsExporter, RestartCounts, StatusCollector, families
from supervisor.observe.status import snapshot
from worker.contract import RunLayout
from worker.store import completed_at

NOW = 1_700_000_000.0  # wall clock
POLICY = Policy(
    nproc=2, max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=5.0, kill_grace_s=10.0
)


class Log:
    """A journal logger that keeps what it is told."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.records.append((level, event, fields))


def samples(status: dict[str, Any], restarts: dict[str, int] | None = None, now: float = NOW) -> dict[Any, float]:
    """{(sample name, labels as sorted tuples): value} of the exposition text for `status`, read back with
    prometheus_client's own parser (so the text is valid)."""

    class Fixed:
        def collect(self) -> Any:
            return families(status, restarts or RestartCounts().update(status), now=now)

    registry = CollectorRegistry()
    registry.register(Fixed())
    found: dict[Any, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def full_status() -> dict[str, Any]:
    """A status as the runner writes it mid-run, with every observer's block."""
    return {
        "state": "running",
        "attempt": 2,
        "restarts": 2,
        "max_restarts": 3,
        "updated_at": NOW - 0.5,
        "ranks": [
            {
                "rank": 0,
                "pid": 10,
                "step": 120,
                "heartbeat_age_s": 0.25,
                "heartbeat_phase": "train",
                "returncode": None,
            },
            {"rank": 1, "pid": 11, "step": 119, "heartbeat_age_s": None, "heartbeat_phase": None, "returncode": None},
        ],
        "failures": [
            {"attempt": 0, "rank": 1, "kind": "exception", "cause": "ValueError: boom"},
            {"attempt": 1, "rank": 0, "kind": "hang", "cause": "hang in train"},
        ],
        "last_checkpoint": {"step": 100},
        "last_checkpoint_at": NOW - 42.0,
        "progress": {"step": 120, "total_steps": 600, "loss": 2.5, "steps_per_s": 4.0, "eta_s": 120.0, "attempt": 2},
        "goodput": {
            "wall_s": 100.0,
            "productive_s": 80.0,
            "lost_s": 5.0,
            "restart_s": 10.0,
            "save_s": 3.0,
            "hang_s": 2.0,
            "stopped_s": 0.0,
            "ratio": 0.8,
        },
        "stragglers": [{"rank": 1, "compute_s": 0.2, "median_s": 0.15, "slower_by": 0.33}],
        "rank_compute_s": {"0": 0.1, "1": 0.2, "7": 0.3},  # rank 7 is no rank of this run: not exported
    }


def test_a_full_status_gives_every_metric_with_its_labels():
    """Each block of the status becomes its metrics: progress, goodput, per-rank gauges, restarts by cause."""
    found = samples(full_status())
    expected = {
        ("trainwarden_step", ()): 120,
        ("trainwarden_total_steps", ()): 600,
        ("trainwarden_loss", ()): 2.5,
        ("trainwarden_steps_per_second", ()): 4.0,
        ("trainwarden_eta_seconds", ()): 120.0,
        ("trainwarden_goodput_ratio", ()): 0.8,
        ("trainwarden_wall_seconds", ()): 100.0,
        ("trainwarden_goodput_seconds", (("category", "productive"),)): 80.0,
        ("trainwarden_goodput_seconds", (("category", "lost"),)): 5.0,
        ("trainwarden_goodput_seconds", (("category", "stopped"),)): 0.0,
        ("trainwarden_attempt", ()): 2,
        ("trainwarden_max_restarts", ()): 3,
        ("trainwarden_run_state", (("state", "running"),)): 1,
        ("trainwarden_run_state", (("state", "failed"),)): 0,
        ("trainwarden_heartbeat_age_seconds", (("rank", "0"),)): 0.75,  # 0.25 when written, 0.5 s ago
        ("trainwarden_rank_step", (("rank", "1"),)): 119,
        ("trainwarden_rank_compute_seconds", (("rank", "1"),)): 0.2,
        ("trainwarden_straggler", (("rank", "0"),)): 0,
        ("trainwarden_straggler", (("rank", "1"),)): 1,
        ("trainwarden_restarts_total", (("cause", "exception"),)): 1,
        ("trainwarden_restarts_total", (("cause", "hang"),)): 1,
        ("trainwarden_restarts_total", (("cause", "oom"),)): 0,
        ("trainwarden_last_checkpoint_step", ()): 100,
        ("trainwarden_last_checkpoint_timestamp_seconds", ()): NOW - 42.0,
        ("trainwarden_checkpoint_age_seconds", ()): 42.0,
    }
    assert {key: found.get(key) for key in expected} == expected
    assert ("trainwarden_heartbeat_age_seconds", (("rank", "1"),)) not in found  # no beat yet: no age
    assert ("trainwarden_rank_compute_seconds", (("rank", "7"),)) not in found


def test_a_rank_entry_may_carry_its_own_compute_time():
    """Without the stragglers observer's `rank_compute_s`, a rank entry's own `compute_s` is exported."""
    found = samples({"state": "running", "ranks": [{"rank": 0, "compute_s": 0.5}, {"rank": 1}]})
    assert {k: v for k, v in found.items() if k[0] == "trainwarden_rank_compute_seconds"} == {
        ("trainwarden_rank_compute_seconds", (("rank", "0"),)): 0.5
    }


def test_every_state_and_cause_is_a_series_from_the_start():
    """run_state has one series per phase (1 for the current one) and restarts_total one per cause, zeros included,
    so rate() and alerts work from the first restart."""
    found = samples({"state": "backoff", "attempt": 0, "restarts": 0})
    assert {labels[0][1]: v for (name, labels), v in found.items() if name == "trainwarden_run_state"} == {
        phase: int(phase == "backoff") for phase in PHASES
    }
    assert {labels[0][1]: v for (name, labels), v in found.items() if name == "trainwarden_restarts_total"} == (
        dict.fromkeys(CAUSES, 0)
    )


def test_a_status_without_observer_blocks_gives_only_what_it_has():
    """No progress, goodput, stragglers or checkpoint: those metrics are left out, the rest is exported."""
    state, _ = decide(initial_state(POLICY), RanksLaunched(0, (100, 101), None), 1000.0)
    found = samples(snapshot(state, now=1000.0, extra={"last_checkpoint": None}))
    names = {name for name, _ in found}
    assert names == {
        "trainwarden_run_state",
        "trainwarden_attempt",
        "trainwarden_restarts_total",
        "trainwarden_max_restarts",
    }


@pytest.mark.parametrize("junk", [None, "12", True, float("nan"), float("inf"), 10**400, [], {}])
def test_a_value_that_is_no_finite_number_is_left_out(junk: Any):
    """A value of the wrong type, NaN, infinity or an int too big for a float is left out, without an error."""
    status = {
        "state": "running",
        "attempt": junk,
        "restarts": junk,
        "updated_at": junk,
        "last_checkpoint_at": junk,
        "ranks": [{"rank": 0, "heartbeat_age_s": junk, "step": junk}, {"rank": junk}, junk],
        "failures": [junk, {"attempt": junk, "kind": junk}],
        "progress": {"step": junk, "loss": junk},
        "goodput": junk,
        "stragglers": [junk],
        "last_checkpoint": {"step": junk},
    }
    names = {name for name, _ in samples(status)}
    assert names == {"trainwarden_run_state", "trainwarden_restarts_total", "trainwarden_straggler"}


@pytest.mark.parametrize("junk", [None, "text", 3, [1], {"a": 1}])
def test_blocks_of_the_wrong_shape_are_ignored(junk: Any):
    """A block that is not the mapping or list it should be is ignored: the status is ours, but tolerance is cheap."""
    status = {
        "state": junk,
        "ranks": junk,
        "failures": junk,
        "progress": junk,
        "goodput": junk,
        "stragglers": junk,
        "last_checkpoint": junk,
    }
    assert samples(status)[("trainwarden_run_state", (("state", "running"),))] == 0


def test_a_checkpoint_completed_in_the_future_is_zero_seconds_old():
    """A completion time ahead of the clock (a record's mtime set forward) gives age 0, never a negative one."""
    found = samples({"state": "running", "last_checkpoint": {"step": 5}, "last_checkpoint_at": NOW + 60})
    assert found[("trainwarden_checkpoint_age_seconds", ())] == 0


def test_restarts_count_a_failure_once_the_next_attempt_is_launched():
    """A failure is not counted while its attempt is current (its cause may still be revised), then once, with its
    final cause, however many statuses show it."""
    counts = RestartCounts()
    assert counts.update({"attempt": 0, "restarts": 0, "failures": [{"attempt": 0, "kind": "exit"}]})["exit"] == 0
    revised = {"attempt": 1, "restarts": 1, "failures": [{"attempt": 0, "kind": "hang"}]}
    assert (counts.update(revised)["hang"], counts.update(revised)["hang"], counts.update(revised)["exit"]) == (1, 1, 0)
    later = {"attempt": 2, "restarts": 2, "failures": [{"attempt": 0, "kind": "hang"}, {"attempt": 1, "kind": "oom"}]}
    result = counts.update(later)
    assert (result["hang"], result["oom"], sum(result.values())) == (1, 1, 2)


def test_restarts_missing_from_the_status_are_counted_as_unknown():
    """Relaunches whose failures the status no longer lists still count, under cause "unknown": the total is
    the status's `restarts`."""
    result = RestartCounts().update({"attempt": 7, "restarts": 7, "failures": [{"attempt": 6, "kind": "signal"}]})
    assert (result["signal"], result["unknown"], sum(result.values())) == (1, 6, 7)


def test_restarts_from_a_real_snapshot():
    """The core's failure history, through snapshot(), counts by the cause kind's value."""
    state = initial_state(POLICY)
    failure = Failure(0, 1, 30, None, Cause(CauseKind.OOM, "killed by SIGKILL (out of memory)"), True)
    state = replace(state, attempt=1, restarts=1, failures=(failure,))
    found = samples(snapshot(state, now=1000.0, extra={}))
    assert found[("trainwarden_restarts_total", (("cause", "oom"),))] == 1


def test_the_collector_serves_the_newest_published_status():
    """Nothing before the first publish; then the newest status, with restarts counted across publishes."""
    registry = CollectorRegistry()
    collector = StatusCollector()
    registry.register(collector)
    assert generate_latest(registry) == b""
    collector.publish({"state": "running", "attempt": 0, "restarts": 0, "progress": {"step": 5}})
    collector.publish(
        {
            "state": "backoff",
            "attempt": 1,
            "restarts": 1,
            "failures": [{"attempt": 0, "kind": "exit"}],
            "progress": {"step": 9},
        }
    )
    text = generate_latest(registry).decode()
    assert "trainwarden_step 9.0" in text
    assert 'trainwarden_run_state{state="backoff"} 1.0' in text
    assert 'trainwarden_restarts_total{cause="exit"} 1.0' in text


def test_exporter_is_a_no_op_when_metrics_are_off():
    """Neither port nor textfile: no registry, nothing imported into the status path, publish does nothing."""
    exporter = MetricsExporter(MetricsConfig(), Log())
    exporter.start()
    exporter.publish({"state": "running"})
    exporter.close()
    assert (exporter.enabled, exporter.registry, exporter.port) == (False, None, None)


def test_textfile_is_rewritten_on_every_publish(tmp_path: Path):
    """The textfile holds the newest status's metrics, replaced whole, with no temporary left beside it."""
    exporter = MetricsExporter(MetricsConfig(textfile="trainwarden.prom"), Log(), cwd=tmp_path)
    exporter.publish({"state": "running", "progress": {"step": 1}})
    exporter.publish({"state": "running", "progress": {"step": 2}})
    assert "trainwarden_step 2.0" in (tmp_path / "trainwarden.prom").read_text()
    assert os.listdir(tmp_path) == ["trainwarden.prom"]


def test_textfile_failures_are_logged_once_until_a_write_succeeds(tmp_path: Path):
    """A textfile that cannot be written is an error in the journal, said once, not every second; a write that
    works again is said too; supervision goes on either way."""
    log = Log()
    exporter = MetricsExporter(MetricsConfig(textfile="gone/trainwarden.prom"), log, cwd=tmp_path)
    for _ in range(3):
        exporter.publish({"state": "running"})
    (tmp_path / "gone").mkdir()
    exporter.publish({"state": "running"})
    assert [(level, event) for level, event, _ in log.records] == [
        ("error", "metrics_textfile_failed"),
        ("info", "metrics_textfile_written"),
    ]
    assert log.records[0][2]["path"] == str(tmp_path / "gone/trainwarden.prom")


def test_metrics_config_defaults_and_values():
    """The section is optional; port 0 (any free port), an address and a .prom textfile are taken."""
    assert parse_config({"script": "x.py"}).metrics == MetricsConfig(port=None, textfile=None, address="127.0.0.1")
    config = parse_config({"script": "x.py", "metrics": {"port": 0, "address": "0.0.0.0", "textfile": "a/b.prom"}})
    assert config.metrics == MetricsConfig(port=0, textfile="a/b.prom", address="0.0.0.0")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("port", 65536, "'metrics.port' must be between 0 (any free port) and 65535"),
        ("port", -1, "'metrics.port' must be between 0"),
        ("port", "9100", "'metrics.port' must be an integer"),
        ("address", "", "'metrics.address' must be an address"),
        ("textfile", "metrics.txt", "'metrics.textfile' must be a path ending in .prom"),
        ("textfile", "dir/.prom", "'metrics.textfile' must be a path ending in .prom"),
    ],
)
def test_metrics_config_out_of_range_is_refused(key: str, value: Any, message: str):
    """A port outside 0-65535, an empty address or a textfile node_exporter would not read is refused by name."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"script": "x.py", "metrics": {key: value}})


def test_completed_at_is_the_newest_record_of_the_step(tmp_path: Path):
    """A checkpoint is complete when its last rank's record is written: the newest mtime; None if one is missing."""
    store = RunLayout(tmp_path).checkpoints
    for rank, mtime in ((0, NOW - 10), (1, NOW - 3)):
        record = store.record(rank, 40, "ckpt")
        record.parent.mkdir(parents=True)
        record.write_text("{}")
        os.utime(record, (mtime, mtime))
    assert completed_at(store, 2, "ckpt", 40) == NOW - 3
    assert completed_at(store, 3, "ckpt", 40) is None


def test_a_multi_node_status_gives_the_world_size_of_the_current_attempt():
    """slurm.min_nodes: while shrunk, the gauge shows the ranks running, not the configured ones."""
    found = samples({"state": "running", "world_size": 2, "full_world_size": 4})
    assert found[("trainwarden_world_size", ())] == 2
    assert ("trainwarden_world_size", ()) not in samples({"state": "running"})  # one machine: not exported
