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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["OUTLIER_SCORE", "Fingerprint", "Outlier", "outliers"]

OUTLIER_SCORE = 6.0  # robust z above which a rank is named (the adaptive spike rule's 6 sigma)
MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation
NORM_SPREAD_FLOOR = math.log(2.0)  # data-parallel ranks' gradient norms differ by up to ~2x on their own
LOSS_SPREAD_FLOOR = 0.5  # ... and their losses by up to ~half the median loss


@dataclass(frozen=True)
class Fingerprint:
    """One rank's own values of one step, from before the gradient reduction."""

    loss: float
    grad_norm: float
    nonfinite: int  # gradient elements (and the loss) that were NaN or infinite


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


def _score(value: float, others: list[float], floor: Callable[[float], float]) -> float:
    """How many robust sigmas `value` lies above the median of `others` (negative: below)."""
    median = statistics.median(others)
    spread = MAD_TO_SIGMA * statistics.median(abs(x - median) for x in others)
    spread = max(spread, floor(median), 1e-12)
    return (value - median) / spread


def _log(norm: float) -> float:
    return math.log(max(norm, 1e-30))  # a zero gradient: far below, but finite, so medians and scores stay numbers
