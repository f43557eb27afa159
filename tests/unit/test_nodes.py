"""The node ledger and node planning of multi-node runs: plain values, a fake clock."""

from __future__ import annotations

import json

import pytest

from supervisor.nodes import Ledger, NodeFault, TooFewNodes, plan_nodes
from worker.contract import RunLayout

HOUR = 3600.0


def test_nodes_are_used_in_allocation_order_and_the_rest_are_spares():
    assert plan_nodes(["n1", "n2", "n3"], {}, 2) == (["n1", "n2"], ["n3"])


def test_an_excluded_node_is_replaced_by_a_spare_and_keeps_the_order():
    assert plan_nodes(["n1", "n2", "n3"], {"n2": "lost"}, 2) == (["n1", "n3"], [])


def test_too_few_nodes_names_the_bad_ones_and_the_exclude_option():
    with pytest.raises(TooFewNodes) as caught:
        plan_nodes(["n1", "n2", "n3"], {"n2": "lost", "n3": "failed twice"}, 2)
    assert "needs 2 nodes, 1 usable left" in str(caught.value)
    assert "n2 (lost)" in str(caught.value) and "n3 (failed twice)" in str(caught.value)
    assert caught.value.exclude_option == "--exclude=n2,n3"


def test_a_lost_node_is_excluded_at_once_and_for_good():
    ledger = Ledger().charged(NodeFault("n2", 0.0, "lost: silent", fatal=True))
    assert ledger.excluded(100 * HOUR, max_failures=2, window_s=HOUR) == {"n2": "lost: silent"}


def test_a_node_is_excluded_after_max_failures_within_the_window_only():
    ledger = Ledger().charged(NodeFault("n1", 0.0, "rank 0 killed by SIGSEGV"))
    assert ledger.excluded(10.0, max_failures=2, window_s=HOUR) == {}
    twice = ledger.charged(NodeFault("n1", 60.0, "rank 1 killed by SIGBUS"))
    excluded = twice.excluded(70.0, max_failures=2, window_s=HOUR)
    assert list(excluded) == ["n1"] and "failed 2 times" in excluded["n1"] and "SIGBUS" in excluded["n1"]
    assert twice.excluded(2 * HOUR, max_failures=2, window_s=HOUR) == {}  # the first fault aged out


def test_the_ledger_survives_a_round_trip_through_the_run_dir(tmp_path):
    layout = RunLayout(tmp_path)
    (tmp_path / "supervisor").mkdir()
    ledger = Ledger().charged(NodeFault("n1", 5.0, "lost", fatal=True)).charged(NodeFault("n2", 6.0, "x"))
    ledger.save(layout)
    assert Ledger.load(layout) == ledger
    assert Ledger.load(RunLayout(tmp_path / "none")) == Ledger()


@pytest.mark.parametrize("content", [
    b"[]", b'{"faults": 3}', b'{"faults": [{"node": 5, "at": 1, "reason": "x"}]}',
    b'{"faults": [{"node": "n1", "at": "yesterday", "reason": "x"}]}', b'{"faults": [{"node": "\\u0000", "at": 1}]}',
    b"\xff\xfe", b'{"faults": [' + b"[" * 5000 + b"]}",
])
def test_a_damaged_ledger_is_refused_with_a_clear_error(tmp_path, content):
    layout = RunLayout(tmp_path)
    (tmp_path / "supervisor").mkdir()
    layout.node_ledger.write_bytes(content)
    with pytest.raises((ValueError, OSError)):
        Ledger.load(layout)


def test_the_ledger_keeps_only_the_newest_faults(tmp_path):
    ledger = Ledger()
    for i in range(1500):
        ledger = ledger.charged(NodeFault(f"n{i}", float(i), "x"))
    assert len(ledger.faults) == 1000 and ledger.faults[0].node == "n500"
    layout = RunLayout(tmp_path)
    (tmp_path / "supervisor").mkdir()
    ledger.save(layout)
    assert len(json.loads(layout.node_ledger.read_text())["faults"]) == 1000
