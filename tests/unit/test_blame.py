"""Naming a hang's culprit from plain values: real gloo flight recorder dumps (torch 2.13, 2 and 4 ranks, each hang
made by hand; the background-save ones recorded by `bench/hang_blame.py --keep`, trimmed: tests/unit/flight_records)
and hand-written ones for what gloo cannot show (NCCL's device states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.blame import (
    RECENT,
    Verdict,
    name_culprit,
    parse_flight,
    trim_flight,
)
from tests.unit.test_stacks import IN_ALL_REDUCE_PYSPY, IN_BACKWARD, SLEEPING
from worker.flight import this_attempt

RECORDS = Path(__file__).parent / "flight_records"


def recorded(name: str) -> dict[int, Any]:
    """Each rank's parsed flight recorder of one recorded hang."""
    return {int(rank): parse_flight(raw) for rank, raw in json.loads((RECORDS / f"{name}.json").read_text()).items()}


def entry(
    seq: int,
    op: str = "all_reduce",
    sizes: Any = ((8,),),
    *,
    done: bool = True,
    pg: int = 0,
    state: str = "scheduled",
    desc: str = "default_pg",
) -> dict[str, Any]:
    return {
        "pg_id": pg,
        "process_group": [str(pg), desc],
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": sizes,
        "state": "completed" if done and state != "scheduled" else state,
        "retired": done,
    }


def flight(*entries: dict[str, Any]) -> Any:
    return parse_flight({"entries": list(entries)})


def judge(flights: dict[int, Any], **kwargs: Any) -> Verdict | None:
    return name_culprit(tuple(sorted({*flights, *kwargs.pop("extra", ())})), flights=flights, **kwargs)


def test_a_rank_that_issued_no_more_collectives_is_host_side():
    """Recorded: rank 1 slept before its fifth all-reduce while rank 0 waited inside it."""
    verdict = judge(recorded("gloo_host_side_2_ranks"))
    assert verdict == Verdict(
        1,
        "host-side",
        "flight_recorder",
        "process group 0: rank 1 completed collective #4 "
        "(broadcast [[10]]) and issued no more, while its peers wait in #5",
    )


def test_a_completed_collective_counts_though_the_groups_status_says_an_earlier_one():
    """Gloo's two worker threads each set the group's last completed collective after they finish: the thread of
    #34 (DDP's all-gather, whose completion let rank 1 go on) set it after #35's thread had, so rank 1's status says
    34 while its entry of #35 is retired. Rank 1 completed #35 and stopped: host-side, not inside #35 (it was named
    in-collective once in CI)."""
    peer = {"entries": [entry(34, "all_gather"), entry(35), entry(36, "all_gather", done=False)]}
    peer["pg_status"] = {"0": {"last_enqueued_collective": "36", "last_completed_collective": "35"}}
    late = {"entries": [entry(34, "all_gather"), entry(35)]}
    late["pg_status"] = {"0": {"last_enqueued_collective": "35", "last_completed_collective": "34"}}
    verdict = judge({0: parse_flight(peer), 1: parse_flight(late)})
    assert (verdict.rank, verdict.cls) == (1, "host-side")
    assert "rank 1 completed collective #35 (all_reduce [[8]]) and issued no more" in verdict.evidence


def test_a_collective_with_other_sizes_on_one_rank_is_a_desync_named_by_the_majority():
    """Recorded: rank 3's all-reduce had 7 elements, its peers' 8 (gloo hung; ranks 1 and 3 even completed it)."""
    verdict = judge(recorded("gloo_desync_sizes_4_ranks"))
    assert verdict == Verdict(
        3,
        "desync",
        "flight_recorder",
        "process group 0 collective #6: rank 3 issued all_reduce [[7]], ranks 0, 1, 2 issued all_reduce [[8]]",
    )


def test_a_collective_that_never_completed_on_one_rank_while_its_peers_went_on_is_in_collective():
    """Recorded: rank 3's all-reduce #6 never completed (its communication thread stalled); its peers completed it
    and wait in #7."""
    verdict = judge(recorded("gloo_in_collective_4_ranks"))
    assert (verdict.rank, verdict.cls, verdict.named_by) == (3, "in-collective", "flight_recorder")
    assert verdict.evidence == (
        "process group 0 collective #6 (all_reduce [[8]]): enqueued but never completed on "
        "rank 3, while its peers completed it and wait in #7"
    )


def test_on_nccl_the_one_rank_whose_collective_never_started_is_in_collective():
    """NCCL records device states: every rank enqueued #9, three started it, one (its stream stuck) did not."""
    started = {rank: flight(entry(8), entry(9, done=False, state="started")) for rank in (0, 1, 3)}
    verdict = judge({**started, 2: flight(entry(8), entry(9, done=False))})
    assert (verdict.rank, verdict.cls) == (2, "in-collective") and "never started on rank 2" in verdict.evidence


def test_every_rank_waiting_in_the_same_collective_leaves_the_flight_recorder_without_a_verdict():
    """Gloo shows no device states: ranks all inside #9 say nothing; the stacks decide, and without them nobody."""
    waiting = {rank: flight(entry(8), entry(9, done=False)) for rank in range(3)}
    assert judge(waiting) is None
    stacks = {0: IN_BACKWARD, 1: SLEEPING, 2: IN_ALL_REDUCE_PYSPY}
    assert judge(waiting, stacks=stacks) == Verdict(1, "host-side", "stacks", "the only rank outside every collective")


def test_two_ranks_disagreeing_name_the_desync_but_no_rank():
    """With two ranks each in its own version, there is no majority: the class and the evidence, no culprit."""
    verdict = judge({0: flight(entry(5, sizes=[[4]])), 1: flight(entry(5, sizes=[[5]]))})
    assert (verdict.rank, verdict.cls) == (None, "desync")
    assert (
        verdict.evidence == "process group 0 collective #5: ranks disagree (rank 0: all_reduce [[4]]; "
        "rank 1: all_reduce [[5]])"
    )


def test_an_extra_collective_shows_as_another_operation_at_the_same_sequence_number():
    """Rank 2 issued a broadcast its peers never did: at #7 it differs from the two others."""
    peers = {rank: flight(entry(6), entry(7, done=False)) for rank in (0, 1)}
    verdict = judge({**peers, 2: flight(entry(6), entry(7, "broadcast", done=False))})
    assert (verdict.rank, verdict.cls) == (2, "desync") and "rank 2 issued broadcast" in verdict.evidence


def test_two_ranks_behind_are_host_side_without_a_culprit():
    ahead = {rank: flight(entry(6), entry(7, done=False)) for rank in (0, 1)}
    verdict = judge({**ahead, 2: flight(entry(6)), 3: flight(entry(6))})
    assert (verdict.rank, verdict.cls) == (None, "host-side") and "ranks 2, 3 stopped" in verdict.evidence


def test_a_frozen_process_is_silent_whatever_its_record_says():
    """Stopped (SIGSTOP) before it was signalled: silent, even though woken it dumped a record like a host-side
    culprit's."""
    flights = {0: flight(entry(6), entry(7, done=False)), 1: flight(entry(6))}
    verdict = judge(flights, states={0: "sleeping", 1: "stopped"})
    assert verdict == Verdict(1, "silent", "process_state", "process stopped (SIGSTOP)")
    assert judge(flights, states={0: "disk-sleep", 1: "running"}).evidence.endswith("(D state: stuck I/O)")


def test_the_one_rank_expected_to_dump_that_wrote_nothing_is_silent():
    """Its peers all wait inside #7 and dumped; rank 2, with the worker library, wrote nothing by the deadline."""
    flights = {rank: flight(entry(6), entry(7, done=False)) for rank in (0, 1)}
    verdict = judge(flights, expected=(0, 1, 2), extra=(2,))
    assert (verdict.rank, verdict.cls, verdict.named_by) == (2, "silent", "flight_recorder")


def test_after_a_collective_failed_the_one_rank_without_a_record_is_the_desync():
    """A rank aborted on a size mismatch (gloo) and took its record along; the others agree on everything."""
    flights = {rank: flight(entry(6), entry(7, done=False)) for rank in (0, 1, 3)}
    verdict = judge(flights, expected=(0, 1, 2, 3), extra=(2,), collective_failed=True)
    assert (verdict.rank, verdict.cls) == (2, "desync") and verdict.evidence.startswith("ranks 0, 1, 3 agree")


def test_a_host_side_culprit_waiting_in_a_data_loader_says_so():
    stacks = {0: IN_BACKWARD, 1: 'File "/x/torch/utils/data/dataloader.py", line 1 in _get_data'}
    verdict = judge({0: flight(entry(6), entry(7, done=False)), 1: flight(entry(6))}, stacks=stacks)
    assert verdict.evidence.endswith("; its stack waits in a DataLoader")


def test_process_groups_are_judged_apart_and_point_to_point_is_left_out():
    """Rank 1 is behind in group 1 only; its send/recv entries are not collectives."""
    p2p = {**entry(99, "send"), "is_p2p": True}
    flights = {
        0: flight(entry(3), entry(2, pg=1), entry(3, pg=1, done=False), p2p),
        1: flight(entry(3), entry(2, pg=1), p2p),
    }
    verdict = judge(flights)
    assert (verdict.rank, verdict.cls) == (1, "host-side") and verdict.evidence.startswith("process group 1:")


def test_a_scatters_sizes_differ_by_design_and_the_training_group_names_the_culprit():
    """Recorded: a save's scatter in the checkpoint writer's group (rank 0, its root, sends [[4, 1]], its peers
    nothing) was read as rank 0's desync; rank 0 hung in Python after step 7 and is named host-side in training's."""
    flights = recorded("gloo_host_side_background_save_4_ranks")
    assert {rank: f["1"].at(15).sizes for rank, f in flights.items()} == {0: "[[4, 1]]", 1: "[]", 2: "[]", 3: "[]"}
    assert judge(flights) == Verdict(
        0,
        "host-side",
        "flight_recorder",
        "process group 0: rank 0 completed collective #19 (all_reduce [[9]]) and issued no more, while its peers "
        "wait in #20",
    )


def test_a_rank_behind_in_training_and_in_the_writers_group_is_named_by_training_in_its_own_phase():
    """Recorded: rank 1 hung at a save step, so its peers' writers wait for its writer too; training's group names
    it, and the phase stays its heartbeat's (no save hang)."""
    verdict = judge(recorded("gloo_host_side_at_a_save_4_ranks"))
    assert (verdict.rank, verdict.cls, verdict.phase) == (1, "host-side", None)
    assert verdict.evidence.startswith("process group 0: rank 1 completed collective #17 ")


def test_a_stuck_checkpoint_writer_is_a_save_hang_named_by_the_writers_group():
    """Recorded: rank 2's background write stalled inside a shard (hang_in_async_write); every loop then waited
    for its save, training's group all even; the writer's group names rank 2, in phase save."""
    assert judge(recorded("gloo_writer_stuck_4_ranks")) == Verdict(
        2,
        "host-side",
        "flight_recorder",
        "the checkpoint writer's process group 1: rank 2 completed collective #22 (scatter []) and issued no more, "
        "while its peers wait in #23",
        "save",
    )


@pytest.mark.parametrize("op", ["gloo:scatter", "gloo:gather", "gloo:broadcast", "nccl:all_to_all"])
def test_a_root_based_or_variable_size_collective_with_other_sizes_is_no_desync_but_another_operation_is(op: str):
    """Its sizes differ by design (a root's data, an all-to-all's splits); a rank issuing another operation at the
    same sequence number is still the desync."""
    root = {0: flight({**entry(5, sizes=[[3, 4]], done=False), "profiling_name": op})}
    peers = {rank: flight({**entry(5, sizes=[], done=False), "profiling_name": op}) for rank in (1, 2)}
    assert judge({**root, **peers}) is None
    verdict = judge({**root, **peers, 3: flight(entry(5, "all_reduce", done=False))})
    assert (verdict.rank, verdict.cls) == (3, "desync")


def test_the_training_groups_are_judged_before_the_checkpoint_writers():
    """A mismatch in the writer's group waits while training's group names a rank behind."""
    writer = "trainwarden_checkpoint_writer"
    flights = {
        rank: flight(entry(6), entry(7, done=False), entry(3, "all_gather", pg=1, desc=writer, done=False))
        for rank in (0, 1)
    }
    flights[2] = flight(entry(6), entry(3, "barrier", pg=1, desc=writer, done=False))
    verdict = judge(flights)
    assert (verdict.rank, verdict.cls, verdict.phase) == (2, "host-side", None)
    assert verdict.evidence.startswith("process group 0: ")
    flights[2] = flight(entry(6), entry(7, done=False), entry(3, "barrier", pg=1, desc=writer, done=False))
    verdict = judge(flights)
    assert (verdict.rank, verdict.cls, verdict.phase) == (2, "desync", "save")
    assert verdict.evidence.startswith("the checkpoint writer's process group 1 collective #3: rank 2 issued barrier")


@pytest.mark.parametrize(
    ("process_group", "desc"),
    [(["1", "trainwarden_checkpoint_writer"], "trainwarden_checkpoint_writer"), ("x", ""), (["1", 5], ""), (None, "")],
)
def test_a_groups_description_is_read_from_a_name_and_description_pair_only(process_group: Any, desc: str):
    record = parse_flight({"entries": [{**entry(1), "process_group": process_group}]})
    assert record["0"].desc == desc and record["0"].writer is bool(desc)


@pytest.mark.parametrize(
    "junk",
    [
        None,
        [],
        "x",
        {"entries": "x"},
        {"entries": [1, None, {"pg_id": 0}]},
        {"entries": [{**entry(1), "collective_seq_id": True}]},
        {"entries": [{**entry(1), "collective_seq_id": -4}]},
        {"pg_status": {"0": {"last_enqueued_collective": "x"}}},
    ],
)
def test_a_malformed_record_says_nothing(junk: Any):
    assert parse_flight(junk) is None


def test_a_record_is_cut_to_what_is_judged_and_long_fields_are_capped():
    """The newest RECENT collectives per group travel; a rank's absurd field is cut, never trusted."""
    raw = {"entries": [entry(seq) for seq in range(1, 100)] + [{**entry(100), "profiling_name": "x" * 10_000}]}
    trimmed = trim_flight(raw)
    assert [e["collective_seq_id"] for e in trimmed["entries"]] == list(range(101 - RECENT, 101))
    record = parse_flight(trimmed)["0"]
    assert (record.enqueued, record.completed, len(record.recent)) == (100, 100, RECENT)
    assert len(record.at(100).op) == 200


def test_a_process_that_recovered_in_place_shows_only_this_attempts_groups_by_name():
    """Seen in CI: in attempt 6, rank 0's process (replaced in attempt 4) had made process groups 0, 1 and 2, rank
    1's (replaced in attempt 5) groups 0 and 1; rank 0 hung after its step, rank 1 waited in the next all-reduce.
    Compared by id, rank 1's live group met rank 0's group of attempt 5, and rank 1 was named. The worker's dump
    keeps this attempt's collectives only, each group by its name: rank 0 is named, host-side."""
    since = 10_000

    def at(created: int, seq: int, *, pg: int, name: str, done: bool = True) -> dict[str, Any]:
        return {**entry(seq, pg=pg, done=done), "process_group": [name, "default_pg"], "time_created_ns": created}

    rank0 = {
        "entries": [
            *(at(5_000, s, pg=1, name="0") for s in range(20, 25)),  # attempt 5's default group, reached #24
            *(at(since + s, s, pg=2, name="0") for s in range(1, 17)),  # this attempt: completed #16, then slept
        ],
        "pg_status": {"1": {"last_enqueued_collective": "24", "last_completed_collective": "24"}},
    }
    rank1 = {
        "entries": [
            *(at(since + s, s, pg=1, name="0") for s in range(1, 17)),
            at(since + 17, 17, pg=1, name="0", done=False),
        ],
        "pg_status": {"1": {"last_enqueued_collective": "17", "last_completed_collective": "16"}},
    }
    stale = judge({0: parse_flight(rank0), 1: parse_flight(rank1)})
    assert stale is not None and stale.rank == 1  # the wrong rank, by the old groups
    fresh = judge({0: parse_flight(this_attempt(rank0, since)), 1: parse_flight(this_attempt(rank1, since))})
    assert fresh is not None and (fresh.rank, fresh.cls) == (0, "host-side")
