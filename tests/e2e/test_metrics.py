"""Prometheus metrics for real: a 2-rank run scraped over HTTP and in a textfile; the HTTP server started and closed."""

from __future__ import annotations

import socket
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import MetricsConfig
from supervisor.observe.metrics import MetricsExporter
from tests.conftest import wait_until
from tests.e2e.conftest import finish, heartbeat, journal, start_supervisor, write_config

pytestmark = pytest.mark.timeout(60)

# A trainer without torch (it starts in a blink): the worker library's own heartbeat writer, a step every 50 ms, a
# checkpoint (file and completion record) at step 5, until the test's `done` file appears (at most 30 s).
TRAINER = textwrap.dedent("""
    import os, sys, time, zlib
    from pathlib import Path
    from worker.contract import ENV_ATTEMPT, ENV_RUN_DIR, RunLayout
    from worker.files import atomic_write_bytes, atomic_write_json
    from worker.heartbeat import Heartbeat

    rank, layout = int(os.environ["RANK"]), RunLayout(Path(os.environ[ENV_RUN_DIR]))
    beat = Heartbeat(layout.heartbeat(rank), root=layout.root, rank=rank, attempt=int(os.environ[ENV_ATTEMPT]),
                     interval_s=0.1)
    beat.total_steps, step, deadline = 1000, 0, time.monotonic() + 30
    while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        step += 1
        beat.beat(step, "train", loss=1.0 / step)
        if step == 5:  # what a rank that skipped a NaN step, saved in 0.25 s and lacks a GradScaler's state reports
            beat.skipped, beat.anomalies, beat.last_save_s = 1, {"non_finite": 1}, 0.25
            beat.inexact = "an enabled GradScaler is not in extra_state"
            store, data = layout.checkpoints, b"weights"
            store.rank_dir(rank).mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(store.file(rank, 5, "ckpt"), data, root=layout.root)
            atomic_write_json(store.record(rank, 5, "ckpt"), {"step": 5, "size": len(data), "world_size": 2,
                              "crc32": f"{zlib.crc32(data):08x}"}, root=layout.root)
        time.sleep(0.05)
    beat.beat(step, "done", force=True)
""")


class Log:
    """A journal logger that keeps what it is told."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.records.append((level, event, fields))


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, labels): value} of an exposition text, read with prometheus_client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse(response.read().decode())


def serving_port(run_dir: Path) -> int | None:
    """The port the supervisor says it serves metrics on (`metrics.port: 0` picks a free one)."""
    try:
        return next((e["port"] for e in journal(run_dir) if e["event"] == "metrics_serving"), None)
    except (FileNotFoundError, ValueError):  # not yet written, or a line mid-write
        return None


def test_metrics_are_scraped_while_the_run_trains_and_written_to_a_textfile(tmp_path: Path) -> None:
    """With `metrics: {port: 0, textfile: ...}` the endpoint (on 127.0.0.1, the port named in the journal) serves the
    step, per-rank heartbeat ages, run state and checkpoint age while 2 ranks train; the textfile holds the same;
    once the run is over the port is closed and the textfile keeps the final state."""
    trainer, done_file = tmp_path / "trainer.py", tmp_path / "done"
    trainer.write_text(TRAINER)
    textfile = tmp_path / "node_exporter" / "trainwarden.prom"
    textfile.parent.mkdir()
    config = write_config(
        tmp_path / "job.yaml",
        script=str(trainer),
        args=[str(done_file)],
        worker={"prefix": "ckpt"},
        metrics={"port": 0, "textfile": str(textfile)},
    )
    run_dir = tmp_path / "run"
    proc = start_supervisor(config, run_dir)
    try:
        port = wait_until(lambda: serving_port(run_dir), timeout=20, what="the metrics_serving journal record")
        live = wait_until(
            lambda: (
                (found := scrape(port)).get(("trainwarden_last_checkpoint_step", ()))
                and found.get(("trainwarden_heartbeat_age_seconds", (("rank", "1"),))) is not None
                and found.get(("trainwarden_step", ()), 0) >= 5  # beats are read in batches: the step may come later
                and found
            ),
            timeout=20,
            what="a scrape showing the step-5 checkpoint, step 5 and both ranks' heartbeats",
        )
        written = parse(textfile.read_text())
        # The final state must be newer than the live one, also where a loaded machine starves the trainer.
        passed = live[("trainwarden_step", ())] + 2
        wait_until(
            lambda: all((heartbeat(run_dir, r) or {}).get("step", 0) > passed for r in (0, 1)),
            timeout=20,
            what=f"both ranks past step {passed}",
        )
        done_file.touch()
        finished = finish(proc, run_dir, timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert live[("trainwarden_run_state", (("state", "running"),))] == 1
    assert live[("trainwarden_total_steps", ())] == 1000
    assert 0 <= live[("trainwarden_heartbeat_age_seconds", (("rank", "0"),))] < 10
    assert live[("trainwarden_last_checkpoint_step", ())] == 5
    assert 0 <= live[("trainwarden_checkpoint_age_seconds", ())] < 20
    assert live[("trainwarden_restarts_total", (("cause", "exception"),))] == 0
    assert written[("trainwarden_run_state", (("state", "running"),))] == 1
    assert ("trainwarden_heartbeat_age_seconds", (("rank", "0"),)) in written
    final = parse(textfile.read_text())
    assert final[("trainwarden_run_state", (("state", "finished"),))] == 1
    assert final[("trainwarden_step", ())] > live[("trainwarden_step", ())]
    assert final[("trainwarden_skipped_steps_total", ())] == 1  # agreed by both ranks: counted once
    assert final[("trainwarden_anomalies_total", (("kind", "non_finite"),))] == 2  # each rank's own sighting
    assert final[("trainwarden_last_save_duration_seconds", ())] == 0.25
    assert final[("trainwarden_resume_inexact_reasons", ())] == 1  # said by both ranks, journalled by each
    said = [(e["rank"], e["reason"]) for e in journal(run_dir) if e["event"] == "resume_inexact"]
    assert sorted(said) == [(r, "an enabled GradScaler is not in extra_state") for r in (0, 1)]
    assert f"trainwarden: resume not exact, 1 reason(s): trainwarden status {run_dir}" in finished.stderr
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the endpoint is gone with the supervisor
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["trainwarden.prom"]  # no temporary left behind


def test_the_endpoint_serves_the_newest_status_and_frees_its_port_when_closed() -> None:
    """start() listens on 127.0.0.1 and says where; a scrape shows the newest published status; close() frees the
    port at once (another server can bind it) and ends the server's thread."""
    log = Log()
    exporter = MetricsExporter(MetricsConfig(port=0), log)
    exporter.start()
    try:
        port = exporter.port
        assert log.records == [
            (
                "info",
                "metrics_serving",
                {"address": "127.0.0.1", "port": port, "url": f"http://127.0.0.1:{port}/metrics"},
            )
        ]
        exporter.publish({"state": "running", "attempt": 0, "progress": {"step": 7}})
        assert scrape(port)[("trainwarden_step", ())] == 7
        thread = exporter._thread
    finally:
        exporter.close()
    assert not thread.is_alive() and exporter.port is None
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_a_port_that_cannot_be_had_is_logged_and_the_run_goes_on() -> None:
    """A taken port is a `metrics_unavailable` error in the journal, not an exception; publishing still works."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        log = Log()
        port = taken.getsockname()[1]
        exporter = MetricsExporter(MetricsConfig(port=port), log)
        exporter.start()
        exporter.publish({"state": "running"})
        exporter.close()
    assert [(level, event, fields["port"]) for level, event, fields in log.records] == [
        ("error", "metrics_unavailable", port)
    ]
    assert exporter.port is None
