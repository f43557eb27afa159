"""One truth for a node's standing: `trainwarden status` gives each excluded node the verdict `trainwarden nodes`
gives (the ledger's, with Slurm's view where Slurm answers), not the one the state file was written with."""

from __future__ import annotations

import time

import pytest

from supervisor import cli
from supervisor.core import Policy, RanksLaunched, decide, initial_state
from supervisor.launch.nodes import Ledger, NodeFault
from supervisor.observe.status import snapshot, write_status
from worker.contract import RunLayout

LOST = "lost: the supervisor's host (lease generation 1 lapsed)"
POLICY = Policy(nproc=2, max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=5.0, kill_grace_s=1)


def a_run(tmp_path) -> RunLayout:
    """A run on twnode2-3 whose batch host twnode1 was lost 20 s ago; its state file, written before Slurm marked
    twnode1 down, calls it cooling down."""
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    Ledger((NodeFault("twnode1", time.time() - 20, LOST, "lost"),)).save(layout)
    state, _ = decide(initial_state(POLICY), RanksLaunched(0, (100, 101), None), 1000.0)
    nodes = [
        {"node": "twnode2", "state": "running", "ranks": [0]},
        {"node": "twnode3", "state": "running", "ranks": [1]},
        {"node": "twnode1", "state": "excluded", "why": f"{LOST}; cooling down for another 9m40s"},
    ]
    extra = {"nodes": nodes, "node_policy": {"nodes": 2, "spare_nodes": 1, "min_nodes": 0}, "supervisor_pid": 1}
    write_status(layout, snapshot(state, now=1000.0, extra=extra), durable=False)
    return layout


@pytest.mark.parametrize(
    ("slurm", "standing", "line"),
    [
        ({"twnode1": "down*"}, "excluded for good", f"node twnode1: excluded (for good: {LOST}; Slurm says down*)"),
        ({}, "cooling down", f"node twnode1: excluded ({LOST}; cooling down for another 9m"),  # no Slurm here
    ],
)
def test_status_and_nodes_give_an_excluded_node_the_same_standing(tmp_path, monkeypatch, capsys, slurm, standing, line):
    layout = a_run(tmp_path)
    monkeypatch.setattr(cli, "_slurm_states", lambda _nodes: slurm)
    assert cli.main(["nodes", str(layout.root)]) == 0
    (row,) = [r for r in capsys.readouterr().out.splitlines() if r.startswith("twnode1")]
    assert standing in row
    assert cli.main(["status", str(layout.root)]) == 0
    (shown,) = [s.strip() for s in capsys.readouterr().out.splitlines() if "node twnode1" in s]
    assert shown.startswith(line)
