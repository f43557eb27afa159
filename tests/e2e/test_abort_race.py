"""An anomaly abort rolls back whichever exit the supervisor sees first: tiny ranks that log the library's
`anomaly_abort` event and die in either order (the peer by SIGABRT, as gloo kills it when the aborting rank leaves)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import journal, run_supervisor

pytestmark = pytest.mark.timeout(60)

# Attempt 0: rank 0 logs an abort (steps 35, batches 34-36) and exits 65; rank 1 dies by SIGABRT. In ORDER
# "peer_first" rank 1 dies once the abort is logged, before rank 0 exits (on the supervisor's SIGTERM); in
# "abort_late" rank 1 dies first and rank 0 logs the abort only on that SIGTERM. Later attempts exit 0.
RANKS = r"""
import json, os, signal, sys, time
ORDER = sys.argv[1]
run_dir, rank = os.environ["TRAINWARDEN_RUN_DIR"], int(os.environ["RANK"])
if os.environ["TRAINWARDEN_ATTEMPT"] != "0":
    sys.exit(0)
events = os.path.join(run_dir, "ranks", "rank_0", "events.jsonl")
ABORT = {"event": "anomaly_abort", "level": "error", "rank": 0, "attempt": 0, "step": 35, "consecutive": 3,
         "first_anomaly_step": 35, "first_anomaly_batch": 34, "batch": 36, "suspect_ranks": []}

ready = os.path.join(run_dir, "rank_0_ready")

def log_abort():
    os.makedirs(os.path.dirname(events), exist_ok=True)
    with open(events, "a") as f:
        f.write(json.dumps(ABORT) + "\n")

def on_sigterm(*_):
    if ORDER == "abort_late":
        log_abort()
    os._exit(65)

if rank == 0:
    signal.signal(signal.SIGTERM, on_sigterm)
    if ORDER == "peer_first":
        log_abort()
    open(ready, "w").close()
    time.sleep(30)
else:
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.abort()
"""


def job(tmp_path: Path, order: str) -> Path:
    config = {
        "command": [sys.executable, "-c", RANKS, order],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 2, "backoff_initial_s": 0.1},
        "stop": {"kill_grace_s": 5.0},
        "anomaly": {"rollback_steps": 10, "skip_after_steps": 5},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("order", ["peer_first", "abort_late"])
def test_a_peer_dying_of_the_abort_by_sigabrt_still_brings_the_rollback(tmp_path: Path, order: str) -> None:
    """Rank 1's SIGABRT before or after rank 0's logged abort: one rollback scheduled, the failure an anomaly."""
    run_dir = tmp_path / "run"
    done = run_supervisor(job(tmp_path, order), run_dir, timeout=45)

    assert done.returncode == 0, done.stderr[-3000:]
    events = journal(run_dir)
    scheduled = [e for e in events if e["event"] == "rollback_scheduled"]
    assert [(e["resume_at_most"], e["tries"]) for e in scheduled] == [(25, 1)]
    (aborted,) = [e for e in events if e["event"] == "anomaly_abort"]
    assert (aborted["rank"], aborted["first_step"], aborted["abort_batch"]) == (
        (1 if order == "peer_first" else 0),
        35,
        36,
    )
    status = done.status()
    assert (status["state"], status["restarts"], status["rollback"]["abort"]["first_step"]) == ("finished", 1, 35)
    assert [(f["attempt"], f["kind"]) for f in status["failures"]] == [(0, "anomaly")]
