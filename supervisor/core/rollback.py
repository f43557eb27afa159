"""Rollback past bad data after an anomaly abort, pure (PaLM's remedy for loss spikes, automated).

A run that aborts on a streak of anomalies is relaunched from the newest checkpoint at or before
`first anomaly step - rollback_steps`, and every rank jumps past the batches from that checkpoint
through `skip_after_steps` batches after the abort. If the next streak starts within one more
window past the skipped one, it is the same region: both distances grow by `widen_factor`; after
`max_tries` rollbacks of one region the run fails. A widened distance is capped at MAX_WINDOW_STEPS,
so a huge `widen_factor` or many tries can neither overflow nor build gigantic integers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_WINDOW_STEPS", "AbortInfo", "AnomalyPolicy", "Rollback", "plan_rollback"]

MAX_WINDOW_STEPS = 2**53  # more steps than any run takes; where floats stop counting steps exactly


@dataclass(frozen=True)
class AnomalyPolicy:
    """The `anomaly:` section of a job config."""

    rollback_steps: int = 100
    skip_after_steps: int = 200
    max_tries: int = 3
    widen_factor: float = 2.0


@dataclass(frozen=True)
class AbortInfo:
    """What a rank's `anomaly_abort` event says about the streak that ended its run."""

    first_step: int
    abort_step: int
    first_batch: int
    abort_batch: int
    suspect_ranks: tuple[int, ...] = ()  # a feature-value fault: the ranks whose hardware computed it


@dataclass(frozen=True)
class Rollback:
    """A decided rollback: resume no later than `resume_at_most`, skip data up to `skip_to_batch`."""

    abort: AbortInfo
    tries: int  # rollbacks of this region so far, this one included
    resume_at_most: int
    skip_to_batch: int
    skip_after: int


def plan_rollback(policy: AnomalyPolicy, previous: Rollback | None, abort: AbortInfo) -> Rollback | None:
    """The rollback for `abort`, or None when this region has been rolled back `max_tries` times already."""
    same_region = previous is not None and abort.first_batch < previous.skip_to_batch + previous.skip_after
    tries = previous.tries + 1 if same_region and previous is not None else 1
    if tries > policy.max_tries:
        return None
    rollback = _widened(policy.rollback_steps, policy.widen_factor, tries - 1)
    skip_after = _widened(policy.skip_after_steps, policy.widen_factor, tries - 1)
    return Rollback(
        abort=abort,
        tries=tries,
        resume_at_most=max(0, abort.first_step - rollback),
        skip_to_batch=abort.abort_batch + 1 + skip_after,
        skip_after=skip_after,
    )


def _widened(steps: int, factor: float, times: int) -> int:
    """`steps * factor ** times`, rounded and capped at MAX_WINDOW_STEPS."""
    if steps == 0:
        return 0
    try:
        value = steps * float(factor) ** times  # float: an int factor ** 2**53 would never finish
    except OverflowError:  # factor ** times beyond 1e308
        return MAX_WINDOW_STEPS
    return round(min(value, MAX_WINDOW_STEPS))  # min first: round(inf) raises, and steps * 1e308 may be inf
