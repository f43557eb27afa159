"""The node ledger and node planning of multi-node runs: plain values, a fake clock."""

from __future__ import annotations

import fcntl
import json
import os
import time

import pytest

from supervisor.core.devices import DeviceVerdict
from supervisor.launch.nodes import (
    Ledger,
    NodeFault,
    TooFewNodes,
    device_fault,
    is_strong_slurm_state,
    parse_sinfo,
    partition_shortfall,
    plan_nodes,
    render_rows,
    update_ledger,
)
from worker.contract import RunLayout

HOUR = 3600.0
POLICY = {"max_failures": 2, "window_s": HOUR, "cooldown_s": 600.0}


@pytest.fixture
def layout(tmp_path):
    (tmp_path / "supervisor").mkdir()
    return RunLayout(tmp_path)


def lost(node: str, at: float, why: str = "silent") -> NodeFault:
    return NodeFault(node, at, f"lost: {why}", "lost")


def test_nodes_are_used_in_allocation_order_and_the_rest_are_spares():
    """The first `needed` nodes of the allocation run, the rest are spares."""
    assert plan_nodes(["n1", "n2", "n3"], {}, 2) == (["n1", "n2"], ["n3"])


def test_an_excluded_node_is_replaced_by_a_spare_and_keeps_the_order():
    """An excluded node is skipped and a spare takes its place, in allocation order."""
    assert plan_nodes(["n1", "n2", "n3"], {"n2": "lost"}, 2) == (["n1", "n3"], [])


def test_too_few_nodes_names_the_bad_ones_and_the_exclude_option():
    """Too few usable nodes raises TooFewNodes naming each excluded node and the --exclude to resubmit with."""
    with pytest.raises(TooFewNodes) as caught:
        plan_nodes(["n1", "n2", "n3"], {"n2": "lost", "n3": "failed twice"}, 2)
    assert "needs 2 nodes, 1 usable left" in str(caught.value)
    assert "n2 (lost)" in str(caught.value) and "n3 (failed twice)" in str(caught.value)
    assert caught.value.exclude_option == "--exclude=n2,n3"


def test_a_lost_node_slurm_keeps_up_cools_down_then_is_usable_again():
    """A node lost while Slurm has it up is excluded for cooldown_s, saying for how long, then used again."""
    ledger = Ledger().charged(lost("n2", 0.0))
    states = {"n2": "mixed"}
    assert ledger.excluded(108.0, **POLICY, slurm_states=states) == {
        "n2": "lost: silent; cooling down for another 8m12s"
    }
    assert ledger.excluded(599.0, **POLICY) == {"n2": "lost: silent; cooling down for another 1s"}
    assert ledger.excluded(600.0, **POLICY, slurm_states=states) == {}


def test_a_lost_node_slurm_marks_down_is_excluded_for_good_and_confirmed_makes_it_durable():
    """Lost plus a strong Slurm state excludes for good; confirmed() records it so Slurm resuming the node
    later does not bring it back."""
    ledger = Ledger().charged(lost("n2", 0.0))
    assert ledger.excluded(100 * HOUR, **POLICY, slurm_states={"n2": "down*"}) == {
        "n2": "for good: lost: silent; Slurm says down*"
    }
    confirmed = ledger.confirmed({"n2": "down*", "n1": "idle"}, 50.0)
    assert confirmed.faults[-1] == NodeFault("n2", 50.0, "lost: silent; Slurm marked it down*", "down")
    assert confirmed.excluded(100 * HOUR, **POLICY, slurm_states={"n2": "idle"}) == {
        "n2": "for good: lost: silent; Slurm marked it down*"
    }


def test_confirmed_returns_the_same_ledger_when_nothing_changes():
    """confirmed() returns the ledger itself unless a lost node's Slurm state turned strong."""
    ledger = Ledger().charged(lost("n1", 0.0)).charged(NodeFault("n2", 1.0, "rank 3 killed by SIGSEGV"))
    assert ledger.confirmed({"n1": "idle*", "n2": "drained"}, 9.0) is ledger  # n2 only failed: not a loss
    once = ledger.confirmed({"n1": "fail"}, 9.0)
    assert once is not ledger and once.confirmed({"n1": "fail"}, 10.0) is once


def test_a_loss_followed_by_a_failure_is_not_made_for_good_by_slurm():
    """Only a node whose latest fault is a loss is taken out for good by a strong Slurm state."""
    ledger = Ledger().charged(lost("n1", 0.0)).charged(NodeFault("n1", 2 * HOUR, "rank 0 killed by SIGBUS"))
    assert ledger.excluded(2 * HOUR, **POLICY, slurm_states={"n1": "drained"}) == {}
    assert ledger.confirmed({"n1": "drained"}, 2 * HOUR) is ledger


def test_forgiving_a_node_clears_every_earlier_fault():
    """A forgiven node is usable again whatever it did before; faults after the forgiveness count again."""
    ledger = (
        Ledger()
        .charged(lost("n1", 0.0))
        .confirmed({"n1": "down"}, 1.0)
        .charged(NodeFault("n2", 2.0, "a"))
        .charged(NodeFault("n2", 3.0, "b"))
        .charged(lost("n3", 4.0))
    )
    assert set(ledger.excluded(5.0, **POLICY)) == {"n1", "n2", "n3"}
    forgiven = ledger.forgiven("n1", 6.0).forgiven("n2", 6.0).forgiven("n3", 6.0)
    assert forgiven.faults[-1] == NodeFault("n3", 6.0, "forgiven by an operator", "forgiven")
    assert forgiven.excluded(7.0, **POLICY, slurm_states={"n1": "down", "n3": "drained"}) == {}
    again = forgiven.charged(NodeFault("n2", 8.0, "c"))
    assert again.excluded(9.0, **POLICY) == {}
    assert again.charged(NodeFault("n2", 9.0, "d")).excluded(10.0, **POLICY) == {
        "n2": "failed 2 times in 3600 s, last: d"
    }


def test_a_node_is_excluded_after_max_failures_within_the_window_only():
    """Failures exclude a node at max_failures within window_s, and stop counting once they age out."""
    ledger = Ledger().charged(NodeFault("n1", 0.0, "rank 0 killed by SIGSEGV"))
    assert ledger.excluded(10.0, **POLICY) == {}
    twice = ledger.charged(NodeFault("n1", 60.0, "rank 1 killed by SIGBUS"))
    excluded = twice.excluded(70.0, **POLICY)
    assert excluded == {"n1": "failed 2 times in 3600 s, last: rank 1 killed by SIGBUS"}
    assert twice.excluded(2 * HOUR, **POLICY) == {}  # the first fault aged out


def test_the_ledger_survives_a_round_trip_through_the_run_dir(tmp_path, layout):
    """A saved ledger loads back equal, kinds included; a run dir without one loads empty."""
    ledger = (
        Ledger()
        .charged(lost("n1", 5.0))
        .charged(NodeFault("n2", 6.0, "x"))
        .confirmed({"n1": "down"}, 7.0)
        .forgiven("n2", 8.0)
    )
    ledger.save(layout)
    assert Ledger.load(layout) == ledger
    assert [f["kind"] for f in json.loads(layout.node_ledger.read_text())["faults"]] == [
        "lost",
        "failed",
        "down",
        "forgiven",
    ]
    assert Ledger.load(RunLayout(tmp_path / "none")) == Ledger()


def test_an_old_ledger_loads_fatal_faults_as_lost_and_the_rest_as_failed(layout):
    """A ledger written before kinds: fatal true is a loss, fatal false or none a failure."""
    layout.node_ledger.write_text(
        json.dumps(
            {
                "faults": [
                    {"node": "n1", "at": 1, "reason": "lost: silent", "fatal": True},
                    {"node": "n2", "at": 2.5, "reason": "x", "fatal": False},
                    {"node": "n3", "at": 3, "reason": "y"},
                ]
            }
        )
    )
    assert Ledger.load(layout).faults == (
        NodeFault("n1", 1.0, "lost: silent", "lost"),
        NodeFault("n2", 2.5, "x", "failed"),
        NodeFault("n3", 3.0, "y", "failed"),
    )


def test_an_unknown_kind_is_refused_with_a_clear_error(layout):
    """A fault of a kind this version does not know is refused, from the file or in code."""
    layout.node_ledger.write_text('{"faults": [{"node": "n1", "at": 1, "reason": "x", "kind": "cursed"}]}')
    with pytest.raises(ValueError, match="n1 has an unknown kind 'cursed'"):
        Ledger.load(layout)
    with pytest.raises(ValueError, match="unknown kind"):
        NodeFault("n1", 1.0, "x", "fatal")


@pytest.mark.parametrize("node", ["", "n1\n", "x" * 256])
def test_forgiving_a_bad_host_name_is_refused_before_it_reaches_the_ledger(node):
    """`--forget` with a name the loader would refuse raises at once instead of corrupting the ledger."""
    with pytest.raises(ValueError, match="not a host name"):
        Ledger().forgiven(node, 1.0)


@pytest.mark.parametrize(
    "content",
    [
        b"[]",
        b'{"faults": 3}',
        b'{"faults": [{"node": 5, "at": 1, "reason": "x"}]}',
        b'{"faults": [{"node": "n1", "at": "yesterday", "reason": "x"}]}',
        b'{"faults": [{"node": "\\u0000", "at": 1}]}',
        b'{"faults": [{"node": "n1", "at": 1, "reason": "x", "fatal": "yes"}]}',
        b'{"faults": [{"node": "n1", "at": 1, "reason": "x", "kind": ["lost"]}]}',
        b"\xff\xfe",
        b'{"faults": [' + b"[" * 5000 + b"]}",
    ],
)
def test_a_damaged_ledger_is_refused_with_a_clear_error(layout, content):
    """Any ledger that is not a list of well-formed faults is refused with ValueError or OSError."""
    layout.node_ledger.write_bytes(content)
    with pytest.raises((ValueError, OSError)):
        Ledger.load(layout)


def test_the_ledger_keeps_only_the_newest_faults(layout):
    """The ledger keeps its newest 1000 faults, in memory and on disk."""
    ledger = Ledger()
    for i in range(1500):
        ledger = ledger.charged(NodeFault(f"n{i}", float(i), "x"))
    assert len(ledger.faults) == 1000 and ledger.faults[0].node == "n500"
    ledger.save(layout)
    assert len(json.loads(layout.node_ledger.read_text())["faults"]) == 1000


def test_rows_list_every_node_worst_first_with_its_counts_and_slurm_state():
    """rows() gives each node ever charged, worst status first then by name, with its counted faults."""
    ledger = (
        Ledger()
        .charged(NodeFault("n9", 0.0, "a"))
        .charged(NodeFault("n9", 10.0, "b"))
        .charged(lost("n4", 20.0))
        .charged(lost("n3", 30.0))
        .confirmed({"n3": "drained"}, 31.0)
        .charged(NodeFault("n1", 40.0, "c"))
        .forgiven("n1", 50.0)
        .charged(NodeFault("n2", 5.0, "d"))
    )
    rows = ledger.rows(100.0, **POLICY, slurm_states={"n3": "idle", "n4": "mixed"})
    assert rows == [
        {
            "node": "n3",
            "status": "excluded for good",
            "reason": "for good: lost: silent; Slurm marked it drained",
            "faults": 1,
            "last_fault_at": 30.0,
            "slurm_state": "idle",
        },
        {
            "node": "n9",
            "status": "excluded",
            "reason": "failed 2 times in 3600 s, last: b",
            "faults": 2,
            "last_fault_at": 10.0,
            "slurm_state": None,
        },
        {
            "node": "n4",
            "status": "cooling down",
            "reason": "lost: silent; cooling down for another 8m40s",
            "faults": 1,
            "last_fault_at": 20.0,
            "slurm_state": "mixed",
        },
        {
            "node": "n1",
            "status": "usable",
            "reason": "forgiven by an operator",
            "faults": 0,
            "last_fault_at": None,
            "slurm_state": None,
        },
        {"node": "n2", "status": "usable", "reason": "last: d", "faults": 1, "last_fault_at": 5.0, "slurm_state": None},
    ]


def test_render_rows_prints_one_aligned_line_per_node_under_a_header():
    """render_rows() prints a header and one line per row, columns aligned, the reason last."""
    at = 1_700_000_000.0
    text = render_rows(
        [
            {
                "node": "gpu-node-12",
                "status": "cooling down",
                "reason": "lost: silent; cooling down for another 1s",
                "faults": 1,
                "last_fault_at": at,
                "slurm_state": "mixed",
            },
            {
                "node": "n1",
                "status": "usable",
                "reason": "forgiven by an operator",
                "faults": 0,
                "last_fault_at": None,
                "slurm_state": None,
            },
        ]
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    assert text.splitlines() == [
        "NODE         STATUS        FAULTS  LAST FAULT           SLURM  REASON",
        f"gpu-node-12  cooling down  1       {stamp}  mixed  lost: silent; cooling down for another 1s",
        "n1           usable        0       -                    -      forgiven by an operator",
    ]
    assert render_rows([]) == "no node has been charged with a fault in this run"


def test_update_ledger_loads_changes_and_saves(layout):
    """update_ledger() applies the change to the ledger on disk and saves the result, which it returns."""
    first = update_ledger(layout, lambda ledger: ledger.charged(lost("n1", 1.0)))
    second = update_ledger(layout, lambda ledger: ledger.forgiven("n1", 2.0))
    assert first.faults == (lost("n1", 1.0),) and Ledger.load(layout) == second
    assert second.faults == (lost("n1", 1.0), NodeFault("n1", 2.0, "forgiven by an operator", "forgiven"))
    assert layout.node_ledger.with_suffix(".lock").is_file()


def test_update_ledger_saves_nothing_when_nothing_changes(layout):
    """A change that returns the ledger as it was writes no file."""
    assert update_ledger(layout, lambda ledger: ledger.confirmed({}, 1.0)) == Ledger()
    assert not layout.node_ledger.exists()


def test_update_ledger_leaves_a_damaged_ledger_alone(layout):
    """A ledger that cannot be read raises ValueError and stays on disk as it was."""
    layout.node_ledger.write_bytes(b'{"faults": 3}')
    with pytest.raises(ValueError, match="not a node ledger"):
        update_ledger(layout, lambda ledger: ledger.charged(lost("n1", 1.0)))
    assert layout.node_ledger.read_bytes() == b'{"faults": 3}'


def test_update_ledger_goes_on_without_the_lock_when_another_writer_holds_it(layout):
    """A lock held elsewhere past the wait does not block the update: it is applied anyway."""
    holder = os.open(layout.node_ledger.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        update_ledger(layout, lambda ledger: ledger.charged(lost("n1", 1.0)), lock_wait_s=0.0)
    finally:
        os.close(holder)
    assert Ledger.load(layout).faults == (lost("n1", 1.0),)


@pytest.mark.parametrize(
    ("state", "strong"),
    [
        ("down", True),
        ("down*", True),
        ("DOWN", True),
        ("drained", True),
        ("draining", True),
        ("drain*", True),
        ("fail", True),
        ("failing", True),
        ("mixed+drain", True),
        ("idle+drain*", True),
        ("down~", True),
        ("idle", False),
        ("idle*", False),
        ("idle~", False),
        ("mixed", False),
        ("allocated", False),
        ("allocated+", False),
        ("completing", False),
        ("reserved", False),
        ("unknown", False),
        ("", False),
        (None, False),
    ],
)
def test_slurm_states_that_take_a_node_out_are_strong(state, strong):
    """Down, drain(ed/ing) and fail(ing), as a base state or a +flag, with any suffix mark, are strong."""
    assert is_strong_slurm_state(state) is strong


def test_parse_sinfo_reads_node_state_lines_and_prefers_a_strong_state():
    """parse_sinfo() maps each node to its state, skips odd lines, and keeps a strong state over a weak one."""
    text = "n1 idle\nn2 down*\n\ngarbage\nn3 mixed+drain\nn2 idle\nn4 allocated extra\nn1 drained\n"
    assert parse_sinfo(text) == {"n1": "drained", "n2": "down*", "n3": "mixed+drain"}


def test_with_a_minimum_the_plan_shrinks_to_every_usable_node_and_refuses_below_it():
    """slurm.min_nodes: no spare left, the run goes on with what is usable, down to the minimum."""
    assert plan_nodes(["n1", "n2", "n3"], {"n2": "lost"}, 3, minimum=1) == (["n1", "n3"], [])
    assert plan_nodes(["n1", "n2", "n3"], {}, 2, minimum=1) == (["n1", "n2"], ["n3"])  # a spare still comes first
    with pytest.raises(TooFewNodes, match="needs 2 nodes, 1 usable left"):
        plan_nodes(["n1", "n2", "n3"], {"n2": "lost", "n3": "down"}, 3, minimum=2)


@pytest.mark.parametrize(
    ("policy", "said"),
    [
        ({"nodes": 2, "spare_nodes": 1}, "--nodes=2-3"),
        ({"nodes": 2, "spare_nodes": 1, "min_nodes": 1}, "--nodes=1-3"),  # a run that may shrink may start small
        ({"nodes": 2, "spare_nodes": 0, "min_nodes": 2}, "--nodes=2"),
        ({"nodes": 2, "spare_nodes": 0, "min_nodes": "1"}, "--nodes=2"),  # the state file is untrusted: a default
    ],
)
def test_sbatch_args_name_the_node_range_the_run_can_use(tmp_path, capsys, monkeypatch, policy, said):
    """`trainwarden nodes --sbatch-args`: from the smallest the run accepts to nodes + spares."""
    from supervisor import cli
    from supervisor.cli import main

    monkeypatch.setattr(cli, "shortfall", lambda excluded, minimum, timeout: None)  # the partition can hold it
    from supervisor.core import Policy, initial_state
    from supervisor.observe.status import snapshot, write_status

    layout = RunLayout(tmp_path)
    state = initial_state(
        Policy(nproc=4, max_restarts=0, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=1.0, kill_grace_s=1.0)
    )
    write_status(layout, snapshot(state, now=0.0, extra={"node_policy": policy}), durable=False)
    assert main(["nodes", "--sbatch-args", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{said}\n"


def test_sbatch_args_print_nothing_and_fail_when_the_partition_can_never_hold_the_job(tmp_path, capsys, monkeypatch):
    """Two of four nodes excluded and a third drained, the run needing 2: no job to submit, one line says why."""
    from supervisor import cli
    from supervisor.cli import main

    partition = {"n1": "down*", "n2": "idle", "n3": "drained", "n4": "idle"}
    monkeypatch.setattr(cli, "node_states", lambda nodes: {n: partition[n] for n in nodes})
    monkeypatch.setattr(
        cli, "shortfall", lambda excluded, minimum, timeout: partition_shortfall(partition, excluded, minimum)
    )
    (tmp_path / "supervisor").mkdir()
    layout = RunLayout(tmp_path)
    Ledger((lost("n1", time.time()), lost("n2", time.time()))).save(layout)
    from supervisor.core import Policy, initial_state
    from supervisor.observe.status import snapshot, write_status

    state = initial_state(
        Policy(nproc=4, max_restarts=0, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=1.0, kill_grace_s=1.0)
    )
    write_status(layout, snapshot(state, now=0.0, extra={"node_policy": {"nodes": 2, "spare_nodes": 1}}), durable=False)
    assert main(["nodes", "--sbatch-args", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "trainwarden: no job to submit: the cluster can never hold the job: it needs at least 2 node(s), 4 in it, "
        "1 usable (n4); excluded by the run's node ledger: n1, n2; out in Slurm: n3 drained\n"
    )


@pytest.mark.parametrize(
    ("partition", "excluded", "minimum", "missing"),
    [
        ({"n1": "idle", "n2": "allocated", "n3": "mixed"}, ["n1"], 2, None),  # busy nodes count: they free up
        ({"n1": "idle", "n2": "idle"}, [], 2, None),
        ({"n1": "idle", "n2": "idle", "n3": "idle"}, ["n1", "n2", "elsewhere"], 2, "1 usable (n3); excluded by"),
        ({"n1": "down*", "n2": "mixed+drain", "n3": "idle"}, [], 2, "out in Slurm: n1 down*, n2 mixed+drain"),
        ({}, [], 1, "0 in it, none usable"),
    ],
)
def test_partition_shortfall_counts_listed_nodes_neither_excluded_nor_out_in_slurm(
    partition, excluded, minimum, missing
):
    """The sinfo check's arithmetic: usable = in the partition, not excluded by the ledger, not down/drained/failed;
    enough of them for the smallest job the run accepts, or one line naming what is missing."""
    said = partition_shortfall(partition, excluded, minimum, name="debug")
    if missing is None:
        assert said is None
    else:
        assert said is not None and said.startswith("partition debug can never hold the job: it needs at least ")
        assert missing in said


def test_a_persistent_verdict_excludes_its_node_until_an_operator_forgives_it(layout):
    """A persistent silent-data-corruption verdict ("sdc") excludes the node for good, however long ago; it
    survives the run dir's round trip (a resubmission sees it) and `--forget` clears it."""
    verdict = DeviceVerdict(2, 5, "persistent", 60, 59, "reproduced on rank 5, not on rank 4", node="n2", gpu=1)
    fault = device_fault(verdict, "n2", 0.0)
    assert (fault.kind, fault.reason) == ("sdc", verdict.text)
    Ledger().charged(fault).save(layout)
    ledger = Ledger.load(layout)
    assert ledger.excluded(100 * HOUR, **POLICY) == {"n2": f"for good: {verdict.text}"}
    assert ledger.device_verdicts() == [{"node": "n2", "verdict": "persistent", "reason": verdict.text, "at": 0.0}]
    assert ledger.forgiven("n2", HOUR).excluded(HOUR, **POLICY) == {}


def test_transient_verdicts_exclude_a_node_at_max_strikes_within_a_window_that_slides():
    """Strikes count within strike_window_s (default 3 in 8 h, like Ascend's alarms): the third within it excludes
    the node; once the oldest ages out the node is usable again; strikes do not count as failures, nor failures as
    strikes."""
    verdict = DeviceVerdict(0, 1, "transient", 5, 4, "gone on a re-run", node="n1", gpu=None)
    strikes = [device_fault(verdict, "n1", at) for at in (0.0, HOUR, 2 * HOUR)]
    assert {s.kind for s in strikes} == {"strike"}
    two = Ledger().charged(strikes[0]).charged(strikes[1])
    assert two.excluded(2 * HOUR, **POLICY) == {}  # max_failures 2 counts failures, not strikes
    three = two.charged(strikes[2])
    why = three.excluded(2 * HOUR, **POLICY)["n1"]
    assert why == "3 transient faults in 8h00m, last: transient silent data corruption on rank 1 (n1) at step 5"
    assert three.excluded(8.5 * HOUR, **POLICY) == {}  # the first strike left the window
    assert three.excluded(2 * HOUR, **POLICY, max_strikes=4) == {}
    assert three.rows(2 * HOUR, **POLICY)[0]["faults"] == 3
    failures = Ledger(tuple(NodeFault("n1", at, "rank 0 killed by SIGSEGV") for at in (0.0, 1.0)))
    assert failures.excluded(2.0, **POLICY, max_strikes=1)["n1"].startswith("failed 2 times")
