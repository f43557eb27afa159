"""Prometheus metrics of the run: the status the supervisor writes, served over HTTP and/or written for node_exporter.

Both outlets are opt-in (`metrics.port`, `metrics.textfile`). The runner hands every status dict it writes to
`MetricsExporter.publish`, which only keeps a reference to it (and counts restarts): metric families are built
when someone reads them, a scrape on the endpoint's thread or the textfile written right after. A key the status
lacks (an observer that is not there, a value not known yet) is a metric left out, never an error.

prometheus_client is imported only when metrics are on: it pulls in http.server, 70 ms on every `trainwarden` call.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.config import MetricsConfig
from supervisor.core import Phase
from supervisor.core.causes import CauseKind

__all__ = ["CAUSES", "GOODPUT_CATEGORIES", "PHASES", "MetricsExporter", "RestartCounts", "StatusCollector", "families"]

PHASES = tuple(phase.value for phase in Phase)
CAUSES = tuple(kind.value for kind in CauseKind)
UNKNOWN_CAUSE = "unknown"  # restarts whose failure left the status before it was counted (not expected)
GOODPUT_CATEGORIES = (
    "productive",
    "slow",
    "lost",
    "startup",
    "restart",
    "save",
    "hang",
    "stopped",
)  # goodput's `<category>_s` keys
SHUTDOWN_WAIT_S = 2.0  # the server's thread ends within its 0.5 s poll once shut down


class RestartCounts:
    """Relaunches per cause of the failure that led to them, from successive status dicts.

    A failure counts once a later attempt has been launched (until then the core may still revise its cause), so the
    counts only grow; relaunches the status's newest failures no longer show are counted under `unknown`, keeping
    the total equal to the status's `restarts`.
    """

    def __init__(self) -> None:
        self._counted_through = -1  # attempts up to this one are counted (the first is 0)
        self._counts: dict[str, int] = dict.fromkeys(CAUSES, 0)

    def update(self, status: Mapping[str, Any]) -> dict[str, int]:
        """Take in one status dict; the counts so far (a new dict: the caller may hand it to another thread)."""
        attempt = status.get("attempt")
        if type(attempt) is not int or attempt - 1 <= self._counted_through:
            return dict(self._counts)
        counts = dict(self._counts)
        for failure in _dicts(status.get("failures")):
            failed = failure.get("attempt")
            if type(failed) is int and self._counted_through < failed < attempt:
                kind = failure.get("kind")
                cause = kind if isinstance(kind, str) and kind in CAUSES else UNKNOWN_CAUSE
                counts[cause] = counts.get(cause, 0) + 1
        restarts = status.get("restarts")
        missing = restarts - sum(counts.values()) if type(restarts) is int else 0
        if missing > 0:
            counts[UNKNOWN_CAUSE] = counts.get(UNKNOWN_CAUSE, 0) + missing
        self._counted_through, self._counts = attempt - 1, counts
        return dict(counts)


@dataclass(frozen=True)
class _View:
    """One published status, as the collector's thread sees it: replaced whole, never changed."""

    status: Mapping[str, Any]
    restarts: Mapping[str, int]


class StatusCollector:
    """A prometheus_client collector whose metrics are the newest published status (none before the first)."""

    def __init__(self) -> None:
        self._view: _View | None = None
        self._restarts = RestartCounts()

    def publish(self, status: Mapping[str, Any]) -> None:
        """Keep `status` (not copied: the runner writes it and lets it go) as what the next collect reads."""
        self._view = _View(status, self._restarts.update(status))

    def collect(self) -> Iterator[Any]:
        view = self._view  # one read: the main thread may publish meanwhile
        if view is not None:
            yield from families(view.status, view.restarts, now=time.time())


def families(status: Mapping[str, Any], restarts: Mapping[str, int], *, now: float) -> list[Any]:
    """The metric families of one status dict; `now` (wall clock) ages what the status says was true when written."""
    out = _Families()
    state = status.get("state")
    out.labelled(
        "trainwarden_run_state",
        "1 for the run's current state (supervisord's words), 0 for the others",
        "state",
        {phase: int(phase == state) for phase in PHASES},
    )
    out.gauge(
        "trainwarden_attempt",
        "The current attempt: 0 at the first launch, one more at each relaunch",
        status.get("attempt"),
    )
    out.counter("trainwarden_restarts", "Relaunches, by the kind of failure that caused them", "cause", restarts)
    out.gauge(
        "trainwarden_max_restarts",
        "Relaunches allowed before the run fails (restart.max_restarts)",
        status.get("max_restarts"),
    )
    out.gauge(
        "trainwarden_world_size",
        "Ranks of the current attempt on Slurm (fewer than configured while shrunk)",
        status.get("world_size"),
    )
    _progress(status, out)
    written = _number(status.get("updated_at"))
    _ranks(status, 0.0 if written is None else max(0.0, now - written), out)
    _checkpoint(status, now, out)
    _memory(status, out)
    _anomalies(status, out)
    return out.found


class _Families:
    """Metric families being gathered; a value that is no finite number is left out, a family without any too."""

    def __init__(self) -> None:
        self.found: list[Any] = []

    def gauge(self, name: str, doc: str, value: Any) -> None:
        from prometheus_client.core import GaugeMetricFamily

        number = _number(value)
        if number is not None:
            self.found.append(GaugeMetricFamily(name, doc, value=number))

    def labelled(self, name: str, doc: str, label: str, values: Mapping[str, Any]) -> None:
        from prometheus_client.core import GaugeMetricFamily

        self._add(GaugeMetricFamily(name, doc, labels=[label]), values)

    def total(self, name: str, doc: str, value: Any) -> None:
        from prometheus_client.core import CounterMetricFamily

        number = _number(value)
        if number is not None:
            self.found.append(CounterMetricFamily(name, doc, value=number))

    def counter(self, name: str, doc: str, label: str, values: Mapping[str, Any]) -> None:
        from prometheus_client.core import CounterMetricFamily

        self._add(CounterMetricFamily(name, doc, labels=[label]), values)

    def _add(self, family: Any, values: Mapping[str, Any]) -> None:
        for key, value in values.items():
            number = _number(value)
            if number is not None:
                family.add_metric([key], number)
        if family.samples:
            self.found.append(family)


def _progress(status: Mapping[str, Any], out: _Families) -> None:
    """Training progress (the `progress` block) and goodput (the `goodput` block), where the status has them."""
    progress = _mapping(status.get("progress"))
    out.gauge("trainwarden_step", "The newest step any rank reached", progress.get("step"))
    out.gauge(
        "trainwarden_total_steps",
        "The steps the script said it will run (warden.steps(total))",
        progress.get("total_steps"),
    )
    out.gauge(
        "trainwarden_steps_per_second",
        "Training steps per second over about the last 30 s",
        progress.get("steps_per_s"),
    )
    out.gauge("trainwarden_loss", "The loss of the newest step", progress.get("loss"))
    out.gauge(
        "trainwarden_eta_seconds", "Estimated seconds until total_steps at the current rate", progress.get("eta_s")
    )
    goodput = _mapping(status.get("goodput"))
    out.gauge("trainwarden_goodput_ratio", "Productive training time over wall time (0 to 1)", goodput.get("ratio"))
    out.gauge("trainwarden_wall_seconds", "Wall time the goodput accounting covers", goodput.get("wall_s"))
    out.gauge(
        "trainwarden_ideal_step_seconds", "The run's steady-state step time goodput counts", goodput.get("ideal_step_s")
    )
    out.labelled(
        "trainwarden_goodput_seconds",
        "Wall time by what it went to (lost work is moved out of productive)",
        "category",
        {category: goodput.get(f"{category}_s") for category in GOODPUT_CATEGORIES},
    )


def _ranks(status: Mapping[str, Any], since: float, out: _Families) -> None:
    """Per-rank gauges: heartbeat age (brought up to now: `since` the status was written), step, compute time per
    step, straggler flag."""
    ranks = {str(rank["rank"]): rank for rank in _dicts(status.get("ranks")) if type(rank.get("rank")) is int}
    ages = {}
    for label, rank in ranks.items():
        age = _number(rank.get("heartbeat_age_s"))
        ages[label] = None if age is None else round(age + since, 3)
    out.labelled("trainwarden_heartbeat_age_seconds", "Seconds since each rank's newest heartbeat", "rank", ages)
    out.labelled(
        "trainwarden_rank_step",
        "The newest step each rank reported",
        "rank",
        {label: rank.get("step") for label, rank in ranks.items()},
    )
    compute = _mapping(status.get("rank_compute_s"))  # the stragglers observer's figures, by rank
    out.labelled(
        "trainwarden_rank_compute_seconds",
        "Each rank's smoothed compute time per step, without waiting for its peers",
        "rank",
        {label: compute.get(label, rank.get("compute_s")) for label, rank in ranks.items()},
    )
    if isinstance(status.get("stragglers"), list):  # only where stragglers are looked for
        flagged = {entry.get("rank") for entry in _dicts(status["stragglers"])}
        out.labelled(
            "trainwarden_straggler",
            "1 for a rank flagged as consistently slower than its peers",
            "rank",
            {label: int(rank["rank"] in flagged) for label, rank in ranks.items()},
        )


def _anomalies(status: Mapping[str, Any], out: _Families) -> None:
    """Skipped batches and anomalies by kind (each rank's own sightings), counted since the supervisor started."""
    if _number(status.get("skipped_steps")) is not None:
        out.total(
            "trainwarden_skipped_steps",
            "Batches skipped (anomalies and AMP overflows), since the supervisor started",
            status["skipped_steps"],
        )
    out.counter(
        "trainwarden_anomalies",
        "Anomalies ranks saw, by kind (a rank's own sightings: non_finite, "
        "global_norm_spike, amp_overflow, feature_value, ...), since the supervisor started",
        "kind",
        _mapping(status.get("anomalies")),
    )
    inexact = status.get("resume_inexact")
    out.gauge(
        "trainwarden_resume_inexact_reasons",
        "Reasons the ranks of this attempt gave why their resume is not exact (trainwarden status says them)",
        len(inexact) if isinstance(inexact, list) else None,
    )


def _checkpoint(status: Mapping[str, Any], now: float, out: _Families) -> None:
    """The newest complete checkpoint: its step, when it was completed and how long ago; the newest save's time."""
    out.gauge(
        "trainwarden_last_save_duration_seconds",
        "How long the newest checkpoint save took (the slowest rank)",
        status.get("last_save_s"),
    )
    out.gauge(
        "trainwarden_last_checkpoint_step",
        "The step of the newest complete checkpoint",
        _mapping(status.get("last_checkpoint")).get("step"),
    )
    completed = _number(status.get("last_checkpoint_at"))
    if completed is not None:
        out.gauge(
            "trainwarden_last_checkpoint_timestamp_seconds",
            "When the newest complete checkpoint was completed (Unix time)",
            completed,
        )
        out.gauge(
            "trainwarden_checkpoint_age_seconds",
            "Seconds since the newest complete checkpoint was completed",
            round(max(0.0, now - completed), 3),
        )


def _memory(status: Mapping[str, Any], out: _Families) -> None:
    """The memory tier on the supervisor's machine: bytes its directory holds, the newest snapshot's step."""
    memory = _mapping(status.get("memory"))
    out.gauge(
        "trainwarden_memory_tier_bytes", "Bytes the run's snapshots hold in host shared memory", memory.get("bytes")
    )
    out.gauge(
        "trainwarden_memory_snapshot_step",
        "The step of the newest complete memory snapshot",
        memory.get("snapshot_step"),
    )


def _number(value: Any) -> float | None:
    """A finite number as a float; None for anything else (a bool, a string, null, NaN, an int too big)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


class MetricsExporter:
    """The run's metrics on an HTTP endpoint and/or in a textfile, as configured; a no-op when neither is."""

    def __init__(self, config: MetricsConfig, log: Any, cwd: Path | None = None) -> None:
        self.config = config
        self.log = log
        self.enabled = config.port is not None or config.textfile is not None
        self.textfile: Path | None = None  # the operator's own path, relative to the working directory
        if config.textfile is not None:
            self.textfile = (Path.cwd() if cwd is None else cwd) / config.textfile
        self._collector = StatusCollector()
        self._registry: Any = None
        self._server: Any = None
        self._thread: Any = None
        self._textfile_error: str | None = None  # the last write failure, said once until a write succeeds
        if self.enabled:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=False)  # ours alone: no process or GC metrics
            self._registry.register(self._collector)

    @property
    def registry(self) -> Any:
        return self._registry

    @property
    def port(self) -> int | None:
        """The port the endpoint listens on (the one picked for `metrics.port: 0`), or None when not serving."""
        return None if self._server is None else self._server.server_port

    def start(self) -> None:
        """Serve /metrics when `metrics.port` is set; a port that cannot be had is logged, and the run goes on."""
        if self.config.port is None:
            return
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(self.config.port, self.config.address, self._registry)
        except OSError as exc:  # taken, or an address not of this machine: metrics must not stop supervision
            self.log.error(
                "metrics_unavailable",
                address=self.config.address,
                port=self.config.port,
                error=exc.strerror or str(exc),
            )
            return
        host = f"[{self.config.address}]" if ":" in self.config.address else self.config.address
        self.log.info(
            "metrics_serving", address=self.config.address, port=self.port, url=f"http://{host}:{self.port}/metrics"
        )

    def publish(self, status: Mapping[str, Any]) -> None:
        """The status the runner just wrote: what the endpoint serves from now on; the textfile is rewritten."""
        if not self.enabled:
            return
        self._collector.publish(status)
        if self.textfile is not None:
            self._write_textfile()

    def _write_textfile(self) -> None:
        from prometheus_client import write_to_textfile

        assert self.textfile is not None  # the caller's check
        try:
            write_to_textfile(os.fspath(self.textfile), self._registry)  # a temporary beside it, then a rename
        except Exception as exc:  # a full disk, a directory removed, even a bug here: supervision goes on
            error = (exc.strerror if isinstance(exc, OSError) else None) or f"{type(exc).__name__}: {exc}"
            if error != self._textfile_error:
                self.log.error("metrics_textfile_failed", path=str(self.textfile), error=error)
            self._textfile_error = error
            return
        if self._textfile_error is not None:
            self.log.info("metrics_textfile_written", path=str(self.textfile))
            self._textfile_error = None

    def close(self) -> None:
        """Stop serving: the port is free again when this returns (bounded: the thread is waited on briefly)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(SHUTDOWN_WAIT_S)
        self._server = self._thread = None
