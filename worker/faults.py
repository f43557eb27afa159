"""Fault injection for demos and tests: real faults (SIGKILL, a torn save) at a chosen rank and step.

`TRAINWARDEN_FAULTS` holds comma-separated `RANK:KIND@STEP` items, e.g. `1:sigkill@25`.
A fault fires only in the first attempt of a run, so the relaunched run can pass the same step.
Kinds:
- `sigkill`: the rank SIGKILLs itself right after finishing step STEP.
- `sigkill_in_save`: the rank SIGKILLs itself halfway through writing its checkpoint of step STEP.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["ENV_FAULTS", "KINDS", "Fault", "FaultPlan", "parse_faults"]

ENV_FAULTS = "TRAINWARDEN_FAULTS"
KINDS = ("sigkill", "sigkill_in_save")


@dataclass(frozen=True)
class Fault:
    """One fault to inject: what, on which rank, at which step."""

    rank: int
    kind: str
    step: int


def parse_faults(spec: str) -> list[Fault]:
    """Parse `RANK:KIND@STEP[,...]`; raises ValueError naming the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            rank, rest = item.split(":", 1)
            kind, step = rest.split("@", 1)
            fault = Fault(rank=int(rank), kind=kind, step=int(step))
        except ValueError:
            raise ValueError(f"{ENV_FAULTS}: cannot parse {item!r}; expected RANK:KIND@STEP") from None
        if fault.kind not in KINDS:
            raise ValueError(f"{ENV_FAULTS}: unknown fault kind {fault.kind!r} in {item!r}; known: {KINDS}")
        faults.append(fault)
    return faults


class FaultPlan:
    """The faults armed for this rank in this attempt; `due()` is a set lookup, cheap every step."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int) -> None:
        armed = attempt == 0
        self._due = {(f.kind, f.step) for f in faults if armed and f.rank == rank}

    @classmethod
    def from_env(cls, *, rank: int, attempt: int) -> FaultPlan:
        return cls(parse_faults(os.environ.get(ENV_FAULTS, "")), rank=rank, attempt=attempt)

    def due(self, kind: str, step: int) -> bool:
        return bool(self._due) and (kind, step) in self._due

    @staticmethod
    def kill_self() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
