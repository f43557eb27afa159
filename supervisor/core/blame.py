"""Naming a hang's culprit from every rank's evidence (pure: plain values in, one verdict out; no torch).

The evidence, strongest first:
- the process state seen before any signal: a rank stopped (SIGSTOP) or in uninterruptible sleep is *silent*;
- the flight recorders (PyTorch's record of each rank's collectives, `worker.flight`), per process group, training's
  groups first, the checkpoint writer's last (its collectives run in a background thread; a verdict there is a save
  hang, in phase save):
  - *desync*: at one sequence number the ranks issued different operations or sizes; the rank in the minority (a
    root-based or variable-size collective's sizes differ by design: only its operation counts);
  - a rank behind its peers on enqueue is the culprit: *host-side* when it completed all it enqueued (stuck in
    Python, data loading, compute), *in-collective* when its last collective never completed (its peers did);
  - *in-collective* too: every rank enqueued the same collective, one never completed (or never started) it;
  - a rank with the worker library that wrote no flight recorder by the deadline while its peers did: *silent*;
- the stacks: the one rank outside every collective is *host-side*;
- else the heartbeats: the rank that went silent first (the caller's guess; no class).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from supervisor.core.hangs import SAVE_PHASE
from worker.contract import CHECKPOINT_WRITER_GROUP

__all__ = [
    "CLASSES",
    "GroupRecord",
    "Verdict",
    "blocked_behind",
    "name_culprit",
    "outside_collectives",
    "parse_flight",
    "trim_flight",
]

HOST_SIDE, IN_COLLECTIVE, DESYNC, SILENT = "host-side", "in-collective", "desync", "silent"
CLASSES = (HOST_SIDE, IN_COLLECTIVE, DESYNC, SILENT)
RECENT = 16  # newest collectives kept per process group: a desync shows within the last few
MAX_FIELD_CHARS = 200
FROZEN_STATES = {
    "stopped": "stopped (SIGSTOP)",
    "tracing-stop": "stopped by a tracer",
    "disk-sleep": "in uninterruptible sleep (D state: stuck I/O)",
}
_DATA_LOADER_FRAMES = "torch/utils/data/"
# Frames of a rank waiting for its peers: inside a collective, or in backward where DDP all-reduces.
_COLLECTIVE_FRAMES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
_STATE_ORDER = {"scheduled": 0, "started": 1, "completed": 2}
# Collectives whose input sizes differ from rank to rank by design: a scatter's or a broadcast's (only its root has
# the data; NCCL's out-of-place forms too), a gather's, an all-to-all's splits. At one sequence number their
# operation must match, their sizes need not.
SIZES_DIFFER_BY_DESIGN = frozenset(
    {"scatter", "gather", "broadcast", "_broadcast_oop", "all_to_all", "alltoall", "alltoall_base"}
)


@dataclass(frozen=True)
class Collective:
    seq: int
    op: str  # "gloo:all_reduce", "nccl:all_gather", ...
    sizes: str  # the input sizes, as text
    state: str  # scheduled | started | completed


@dataclass(frozen=True)
class GroupRecord:
    """One rank's view of one process group: the newest collective it enqueued and completed, and the last few."""

    enqueued: int
    completed: int
    recent: tuple[Collective, ...]
    desc: str = ""  # the group's description (`group_desc`), as its entries carry it

    def at(self, seq: int) -> Collective | None:
        return next((c for c in self.recent if c.seq == seq), None)

    @property
    def writer(self) -> bool:
        """Whether this is the sharded checkpointer's own group (`worker.sharded`), not one of training's."""
        return self.desc == CHECKPOINT_WRITER_GROUP


@dataclass(frozen=True)
class Verdict:
    """Who hung the job, of which class, named by which evidence, and the evidence in one line."""

    rank: int | None
    cls: str | None
    named_by: str  # flight_recorder | process_state | stacks | heartbeat
    evidence: str
    phase: str | None = None  # where the hang is when the evidence knows better than the culprit's heartbeat


def trim_flight(raw: Any) -> dict[str, Any]:
    """A flight recorder dump cut to what `parse_flight` reads (for the wire: a node agent sends this)."""
    raw = raw if isinstance(raw, dict) else {}
    entries = [e for e in raw.get("entries") or [] if isinstance(e, dict) and not e.get("is_p2p")]
    kept: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        kept.setdefault(str(entry.get("pg_id")), []).append(
            {
                k: entry.get(k)
                for k in (
                    "pg_id",
                    "process_group",
                    "collective_seq_id",
                    "profiling_name",
                    "input_sizes",
                    "state",
                    "retired",
                    "time_discovered_completed_ns",
                )
            }
        )
    return {
        "pg_status": raw.get("pg_status") if isinstance(raw.get("pg_status"), dict) else {},
        "entries": [e for group in kept.values() for e in group[-RECENT:]],
    }


def parse_flight(raw: Any) -> dict[str, GroupRecord] | None:
    """Per process group id, what a rank's (trimmed or whole) flight recorder dump says; None if it says nothing.

    The dump is the rank's to write: anything malformed is left out, never trusted."""
    if not isinstance(raw, dict):
        return None
    recent: dict[str, list[Collective]] = {}
    descs: dict[str, str] = {}
    for entry in raw.get("entries") or []:
        collective = _collective(entry)
        if collective is not None:
            pg = str(entry["pg_id"])[:MAX_FIELD_CHARS]
            recent.setdefault(pg, []).append(collective)
            descs[pg] = _desc(entry.get("process_group")) or descs.get(pg, "")
    groups = {}
    pg_status = raw.get("pg_status")
    status: dict[Any, Any] = pg_status if isinstance(pg_status, dict) else {}
    for pg in set(recent) | {str(k)[:MAX_FIELD_CHARS] for k in status}:
        seen = sorted({c.seq: c for c in recent.get(pg, [])}.values(), key=lambda c: c.seq)[-RECENT:]
        done = [c.seq for c in seen if c.state == "completed"]
        # The newest of the group's status and its entries: gloo's worker threads each set the status after they
        # finish, so one that finished an earlier collective can overwrite a later one's (its entry says retired).
        enqueued = max(_int((status.get(pg) or {}).get("last_enqueued_collective"), -1), *(c.seq for c in seen), -1)
        completed = max(_int((status.get(pg) or {}).get("last_completed_collective"), -1), *done, -1)
        if enqueued >= 0:
            groups[pg] = GroupRecord(enqueued, completed, tuple(seen), descs.get(pg, ""))
    return groups or None


def name_culprit(
    ranks: Sequence[int],
    *,
    flights: Mapping[int, Mapping[str, GroupRecord] | None],
    expected: Sequence[int] = (),
    stacks: Mapping[int, str] | None = None,
    states: Mapping[int, str] | None = None,
    collective_failed: bool = False,
) -> Verdict | None:
    """The verdict on a hung attempt of `ranks`; None when no evidence names anyone (the heartbeats' guess stands).

    `flights`: each rank's parsed flight recorder (None: none came); `expected`: the ranks that should have
    written one (they run the worker library); `stacks`: each rank's stack text; `states`: each rank's process
    state before it was signalled (psutil's names); `collective_failed`: no hang, a collective failed (a rank
    aborted on a desync): then the one rank without a record, when all records agree, is the desync's."""
    stacks, states = stacks or {}, states or {}
    for verdict in (_frozen(states), _from_flight(ranks, flights, expected, collective_failed)):
        if verdict is not None:
            return _with_stack_hint(verdict, stacks)
    culprit = outside_collectives(stacks)
    if culprit is None:
        return None
    return _with_stack_hint(Verdict(culprit, HOST_SIDE, "stacks", "the only rank outside every collective"), stacks)


def _frozen(states: Mapping[int, str]) -> Verdict | None:
    frozen = {rank: FROZEN_STATES[s] for rank, s in states.items() if s in FROZEN_STATES}
    if len(frozen) != 1:
        return None
    ((rank, how),) = frozen.items()
    return Verdict(rank, SILENT, "process_state", f"process {how}")


def _from_flight(
    ranks: Sequence[int],
    flights: Mapping[int, Mapping[str, GroupRecord] | None],
    expected: Sequence[int],
    collective_failed: bool,
) -> Verdict | None:
    records = {rank: rec for rank in ranks if (rec := flights.get(rank))}
    if len(records) < 2:
        return None
    missing = [rank for rank in expected if rank in ranks and rank not in records]
    training = {rank: {pg: g for pg, g in rec.items() if not g.writer} for rank, rec in records.items()}
    if (verdict := _per_group(training, _desync)) is not None:
        return verdict
    if collective_failed and len(missing) == 1:  # the rank that aborted on the mismatch took its record along
        return Verdict(
            missing[0],
            DESYNC,
            "flight_recorder",
            f"ranks {_ranks(list(records))} agree on every collective they recorded; rank {missing[0]}, "
            f"gone without a record, issued the mismatched one",
        )
    if (verdict := _per_group(training, _behind) or _per_group(training, _not_completed)) is not None:
        return verdict
    if len(missing) == 1 and not collective_failed:
        return Verdict(
            missing[0],
            SILENT,
            "flight_recorder",
            "wrote no flight recorder while its peers did (frozen, dead or in uninterruptible sleep)",
        )
    return _save_hang(records)


def _save_hang(records: Mapping[int, Mapping[str, GroupRecord]]) -> Verdict | None:
    """Training's groups named no one: the checkpoint writer's may. A writer stuck (in storage, in its own
    collective) holds up its rank's next save, and the hang is in phase save."""
    writer = {rank: {pg: g for pg, g in rec.items() if g.writer} for rank, rec in records.items()}
    for find in (_desync, _behind, _not_completed):
        if (verdict := _per_group(writer, find, "the checkpoint writer's ")) is not None:
            return replace(verdict, phase=SAVE_PHASE)
    return None


def _per_group(
    records: Mapping[int, Mapping[str, GroupRecord]],
    find: Callable[[str, Mapping[int, GroupRecord]], Verdict | None],
    whose: str = "",
) -> Verdict | None:
    """The first verdict `find` reaches on a process group that two or more ranks recorded (`whose`: said before
    the group's name in the evidence)."""
    for pg in sorted({pg for rec in records.values() for pg in rec}, key=_pg_order):
        members = {rank: rec[pg] for rank, rec in records.items() if pg in rec}
        if len(members) >= 2 and (verdict := find(f"{whose}process group {pg}", members)) is not None:
            return verdict
    return None


def _desync(group: str, members: Mapping[int, GroupRecord]) -> Verdict | None:
    """The first sequence number where the ranks' operations or sizes differ; the rank alone in its version."""
    seqs = sorted({c.seq for g in members.values() for c in g.recent})
    for seq in seqs:
        issued = {rank: c for rank, g in members.items() if (c := g.at(seq)) is not None}
        versions = Counter(_version(c) for c in issued.values())
        if len(versions) < 2:
            continue
        (common, count), *rest = versions.most_common()
        odd = [rank for rank, c in issued.items() if _version(c) != common]
        others = sorted(set(issued) - set(odd))
        if len(odd) != 1 or count < 2 or (rest and rest[0][1] == count):
            return Verdict(
                None,
                DESYNC,
                "flight_recorder",
                f"{group} collective #{seq}: ranks disagree ({_versions(issued)})",
            )
        mine, theirs = issued[odd[0]], issued[others[0]]
        return Verdict(
            odd[0],
            DESYNC,
            "flight_recorder",
            f"{group} collective #{seq}: rank {odd[0]} issued {_op(mine)}, ranks {_ranks(others)} issued {_op(theirs)}",
        )
    return None


def _behind(group: str, members: Mapping[int, GroupRecord]) -> Verdict | None:
    """The rank that enqueued fewer collectives than its peers: stuck before the next one, or inside its last."""
    newest = max(g.enqueued for g in members.values())
    lowest = min(g.enqueued for g in members.values())
    behind = [rank for rank, g in members.items() if g.enqueued == lowest]
    if lowest == newest:
        return None
    if len(behind) != 1:
        return Verdict(
            None,
            HOST_SIDE,
            "flight_recorder",
            f"{group}: ranks {_ranks(behind)} stopped "
            f"issuing collectives at #{lowest}, their peers went on to #{newest}",
        )
    rank, record = behind[0], members[behind[0]]
    peers_done = max(g.completed for r, g in members.items() if r != rank)
    last = record.at(record.enqueued)
    name = f"#{record.enqueued}" + ("" if last is None else f" ({_op(last)})")
    if record.completed < record.enqueued <= peers_done:
        return Verdict(
            rank,
            IN_COLLECTIVE,
            "flight_recorder",
            f"{group} collective {name}: enqueued but never completed on rank {rank}, while "
            f"its peers completed it and wait in #{newest}",
        )
    return Verdict(
        rank,
        HOST_SIDE,
        "flight_recorder",
        f"{group}: rank {rank} completed collective {name} and issued no more, while its peers wait in #{newest}",
    )


def _not_completed(group: str, members: Mapping[int, GroupRecord]) -> Verdict | None:
    """All enqueued the same newest collective: the one rank that did not complete it (or, with device states,
    did not even start it) while its peers did."""
    newest = max(g.enqueued for g in members.values())
    progress = {rank: _progress(g, newest) for rank, g in members.items()}
    least = min(progress.values())
    stuck = [rank for rank, p in progress.items() if p == least]
    if len(stuck) != 1:
        return None
    rank = stuck[0]
    last = members[rank].at(newest)
    what = "never started" if max(progress.values()) == _STATE_ORDER["started"] else "never completed"
    name = f"#{newest}" + ("" if last is None else f" ({_op(last)})")
    return Verdict(
        rank,
        IN_COLLECTIVE,
        "flight_recorder",
        f"{group} collective {name}: {what} on rank {rank}, while its peers got further",
    )


def _progress(record: GroupRecord, seq: int) -> int:
    if record.completed >= seq:
        return _STATE_ORDER["completed"]
    last = record.at(seq)
    return _STATE_ORDER.get(last.state, 0) if last is not None else 0


def outside_collectives(stacks: Mapping[int, str]) -> int | None:
    """The one rank whose stacks show no collective or backward frame, when all others are inside one.

    In a collective hang every peer waits inside the collective; the rank that is elsewhere is the cause.
    """
    dumped = {rank: text for rank, text in stacks.items() if text}
    if len(dumped) < 2:
        return None
    outside = [rank for rank, text in dumped.items() if not any(m in text for m in _COLLECTIVE_FRAMES)]
    return outside[0] if len(outside) == 1 else None


def blocked_behind(stacks: Mapping[int, str], culprit: int | None) -> tuple[int, ...]:
    """With a culprit named, the other ranks whose stacks show them inside a collective (waiting for it)."""
    if culprit is None:
        return ()
    return tuple(
        sorted(
            rank
            for rank, text in stacks.items()
            if rank != culprit and text and any(m in text for m in _COLLECTIVE_FRAMES)
        )
    )


def _with_stack_hint(verdict: Verdict, stacks: Mapping[int, str]) -> Verdict:
    """A host-side culprit's stacks may say where it waits: in a DataLoader, say so."""
    if verdict.rank is not None and verdict.cls == HOST_SIDE and _DATA_LOADER_FRAMES in stacks.get(verdict.rank, ""):
        return Verdict(
            verdict.rank, verdict.cls, verdict.named_by, f"{verdict.evidence}; its stack waits in a DataLoader"
        )
    return verdict


def _collective(entry: Any) -> Collective | None:
    if not isinstance(entry, dict) or entry.get("is_p2p") or "pg_id" not in entry:
        return None
    seq = entry.get("collective_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return None
    done = (
        entry.get("state") == "completed"
        or entry.get("retired") is True
        or bool(entry.get("time_discovered_completed_ns"))
    )
    state = "completed" if done else str(entry.get("state"))
    return Collective(
        seq,
        str(entry.get("profiling_name"))[:MAX_FIELD_CHARS],
        json.dumps(entry.get("input_sizes"))[:MAX_FIELD_CHARS],
        state,
    )


def _version(collective: Collective) -> tuple[str, str]:
    """What every rank must agree on at one sequence number: the operation, and its sizes unless they differ by
    design."""
    sizes_differ = collective.op.split(":")[-1] in SIZES_DIFFER_BY_DESIGN
    return (collective.op, "" if sizes_differ else collective.sizes)


def _desc(process_group: Any) -> str:
    """A group's description from an entry's `process_group` ([name, description]); "" when it has none."""
    if isinstance(process_group, list) and len(process_group) == 2 and isinstance(process_group[1], str):
        return process_group[1][:MAX_FIELD_CHARS]
    return ""


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


def _pg_order(pg: str) -> tuple[int, str]:
    return (_int(pg, 1 << 30), pg)


def _op(collective: Collective) -> str:
    return f"{collective.op.split(':')[-1]} {collective.sizes}"


def _versions(issued: Mapping[int, Collective]) -> str:
    return "; ".join(f"rank {rank}: {_op(c)}" for rank, c in sorted(issued.items()))


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
