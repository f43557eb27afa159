"""Reading hung ranks' stacks and event logs: which rank is outside the collective, which step each reached."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.core.blame import outside_collectives
from supervisor.rundir.rank_logs import last_step
from worker.contract import RunLayout

IN_BACKWARD = """Current thread 0x00007f924f88bb80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 841 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 364 in backward
  File "/work/examples/demo_train.py", line 101 in main
"""
IN_ALL_REDUCE_PYSPY = """Thread 9187 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2950)
    main (train.py:40)
"""
SLEEPING = """Current thread 0x00007f0b08bc2b80 (most recent call first):
  File "/work/worker/faults.py", line 93 in hang_forever
  File "/work/worker/warden.py", line 110 in step_done
"""


def test_the_one_rank_outside_collectives_is_the_culprit():
    """Two ranks wait in backward or all_reduce, one sleeps elsewhere: that one is named."""
    assert outside_collectives({0: IN_BACKWARD, 1: SLEEPING, 2: IN_ALL_REDUCE_PYSPY}) == 1


def test_no_culprit_when_every_rank_is_outside_collectives():
    """If no rank is inside a collective, the stacks do not single one out."""
    assert outside_collectives({0: SLEEPING, 1: SLEEPING}) is None


def test_no_culprit_when_every_rank_is_inside_collectives():
    """If every rank waits in a collective, the stacks do not single one out."""
    assert outside_collectives({0: IN_BACKWARD, 1: IN_ALL_REDUCE_PYSPY}) is None


def test_no_culprit_from_a_single_dump():
    """One rank's dump alone (the other gave none) names nobody."""
    assert outside_collectives({0: SLEEPING, 1: ""}) is None


def test_last_step_reads_the_newest_step_of_the_attempt_past_torn_lines(tmp_path: Path):
    """The newest `step` event of the given attempt is found; a torn last line and other attempts are skipped."""
    layout = RunLayout(tmp_path)
    path = layout.rank_events(1)
    path.parent.mkdir(parents=True)
    lines = [json.dumps({"event": "step", "attempt": 0, "step": s}) for s in range(1, 40)]
    lines += [
        json.dumps({"event": "checkpoint_saved", "attempt": 0, "step": 39}),
        json.dumps({"event": "step", "attempt": 1, "step": 5}),
    ]
    path.write_text("\n".join(lines) + '\n{"event": "step", "attempt": 0, "st')
    assert last_step(layout, 1, attempt=0) == 39
    assert last_step(layout, 1, attempt=1) == 5
    assert last_step(layout, 1, attempt=2) is None


def test_last_step_of_a_missing_log_is_none(tmp_path: Path):
    """A rank that never wrote an event log has no last step."""
    assert last_step(RunLayout(tmp_path), 0, attempt=0) is None
