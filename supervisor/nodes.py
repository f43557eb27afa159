"""Which nodes a multi-node run uses: its allocation less the nodes that failed it (pure), and the per-node
failure ledger in the run dir that lets a requeued job refuse a node that failed it before."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from worker.contract import RunLayout
from worker.files import atomic_write_json, read_json

__all__ = ["Ledger", "NodeFault", "TooFewNodes", "plan_nodes"]

MAX_FAULTS_KEPT = 1000  # the newest; a run that loses more nodes than this has bigger problems
MAX_NODE_NAME = 255  # a hostname


@dataclass(frozen=True)
class NodeFault:
    """A node charged with a failure: `fatal` ones (the node was lost) exclude it at once."""

    node: str
    at: float  # wall-clock seconds: the ledger outlives this supervisor and this machine's monotonic clock
    reason: str
    fatal: bool = False


@dataclass(frozen=True)
class Ledger:
    """Every node fault of the run, oldest first."""

    faults: tuple[NodeFault, ...] = ()

    def charged(self, fault: NodeFault) -> Ledger:
        return Ledger((*self.faults, fault)[-MAX_FAULTS_KEPT:])

    def excluded(self, now: float, *, max_failures: int, window_s: float) -> dict[str, str]:
        """Node -> why, for nodes lost once or charged `max_failures` times within the last `window_s`."""
        out: dict[str, str] = {}
        recent: dict[str, list[NodeFault]] = {}
        for fault in self.faults:
            if fault.fatal:
                out[fault.node] = fault.reason
            elif now - fault.at <= window_s:
                recent.setdefault(fault.node, []).append(fault)
        for node, faults in recent.items():
            if node not in out and len(faults) >= max_failures:
                out[node] = f"failed {len(faults)} times in {window_s:g} s, last: {faults[-1].reason}"
        return out

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


def _fault(entry: object) -> NodeFault:
    if not isinstance(entry, dict):
        raise ValueError("a fault is not an object")
    node, at, reason, fatal = entry.get("node"), entry.get("at"), entry.get("reason"), entry.get("fatal", False)
    if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_NAME or not node.isprintable():
        raise ValueError(f"a fault's node is not a host name: {str(node)[:40]!r}")
    if type(at) not in (int, float) or not isinstance(reason, str) or not isinstance(fatal, bool):
        raise ValueError(f"a fault of {node} has fields of the wrong type")
    return NodeFault(node, float(at), reason[:300], fatal)


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


def plan_nodes(allocation: Sequence[str], excluded: Mapping[str, str], needed: int) -> tuple[list[str], list[str]]:
    """(the nodes to run on, in group-rank order; the spares), in the allocation's order less the excluded."""
    usable = [node for node in allocation if node not in excluded]
    if len(usable) < needed:
        raise TooFewNodes(needed, usable, excluded)
    return usable[:needed], usable[needed:]
