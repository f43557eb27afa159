"""Which nodes a multi-node run uses: its allocation less the nodes that failed it (pure), and the per-node
failure ledger in the run dir that lets a requeued job refuse a node that failed it before.

A node is refused for good only on strong evidence: it was lost and Slurm marks it down, drained or failed
(a "down" entry makes that verdict outlast Slurm resuming the node), it failed `max_failures` times
within `window_s`, or a re-run found one of its GPUs corrupting results persistently ("sdc"); transient
corruption ("strike") excludes it after `max_strikes` within `strike_window_s`. A node lost while Slurm still
has it up cools down for `cooldown_s`, then is tried again.
An operator's "forgiven" entry clears every earlier fault of its node.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard, cast

from supervisor.core.devices import PERSISTENT, DeviceVerdict
from supervisor.core.model import duration
from worker.contract import RunLayout
from worker.files import atomic_write_json, open_in, read_json

__all__ = [
    "COOLING_DOWN",
    "EXCLUDED",
    "FOR_GOOD",
    "KINDS",
    "USABLE",
    "Ledger",
    "NodeFault",
    "TooFewNodes",
    "device_fault",
    "is_strong_slurm_state",
    "parse_sinfo",
    "partition_shortfall",
    "plan_nodes",
    "render_rows",
    "update_ledger",
]

MAX_FAULTS_KEPT = 1000  # the newest; a run that loses more nodes than this has bigger problems
MAX_NODE_NAME = 255  # a hostname
MAX_REASON = 300
LOCK_WAIT_S = 5.0
# "sdc": a persistent silent-data-corruption verdict on one of its GPUs (excluded until forgiven); "strike": a
# transient one (max_strikes within strike_window_s exclude it): supervisor.core.devices.
KINDS = ("failed", "lost", "down", "forgiven", "sdc", "strike")
COUNTED = ("failed", "lost", "sdc", "strike")  # the faults a row counts
FOR_GOOD, EXCLUDED, COOLING_DOWN, USABLE = "excluded for good", "excluded", "cooling down", "usable"
_STATUS_ORDER = (FOR_GOOD, EXCLUDED, COOLING_DOWN, USABLE)
# Slurm base states and flags (long %T and short %t spellings) that say the node is gone or being taken out.
_STRONG = frozenset({"down", "drain", "drained", "draining", "drng", "fail", "failing", "failg"})
_STATE_MARKS = "*~#!%$@^-"  # not responding, powered down, powering up, ...: suffixes on a state, not states


def is_strong_slurm_state(state: str | None) -> bool:
    """Whether a `sinfo -N -o '%N %T'` state ("down*", "drained", "mixed+drain", ...) takes the node out."""
    if not state:
        return False
    return any(part.strip().rstrip(_STATE_MARKS) in _STRONG for part in state.lower().split("+"))


def parse_sinfo(text: str) -> dict[str, str]:
    """Node -> state from `sinfo -h -N -o '%N %T'` output; lines that are not "NODE STATE" are skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split()
        # A node listed once per partition: a strong state in any listing wins.
        if len(fields) == 2 and (fields[0] not in out or is_strong_slurm_state(fields[1])):
            out[fields[0]] = fields[1]
    return out


@dataclass(frozen=True)
class NodeFault:
    """A ledger entry: a node "failed" (counts toward max_failures), was "lost" (cools down), was lost and
    confirmed "down" by Slurm (excluded for good), or was "forgiven" by an operator (earlier entries void)."""

    node: str
    at: float  # wall-clock seconds: the ledger outlives this supervisor and this machine's monotonic clock
    reason: str
    kind: str = "failed"

    def __post_init__(self) -> None:
        # Checked on every way in (the file, `--forget NAME`): one bad entry would make the whole ledger unreadable.
        if not isinstance(self.node, str) or not 0 < len(self.node) <= MAX_NODE_NAME or not self.node.isprintable():
            raise ValueError(f"a fault's node is not a host name: {str(self.node)[:40]!r}")
        if self.kind not in KINDS:
            raise ValueError(f"a fault of {self.node} has an unknown kind {str(self.kind)[:40]!r} (one of {KINDS})")
        if type(self.at) not in (int, float) or not math.isfinite(self.at) or not isinstance(self.reason, str):
            raise ValueError(f"a fault of {self.node} has fields of the wrong type")


@dataclass(frozen=True)
class Ledger:
    """Every node fault of the run, oldest first (file order is the truth: writers append under a lock)."""

    faults: tuple[NodeFault, ...] = ()

    def charged(self, fault: NodeFault) -> Ledger:
        return Ledger((*self.faults, fault)[-MAX_FAULTS_KEPT:])

    def forgiven(self, node: str, now: float, reason: str = "forgiven by an operator") -> Ledger:
        """The ledger with `node`'s earlier faults voided (`trainwarden nodes RUN_DIR --forget NODE`)."""
        return self.charged(NodeFault(node, now, reason, "forgiven"))

    def confirmed(self, slurm_states: Mapping[str, str], now: float) -> Ledger:
        """The ledger with a "down" entry for each node whose latest fault is a loss and that Slurm now takes
        out, so the verdict outlasts Slurm resuming it; `self` itself when there is none."""
        ledger = self
        for node, entries in self._since_forgiven().items():
            state = slurm_states.get(node)
            if entries[-1].kind == "lost" and is_strong_slurm_state(state):
                ledger = ledger.charged(NodeFault(node, now, f"{entries[-1].reason}; Slurm marked it {state}", "down"))
        return ledger

    def excluded(
        self,
        now: float,
        *,
        max_failures: int,
        window_s: float,
        cooldown_s: float,
        max_strikes: int = 3,
        strike_window_s: float = 28800.0,
        slurm_states: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """Node -> why (one line), for every node that must not be used now."""
        strikes = (max_strikes, strike_window_s)
        verdicts = self._verdicts(now, max_failures, window_s, cooldown_s, strikes, slurm_states or {})
        return {node: why for node, (status, why) in verdicts.items() if status != USABLE}

    def rows(
        self,
        now: float,
        *,
        max_failures: int,
        window_s: float,
        cooldown_s: float,
        max_strikes: int = 3,
        strike_window_s: float = 28800.0,
        slurm_states: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """One row per node in the ledger, the worst status first, then by name: node, status, reason, faults
        (failures and losses since its last forgiveness), last_fault_at (wall clock or None), slurm_state."""
        states = slurm_states or {}
        verdicts = self._verdicts(now, max_failures, window_s, cooldown_s, (max_strikes, strike_window_s), states)
        rows = []
        for node, entries in self._since_forgiven().items():
            counted = [f for f in entries if f.kind in COUNTED]
            status, why = verdicts[node]
            rows.append(
                {
                    "node": node,
                    "status": status,
                    "reason": why,
                    "faults": len(counted),
                    "last_fault_at": counted[-1].at if counted else None,
                    "slurm_state": states.get(node),
                }
            )
        return sorted(rows, key=lambda row: (_STATUS_ORDER.index(row["status"]), row["node"]))

    def device_verdicts(self, newest: int = 10) -> list[dict[str, Any]]:
        """The newest verdicts on devices (re-runs that found silent data corruption), oldest first, for `status`:
        node, verdict (persistent or transient), reason, at (wall clock)."""
        found = [f for f in self.faults if f.kind in ("sdc", "strike")][-newest:]
        words = {"sdc": "persistent", "strike": "transient"}
        return [{"node": f.node, "verdict": words[f.kind], "reason": f.reason, "at": f.at} for f in found]

    def _since_forgiven(self) -> dict[str, list[NodeFault]]:
        """Node -> its entries from its newest "forgiven" one (included) on, oldest first."""
        out: dict[str, list[NodeFault]] = {}
        for fault in self.faults:
            out[fault.node] = [fault] if fault.kind == "forgiven" else [*out.get(fault.node, []), fault]
        return out

    def _verdicts(
        self,
        now: float,
        max_failures: int,
        window_s: float,
        cooldown_s: float,
        strikes: tuple[int, float],
        states: Mapping[str, str],
    ) -> dict[str, tuple[str, str]]:
        return {
            node: _verdict(entries, now, max_failures, window_s, cooldown_s, strikes, states.get(node))
            for node, entries in self._since_forgiven().items()
        }

    @classmethod
    def load(cls, layout: RunLayout) -> Ledger:
        """The run dir's ledger; empty when there is none. ValueError/OSError for one that cannot be used."""
        try:
            raw = read_json(layout.node_ledger)
        except FileNotFoundError:
            return cls()
        if not isinstance(raw, dict) or not isinstance(raw.get("faults"), list):
            raise ValueError(f"{layout.node_ledger}: not a node ledger")
        return cls(tuple(_fault(entry) for entry in raw["faults"][-MAX_FAULTS_KEPT:]))

    def save(self, layout: RunLayout) -> None:
        atomic_write_json(layout.node_ledger, {"faults": [asdict(f) for f in self.faults]}, root=layout.root)


def _verdict(
    entries: Sequence[NodeFault],
    now: float,
    max_failures: int,
    window_s: float,
    cooldown_s: float,
    strikes: tuple[int, float],
    state: str | None,
) -> tuple[str, str]:
    """(status, why) of one node from its entries since its last forgiveness."""
    down = [f for f in entries if f.kind in ("down", "sdc")]
    if down:
        return FOR_GOOD, f"for good: {down[-1].reason}"
    lost = [f for f in entries if f.kind == "lost"]
    if entries[-1].kind == "lost" and is_strong_slurm_state(state):
        return FOR_GOOD, f"for good: {lost[-1].reason}; Slurm says {state}"
    if lost and now - lost[-1].at < cooldown_s:
        return COOLING_DOWN, f"{lost[-1].reason}; cooling down for another {duration(cooldown_s - (now - lost[-1].at))}"
    recent = [f for f in entries if f.kind == "failed" and now - f.at <= window_s]
    if len(recent) >= max_failures:
        return EXCLUDED, f"failed {len(recent)} times in {window_s:g} s, last: {recent[-1].reason}"
    max_strikes, strike_window_s = strikes
    struck = [f for f in entries if f.kind == "strike" and now - f.at <= strike_window_s]
    if len(struck) >= max_strikes:  # a window that slides: the oldest strike leaving it makes the node usable again
        return EXCLUDED, f"{len(struck)} transient faults in {duration(strike_window_s)}, last: {struck[-1].reason}"
    return USABLE, entries[-1].reason if entries[-1].kind == "forgiven" else f"last: {entries[-1].reason}"


def device_fault(verdict: DeviceVerdict, node: str, now: float) -> NodeFault:
    """The ledger entry of a verdict on one of `node`'s devices: persistent excludes it, transient is a strike."""
    return NodeFault(node, now, verdict.text[:MAX_REASON], "sdc" if verdict.verdict == PERSISTENT else "strike")


def _fault(entry: object) -> NodeFault:
    if not isinstance(entry, dict):
        raise ValueError("a fault is not an object")
    node, at, reason, fatal = entry.get("node"), entry.get("at"), entry.get("reason"), entry.get("fatal", False)
    if not _is_number(at) or not isinstance(reason, str) or not isinstance(fatal, bool):
        raise ValueError(f"a fault of {str(node)[:40]!r} has fields of the wrong type")
    # Ledgers written before kinds: a fatal fault was a lost node, any other a failure.
    kind = entry.get("kind", "lost" if fatal else "failed")
    return NodeFault(cast(str, node), float(at), reason[:MAX_REASON], kind)  # str: NodeFault checks the node's name


def _is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return type(value) in (int, float)


def update_ledger(layout: RunLayout, change: Callable[[Ledger], Ledger], *, lock_wait_s: float = LOCK_WAIT_S) -> Ledger:
    """Load, `change` and save the run dir's ledger under an exclusive lock (the supervisor and an operator's
    `--forget` write it at once); saved only when changed. ValueError/OSError for a ledger that cannot be
    read, which is left as it is: the caller decides whether to start afresh."""
    with _locked(layout, lock_wait_s):
        before = Ledger.load(layout)
        after = change(before)
        if after != before:
            after.save(layout)
        return after


@contextlib.contextmanager
def _locked(layout: RunLayout, wait_s: float) -> Iterator[bool]:
    """Holds an exclusive flock on the ledger's lock file while inside; yields whether it got one."""
    try:
        fd = open_in(layout.node_ledger.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, root=layout.root)
    except OSError:
        fd = -1  # no lock file to be had (odd run dir): the update itself says what is wrong, if anything
    try:
        yield fd >= 0 and _flock(fd, wait_s)
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def _flock(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False  # no locking here (an NFS mount without lockd): a rare race beats no ledger
        if time.monotonic() >= deadline:
            return False  # a holder that hangs (a stopped `--forget`, a stuck NFS client) must not stall the supervisor
        time.sleep(0.05)


def render_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """`Ledger.rows` as the short table `trainwarden nodes RUN_DIR` prints."""
    if not rows:
        return "no node has been charged with a fault in this run"
    table = [("NODE", "STATUS", "FAULTS", "LAST FAULT", "SLURM", "REASON")]
    for row in rows:
        at = row["last_fault_at"]
        last = "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        table.append((row["node"], row["status"], str(row["faults"]), last, row["slurm_state"] or "-", row["reason"]))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table)


class TooFewNodes(Exception):
    """The allocation has fewer usable nodes than the run needs; the message names the excluded ones."""

    def __init__(self, needed: int, usable: Sequence[str], excluded: Mapping[str, str]) -> None:
        bad = ", ".join(f"{node} ({why})" for node, why in excluded.items())
        super().__init__(f"needs {needed} nodes, {len(usable)} usable left; excluded: {bad or 'none'}")
        self.excluded = dict(excluded)

    @property
    def exclude_option(self) -> str:
        """What to resubmit with so that Slurm places the job elsewhere."""
        return f"--exclude={','.join(sorted(self.excluded))}"


def plan_nodes(
    allocation: Sequence[str], excluded: Mapping[str, str], needed: int, minimum: int | None = None
) -> tuple[list[str], list[str]]:
    """(the nodes to run on, in group-rank order; the spares), in the allocation's order less the excluded: `needed`
    of them, or with fewer usable every one, down to `minimum` (default: `needed`; TooFewNodes below)."""
    usable = [node for node in allocation if node not in excluded]
    if len(usable) < (needed if minimum is None else minimum):
        raise TooFewNodes(needed if minimum is None else minimum, usable, excluded)
    return usable[:needed], usable[needed:]


def partition_shortfall(
    partition: Mapping[str, str], excluded: Iterable[str], minimum: int, *, name: str | None = None
) -> str | None:
    """Why a job of at least `minimum` nodes away from `excluded` can never start in a partition whose nodes Slurm
    lists as `partition` (`sinfo -N` states), in one line naming what is missing; None when it can. Usable: listed,
    not excluded, and not down, drained or failed (a strong state: what the ledger takes out for good too)."""
    out = set(excluded)
    usable = sorted(node for node, state in partition.items() if node not in out and not is_strong_slurm_state(state))
    if len(usable) >= minimum:
        return None
    ledger = sorted(node for node in partition if node in out)
    down = sorted(node for node, state in partition.items() if node not in out and is_strong_slurm_state(state))
    what = [f"{len(usable)} usable ({', '.join(usable)})" if usable else "none usable"]
    if ledger:
        what.append(f"excluded by the run's node ledger: {', '.join(ledger)}")
    if down:
        what.append(f"out in Slurm: {', '.join(f'{node} {partition[node]}' for node in down)}")
    where = f"partition {name}" if name else "the cluster"
    needs = f"it needs at least {minimum} node(s), {len(partition)} in it"
    return f"{where} can never hold the job: {needs}, {'; '.join(what)}"
