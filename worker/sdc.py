"""Which rank's own values stand out, from fingerprints taken before the gradient reduction hides them.

After DDP's all-reduce every rank holds the same averaged gradient, so a value one GPU corrupted can only be told
apart on the rank's own values from before it: its local loss, the norm of its local gradient (the buckets it
handed to the reduction) and how many of them were not finite. Each rank's fingerprint rides in the step guard's
all-reduce (worker.guard), so every rank sees every rank's at no extra collective, and names the same outliers.

The score: for each rank, how far its value lies from the median of the *other* ranks', in units of their spread
(1.4826 x the median absolute deviation, a robust standard deviation that one bad rank cannot drag), with a floor on
the spread because data-parallel ranks train different samples and their values differ by tens of percent anyway.
Gradient norms are compared in log scale (a flipped exponent bit multiplies a value by a power of two). Leaving
the rank itself out keeps an outlier from hiding itself and, with two ranks, makes the score a plain ratio against
the other rank. Only values that stand out upwards are named: a corrupted value that shrinks barely moves the mean,
and with two ranks naming both directions would name both ranks. A non-finite count on some ranks but not all
names those ranks outright. Ranks that stand out are evidence, not a verdict: data-parallel ranks see different
data, so a bad batch makes its rank stand out too; a re-run tells the two apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DATA",
    "OUTLIER_SCORE",
    "PERSISTENT",
    "TRANSIENT",
    "REPRODUCED_RTOL",
    "Fingerprint",
    "Outlier",
    "SdcVerdict",
    "fingerprint_rows",
    "fingerprint_values",
    "from_rows",
    "judge",
    "outliers",
    "partners",
    "reproduced",
    "whole_step",
]

OUTLIER_SCORE = 6.0  # robust z above which a rank is named (the adaptive spike rule's 6 sigma)
MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation
NORM_SPREAD_FLOOR = math.log(2.0)  # data-parallel ranks' gradient norms differ by up to ~2x on their own
LOSS_SPREAD_FLOOR = 0.5  # ... and their losses by up to ~half the median loss
REPRODUCED_RTOL = 1e-3  # a re-run agrees within this (Megatron-LM's, for non-deterministic backward kernels)
DATA, TRANSIENT, PERSISTENT = "data", "transient", "persistent"


@dataclass(frozen=True)
class Fingerprint:
    """One rank's own values of one step, from before the gradient reduction."""

    loss: float
    grad_norm: float
    nonfinite: int  # gradient buckets (and the loss) holding a NaN or an infinity


def fingerprint_values(loss: float, squares: list[float]) -> tuple[float, float, int]:
    """A rank's fingerprint from its loss and its gradient buckets' squared norms: (loss, norm, non-finite count),
    a non-finite loss or norm as +inf (a MAX all-reduce carries it: NaN has no order), counted."""
    finite = [x for x in squares if math.isfinite(x)]
    nonfinite = len(squares) - len(finite) + (not math.isfinite(loss))
    norm = math.sqrt(math.fsum(finite)) if len(finite) == len(squares) else math.inf
    return (loss if math.isfinite(loss) else math.inf, norm if math.isfinite(norm) else math.inf, nonfinite)


def fingerprint_rows(world: int, known: Mapping[int, tuple[float, float, int]]) -> list[float]:
    """3 x `world` values for a MAX all-reduce: the fingerprints this rank knows in their ranks' rows, -inf in the
    others' (which their ranks fill)."""
    rows = [-math.inf] * (3 * world)
    for rank, values in known.items():
        rows[3 * rank : 3 * rank + 3] = values
    return rows


def from_rows(values: Sequence[float]) -> list[Fingerprint | None]:
    """The fingerprints in reduced rows (fingerprint_rows); None for a row no rank filled."""
    rows = [values[i : i + 3] for i in range(0, len(values), 3)]
    return [None if row[0] == -math.inf else Fingerprint(row[0], row[1], int(row[2])) for row in rows]


@dataclass(frozen=True)
class Outlier:
    """A rank whose own values stood out from the other ranks' at one step, and by how much."""

    rank: int
    score: float  # the robust z of the value that stood out most (inf: non-finite values only on this rank)
    why: str


def outliers(prints: Sequence[Fingerprint], threshold: float = OUTLIER_SCORE) -> list[Outlier]:
    """The ranks whose fingerprints stand out from the others', in rank order; [] with fewer than two ranks."""
    if len(prints) < 2:
        return []
    clean = [p.nonfinite == 0 and math.isfinite(p.loss) and math.isfinite(p.grad_norm) for p in prints]
    if not any(clean):  # every rank's values are non-finite: nothing to tell them apart by
        return []
    if not all(clean):
        return [
            Outlier(rank, math.inf, f"{p.nonfinite} non-finite gradient value(s) or loss before the reduction")
            for rank, (p, ok) in enumerate(zip(prints, clean, strict=True))
            if not ok
        ]
    found = []
    for rank, mine in enumerate(prints):
        others = [p for other, p in enumerate(prints) if other != rank]
        norm_z = _score(_log(mine.grad_norm), [_log(p.grad_norm) for p in others], lambda _: NORM_SPREAD_FLOOR)
        loss_z = _score(mine.loss, [p.loss for p in others], lambda median: LOSS_SPREAD_FLOOR * abs(median))
        over = [
            f"{what} {value:.6g} stands out ({z:.1f} robust sigmas)"
            for what, value, z in (("local gradient norm", mine.grad_norm, norm_z), ("local loss", mine.loss, loss_z))
            if z > threshold
        ]
        if over:
            found.append(Outlier(rank, max(norm_z, loss_z), "; ".join(over)))
    return found


@dataclass(frozen=True)
class SdcVerdict:
    """What re-running a suspect rank's step said of it (worker.rerun)."""

    rank: int | None  # None: no rank stood out; the verdict is the whole step's
    verdict: str  # DATA: the batch's (skip it); TRANSIENT: a one-off fault (use the re-run); PERSISTENT: the rank's
    evidence: str


def judge(
    originals: Sequence[Fingerprint],
    reruns: Sequence[Fingerprint],
    crosses: dict[int, Fingerprint],
    suspects: Sequence[int],
    rtol: float = REPRODUCED_RTOL,
) -> list[SdcVerdict]:
    """Each suspect's verdict from its step's fingerprints: the original, its own re-run, and a partner's re-run of
    its batch (missing where there was no partner). Not reproduced on its own rank: transient. Reproduced there and
    on the partner: the data's. Reproduced there but not on the partner: the rank's own, persistent. Without a
    partner, reproduced counts as the data's (nothing can tell it from a persistent fault)."""
    found = []
    for rank in suspects:
        original, again, cross = originals[rank], reruns[rank], crosses.get(rank)
        seen = f"step's values {_shown(original)}; re-run on rank {rank}: {_shown(again)}"
        if not reproduced(original, again, rtol):
            found.append(SdcVerdict(rank, TRANSIENT, f"{seen}: not reproduced on the same rank"))
        elif cross is None:
            found.append(SdcVerdict(rank, DATA, f"{seen}: reproduced; no other rank to re-run it on"))
        elif reproduced(original, cross, rtol):
            found.append(SdcVerdict(rank, DATA, f"{seen}; on another rank: {_shown(cross)}: reproduced on both"))
        else:
            only = f"{seen}; on another rank: {_shown(cross)}: reproduced only on rank {rank}"
            found.append(SdcVerdict(rank, PERSISTENT, only))
    return found


def whole_step(norm: float, again: float, everywhere: bool) -> SdcVerdict:
    """The verdict on a step that alarmed with no rank standing out: its gradient norm after the reduction
    (`norm`, this rank's; `again`, in the re-run) reproduced on every rank (`everywhere`) or not."""
    seen = f"no rank stood out; gradient norm {norm:.6g}, in the re-run {again:.6g}"
    if everywhere:
        return SdcVerdict(None, DATA, f"{seen}: reproduced on every rank")
    return SdcVerdict(None, TRANSIENT, f"{seen}: not reproduced on every rank")


def reproduced(a: Fingerprint, b: Fingerprint, rtol: float = REPRODUCED_RTOL) -> bool:
    """The same result within `rtol` (non-finite in both or in neither: counts of buckets and of tensors differ)."""
    return (a.nonfinite > 0) == (b.nonfinite > 0) and all(
        x == y or math.isclose(x, y, rel_tol=rtol, abs_tol=1e-12)
        for x, y in ((a.loss, b.loss), (a.grad_norm, b.grad_norm))
    )


def partners(suspects: Sequence[int], world: int) -> dict[int, int]:
    """For each suspect, the rank that re-runs its batch: the next rank after it that is no suspect and no partner
    yet, else the next that is no partner yet (so that no rank runs more than one other rank's batch); none when
    alone."""
    chosen: dict[int, int] = {}
    for suspect in suspects:
        after = [(suspect + k) % world for k in range(1, world)]
        free = [r for r in after if r not in chosen.values()]
        pick = next((r for r in free if r not in suspects), next(iter(free), None))
        if pick is not None:
            chosen[suspect] = pick
    return chosen


def _shown(p: Fingerprint) -> str:
    nonfinite = f", {p.nonfinite} non-finite" if p.nonfinite else ""
    return f"loss {p.loss:.6g}, gradient norm {p.grad_norm:.6g}{nonfinite}"


def _score(value: float, others: list[float], floor: Callable[[float], float]) -> float:
    """How many robust sigmas `value` lies above the median of `others` (negative: below)."""
    median = statistics.median(others)
    spread = MAD_TO_SIGMA * statistics.median(abs(x - median) for x in others)
    spread = max(spread, floor(median), 1e-12)
    return (value - median) / spread


def _log(norm: float) -> float:
    return math.log(max(norm, 1e-30))  # a zero gradient: far below, but finite, so medians and scores stay numbers
