"""The memory tier across nodes: the supervisor's choice among what nodes hold (plain values), and the agents' part
with real files and real sockets: a partner copy streamed, checked and kept in two slots, a replacement node
gathering its ranks' snapshot from the holder, and a damaged or foreign stream refused."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.launch.node_memory import (
    NodeMemory,
    choose_memory,
    held_here,
    parse_inventory,
    read_origin,
    resume_store,
    unheld_ranks,
)
from supervisor.rundir.persist import Persister
from tests.conftest import wait_until
from worker.contract import RunLayout
from worker.memory import create_memory_dir, memory_dir_for, remove_memory_dir

from .test_persist import PREFIX, Log, pin, snapshot

TOKEN = "a-run-token"
WORLD = 4


# ---- the choice (pure) -----------------------------------------------------------------------------------------------


def test_the_newest_step_held_for_every_rank_wins_and_a_node_s_own_copy_before_a_partner_s() -> None:
    held = {
        "n1": {0: {10: None, 11: None}, 1: {10: None, 11: None}, 2: {10: "n2"}, 3: {10: "n2"}},
        "n2": {2: {10: None, 11: None}, 3: {10: None}, 0: {11: "n1"}, 1: {11: "n1"}},
    }
    chosen = choose_memory(held, WORLD, newer_than=5)
    assert chosen is not None and chosen.step == 10  # 11 lacks rank 3 everywhere
    assert chosen.holders == {0: "n1", 1: "n1", 2: "n2", 3: "n2"} and chosen.label == "memory"


def test_a_lost_node_s_ranks_come_from_its_partner_and_the_label_names_it() -> None:
    held = {"n1": {0: {20: None}, 1: {20: None}, 2: {20: "n2", 19: "n2"}, 3: {20: "n2"}}}  # n2 is gone
    chosen = choose_memory(held, WORLD, newer_than=None)
    assert chosen is not None and (chosen.step, chosen.label) == (20, "memory (peer n1)")
    assert chosen.holders == dict.fromkeys(range(WORLD), "n1")


def test_nothing_newer_than_disk_nothing_refused_and_no_rank_missing_or_no_choice() -> None:
    held = {"n1": {0: {20: None}, 1: {20: None}}, "n3": {2: {20: None}}}
    assert choose_memory(held, WORLD, newer_than=None) is None  # rank 3: a node and its partner lost
    full = {"n1": {r: {20: None, 30: None} for r in range(WORLD)}}
    assert choose_memory(full, WORLD, newer_than=30) is None
    assert choose_memory(full, WORLD, newer_than=None, at_most=25).step == 20  # type: ignore[union-attr]
    assert choose_memory(full, WORLD, newer_than=None, refused={30: "damaged"}).step == 20  # type: ignore[union-attr]


def test_a_node_and_its_partner_both_lost_name_the_step_and_the_ranks_nobody_holds() -> None:
    held = {"n1": {0: {20: None, 10: None}, 1: {20: None}}, "n3": {2: {20: None}}}
    assert unheld_ranks(held, WORLD, newer_than=10) == (20, [3])
    assert unheld_ranks(held, WORLD, newer_than=20) is None  # nothing newer than disk: nothing was lost
    assert unheld_ranks({"n1": {r: {20: None} for r in range(WORLD)}}, WORLD, newer_than=None) is None


def test_an_inventory_is_read_field_by_field_and_garbage_is_left_out() -> None:
    raw = {
        "own": {"0": [3, 4], "1": ["x", -1, 5], "-2": [1], "r": [1]},
        "peer": {"n2": {"2": [4]}, "n3": "junk"},
        "bytes": 10,
    }
    assert parse_inventory(raw) == {0: {3: None, 4: None}, 1: {5: None}, 2: {4: "n2"}}
    assert parse_inventory(["not", "a", "dict"]) == {} and parse_inventory({"own": 7}) == {}


# ---- the agents' part (real files, real sockets) ---------------------------------------------------------------------


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, NodeMemory]]:
    """Two nodes' memory tiers of one run (each its own memory directory in /dev/shm), serving; removed after."""
    made: dict[str, NodeMemory] = {}
    said: list[tuple[str, str, dict[str, Any]]] = []
    try:
        for name in ("n1", "n2"):
            memory = create_memory_dir(memory_dir_for(tmp_path / name))
            layout = RunLayout(tmp_path / "run", memory=memory)
            node = made[name] = NodeMemory(layout, name, TOKEN, PREFIX, lambda e, lvl, **f: said.append((e, lvl, f)))
            node.serve()
        yield made
    finally:
        for node in made.values():
            node.close()
        # A stream still being received writes into its node's directory: wait for it, or it outlives the removal.
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "memory-stream"], timeout=20)
        for node in made.values():
            remove_memory_dir(node.memory)


def address(node: NodeMemory) -> str:
    return f"127.0.0.1:{node.port}"


def until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_newest_snapshot_goes_to_the_partner_checked_kept_in_two_slots_and_said_in_both_inventories(
    nodes: dict[str, NodeMemory],
) -> None:
    n1, n2 = nodes["n1"], nodes["n2"]
    snapshot(n1.layout.memory_slot(0), 7, (0, 1), world=WORLD)
    n1.run_for([0, 1], WORLD, address(n2), rate_bytes_s=0, log=Log())
    until(lambda: 7 in n2.inventory()["peer"].get("n1", {}).get("0", []))
    snapshot(n1.layout.memory_slot(1), 8, (0, 1), world=WORLD)
    until(lambda: 8 in n2.inventory()["peer"].get("n1", {}).get("1", []))
    assert n2.inventory()["peer"]["n1"] == {"0": [7, 8], "1": [7, 8]}  # the older copy stays whole meanwhile
    assert n1.inventory()["own"] == {"0": [7, 8], "1": [7, 8]} and n2.inventory()["own"] == {}
    slots = sorted((n2.memory / "peer" / "r0").iterdir())
    assert [read_origin(slot) for slot in slots] == ["n1", "n1"]
    snapshot(n1.layout.memory_slot(0), 9, (0, 1), world=WORLD)
    until(lambda: 9 in n2.inventory()["peer"]["n1"]["0"])
    assert n2.inventory()["peer"]["n1"]["0"] == [8, 9]  # the oldest copy went for the newest


def test_a_replacement_gathers_its_ranks_from_the_partner_s_copy_and_its_own_node(
    nodes: dict[str, NodeMemory],
) -> None:
    n1, n2 = nodes["n1"], nodes["n2"]
    snapshot(n1.layout.memory_slot(0), 12, (0, 1), world=WORLD)
    snapshot(n2.layout.memory_slot(1), 12, (2,), world=WORLD)
    assert n2.prepare_resume(12, {0: address(n1), 1: address(n1), 2: None}, WORLD) is None
    store = resume_store(n2.memory)
    for rank, source in ((0, n1.layout.memory_slot(0)), (1, n1.layout.memory_slot(0)), (2, n2.layout.memory_slot(1))):
        assert store.file(rank, 12, PREFIX).read_bytes() == source.file(rank, 12, PREFIX).read_bytes()
        assert 12 in store.steps(rank, PREFIX)
    problem = n2.prepare_resume(13, {0: address(n1)}, WORLD)
    assert problem is not None and "rank 0's snapshot of step 13 (from 127.0.0.1:" in problem
    assert "not held on n1" in problem and not store.root.exists()  # nothing half-gathered is left to load


def test_a_snapshot_damaged_in_memory_is_neither_copied_on_nor_resumed_from(nodes: dict[str, NodeMemory]) -> None:
    n1, n2 = nodes["n1"], nodes["n2"]
    slot = n1.layout.memory_slot(0)
    snapshot(slot, 5, (0, 1), world=WORLD)
    with open(slot.file(1, 5, PREFIX), "r+b") as f:  # one flipped byte, same size: only the checksum tells
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    assert "damaged in memory" in (n1.prepare_resume(5, {0: None, 1: None}, WORLD) or "")
    assert "checksum" in (n2.prepare_resume(5, {1: address(n1)}, WORLD) or "")
    said: list[Any] = []
    n1._say = lambda event, level, **fields: said.append((event, fields))  # type: ignore[method-assign]
    n1.run_for([0, 1], WORLD, address(n2), rate_bytes_s=0, log=Log())
    until(lambda: said)
    assert said[0][0] == "peer_copy_failed" and "damaged in memory" in said[0][1]["reason"]
    assert n2.inventory()["peer"] == {}  # nothing that looks complete arrived


def test_another_run_s_agent_or_a_stranger_gets_nothing(nodes: dict[str, NodeMemory]) -> None:
    n1 = nodes["n1"]
    snapshot(n1.layout.memory_slot(0), 3, (0,), world=WORLD)
    with socket.create_connection(("127.0.0.1", n1.port or 0)) as sock:
        sock.sendall(b'{"type":"fetch","token":"guess","step":3,"ranks":[0]}\n')
        sock.settimeout(5)
        assert sock.recv(100) == b""  # dropped without a word
    with socket.create_connection(("127.0.0.1", n1.port or 0)) as sock:
        sock.sendall(b"x" * 100 + b"\n")
        sock.settimeout(5)
        assert sock.recv(100) == b""


def test_a_world_size_other_than_the_attempt_s_is_refused(nodes: dict[str, NodeMemory]) -> None:
    n1 = nodes["n1"]
    snapshot(n1.layout.memory_slot(0), 3, (0,), world=WORLD)
    problem = n1.prepare_resume(3, {0: None}, 2)
    assert problem is not None and "written by 4 ranks; this attempt has 2" in problem


def test_a_node_persists_its_own_ranks_pins_and_the_checkpoint_is_complete_once_every_node_did(
    nodes: dict[str, NodeMemory],
) -> None:
    n1, n2 = nodes["n1"], nodes["n2"]
    for node, ranks in ((n1, (0, 1)), (n2, (2, 3))):
        snapshot(node.layout.memory_slot(0), 40, ranks, world=WORLD)
        pin(node.layout, 0, 40, ranks)
    disk = n1.layout.checkpoints
    Persister(n1.layout, WORLD, PREFIX, Log(), ranks=(0, 1)).persist_pins()
    assert disk.complete_steps(WORLD, PREFIX) == [] and 40 in disk.steps(1, PREFIX)
    assert not n1.layout.memory_pin(40).root.exists() and n2.layout.memory_pin(40).root.exists()
    Persister(n2.layout, WORLD, PREFIX, Log(), ranks=(2, 3)).persist_pins()
    assert disk.complete_steps(WORLD, PREFIX) == [40]
    assert os.listdir(n2.memory / "persist") == []


def test_a_successor_starting_on_a_node_of_the_run_knows_what_that_node_holds(nodes: dict[str, NodeMemory]) -> None:
    """The batch host died: the successor on n2 holds n2's own snapshots and n1's partner copy before any agent of
    its first attempt reports, so that attempt can resume from memory (`SlurmLauncher.start`)."""
    n1, n2 = nodes["n1"], nodes["n2"]
    snapshot(n1.layout.memory_slot(0), 7, (0, 1), world=WORLD)
    snapshot(n2.layout.memory_slot(0), 7, (2, 3), world=WORLD)
    n1.run_for([0, 1], WORLD, address(n2), rate_bytes_s=0, log=Log())
    until(lambda: 7 in n2.inventory()["peer"].get("n1", {}).get("1", []))
    run_dir = n2.memory.parent / "no-such-run"  # a run dir whose memory directory on this machine is n2's:
    assert held_here(RunLayout(run_dir), PREFIX) is None  # none made: nothing held
    held = held_here(RunLayout(n2.layout.root.parent / "n2"), PREFIX)
    assert held is not None and parse_inventory(held) == {2: {7: None}, 3: {7: None}, 0: {7: "n1"}, 1: {7: "n1"}}
    assert choose_memory({"n2": parse_inventory(held)}, WORLD, newer_than=None).label == "memory (peer n2)"  # type: ignore[union-attr]
