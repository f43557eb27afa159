"""The snapshot cadence of `worker.snapshot_steps: auto`: how many steps between snapshots, and why. Torch-free, pure.

Two rules; the shorter interval wins, clamped to [1 step, the disk interval] (a snapshot rarer than the disk saves
would add nothing):

- **Young/Daly.** With failures every M seconds on average and a snapshot that stalls the loop for δ seconds, the
  expected waste (stalls plus the work lost per failure) is least with δ-free training of
  T = √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] − δ seconds between snapshots (Daly 2006, ≈ Young's √(2δM) for δ ≪ M),
  T / step_s steps.
- **An overhead budget.** When one snapshot costs at most CHEAP_SHARE of a step (a copy into host memory), snapshot
  as often as an overhead of OVERHEAD_BUDGET allows, ⌈δ / (budget × step_s)⌉ steps, even where Young/Daly's interval
  is longer. Why: early in a run M is a guess (the prior), and Young/Daly's optimum is flat, so a small overhead
  costs next to nothing in expectation while it turns "lose half a snapshot interval" into "lose a step or two"
  whatever M really is; 2 % is within the step-to-step noise of a training loop. A snapshot dearer than that (a copy
  to disk, a huge model) is left to Young/Daly, whose interval then keeps its cost and the lost work in balance.
  With the demo's ~40 ms steps and a ~1 ms copy into /dev/shm: every 2 steps; with the 6 ms that torch.save of
  its 1.4 MB of model and optimizer state takes on a loaded CPU: every 8. Cheap means at most a quarter of a step:
  a copy to host memory (a GPU's device-to-host copy included) is, a write to disk of a large model is not.

M, the mean time between failures: (PRIOR_MTBF_S + wall time) / (failures + 1), the run's own history (failures
over the wall time it ran, as the supervisor counts them: TRAINWARDEN_FAILURES) with the prior counted as one failure
in an hour. The prior, one hour: Meta's clusters saw a failure every 7.9 h at 1,024 GPUs and 1.8 h at 16,384 (Kokolis
et al., HPCA'25), Llama 3 one every 3.1 h at 16,384 H100s; a supervised run meets software faults (OOM, NaN storms,
bad data, preemption) that these hardware counts miss, and an hour is shorter than all of them, so before the run
has evidence its interval errs short, which costs little (above). A run's own failures outweigh the prior within a
few failures, and a run that goes hours without one lengthens M.

Re-evaluation (`SnapshotCadence`): each snapshot's measured stall and the step times between them feed medians
of the last few (a snapshot that met a GC pause or a cold cache moves nothing); the first choice waits for
MEASURED_FIRST snapshots (taken every second step meanwhile, `SnapshotSchedule`), then it is re-evaluated at each
snapshot; a shorter interval is taken at once (it can only lose less work), a longer one only when CONFIRM
evaluations in a row ask for it, and nothing within DEAD_BAND of the current one, so that it does not flap. A
relaunched process starts from the interval agreed when its resume state was saved (`SnapshotSchedule.resumed`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = [
    "CHEAP_SHARE",
    "CONFIRM",
    "DEAD_BAND",
    "MEASURED_FIRST",
    "OVERHEAD_BUDGET",
    "PRIOR_MTBF_S",
    "Choice",
    "Inputs",
    "SnapshotCadence",
    "SnapshotSchedule",
    "choose_interval",
    "mtbf_estimate",
    "young_daly_s",
]

PRIOR_MTBF_S = 3600.0  # the mean time between failures assumed before the run has any evidence (see above)
OVERHEAD_BUDGET = 0.02  # a cheap snapshot may cost the loop this share of its time
CHEAP_SHARE = 0.25  # a snapshot stalling at most this share of a step is cheap (the budget rule applies)
MEASURED_FIRST = 3  # snapshots measured before the first choice (the first one pays cold caches and allocations)
CONFIRM = 3  # evaluations in a row that must ask for a change before it is made
DEAD_BAND = 0.1  # a proposal within this share of the current interval is no change
STALL_WINDOW = 5  # snapshots whose median stall is the cost
STEP_WINDOW = 32  # steps whose median time is the step time


@dataclass(frozen=True)
class Inputs:
    """What the choice is made from: measured costs, the run's failure history, the disk cadence."""

    stall_s: float  # what one snapshot costs the loop
    step_s: float  # one training step, without snapshots
    failures: int = 0  # failures of the run so far
    wall_s: float = 0.0  # the run's wall time they happened over
    disk_every_steps: int = 0  # worker.save_checkpoint_steps (0: none, or by time)
    disk_every_s: float = 0.0  # worker.save_checkpoint_interval_s, when saves go by time
    prior_mtbf_s: float = PRIOR_MTBF_S


@dataclass(frozen=True)
class Choice:
    """An interval in steps, the rule that set it (`young_daly`, `overhead_budget`, `disk_interval`), why in one line,
    and the figures it came from."""

    interval_steps: int
    rule: str
    reason: str
    stall_s: float
    step_s: float
    mtbf_s: float
    young_daly_steps: int


def mtbf_estimate(failures: int, wall_s: float, prior_s: float = PRIOR_MTBF_S) -> float:
    """The mean time between failures: the run's failures over its wall time, with the prior as one more failure."""
    return (prior_s + max(0.0, wall_s)) / (max(0, failures) + 1)


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum of training time between checkpoints costing `cost_s` under failures every `mtbf_s`."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:  # failures outpace checkpoints: Daly's answer is M itself
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def choose_interval(given: Inputs) -> Choice:
    """The interval for `given` (see the module's docstring), with the rule that set it and why."""
    step_s = max(given.step_s, 1e-9)
    stall_s = max(given.stall_s, 0.0)
    mtbf_s = mtbf_estimate(given.failures, given.wall_s, given.prior_mtbf_s)
    optimum_s = young_daly_s(stall_s, mtbf_s)
    young_daly = max(1, math.floor(optimum_s / step_s + 0.5))
    failures = (
        f"failures every {mtbf_s:.0f} s (prior, none seen)"
        if given.failures <= 0
        else f"failures every {mtbf_s:.0f} s ({given.failures} in {given.wall_s:.0f} s, with the prior)"
    )
    steps, rule = young_daly, "young_daly"
    reason = (
        f"Young/Daly: a snapshot stalls {stall_s:.4f} s, {failures}: every {optimum_s:.1f} s of training, "
        f"{young_daly} steps of {step_s:.4f} s"
    )
    share = stall_s / step_s
    if share <= CHEAP_SHARE:
        budget = max(1, math.ceil(share / OVERHEAD_BUDGET - 1e-9))
        if budget < young_daly:
            steps, rule = budget, "overhead_budget"
            reason = (
                f"a snapshot is cheap ({stall_s:.4f} s, {share:.1%} of a {step_s:.4f} s step): as often as a "
                f"{OVERHEAD_BUDGET:.0%} overhead allows, every {budget} steps (Young/Daly alone, {failures}: "
                f"{young_daly})"
            )
    disk = _disk_steps(given, step_s)
    if disk and steps > disk:
        steps, rule = disk, "disk_interval"
        reason = f"{reason}; clamped to the disk interval, {disk} steps"
    return Choice(steps, rule, reason, stall_s, step_s, mtbf_s, young_daly)


def _disk_steps(given: Inputs, step_s: float) -> int:
    """The disk cadence in steps (at the measured pace when it goes by time); 0: no disk saves."""
    if given.disk_every_steps > 0:
        return given.disk_every_steps
    if given.disk_every_s > 0:
        return max(1, math.floor(given.disk_every_s / step_s))
    return 0


class SnapshotCadence:
    """One rank's interval, re-evaluated as measurements come: `interval_steps` (0 until MEASURED_FIRST snapshots
    were measured); `snapshot_measured` returns the new Choice when the interval changed, else None."""

    def __init__(
        self,
        *,
        failures: int = 0,
        wall_s: float = 0.0,
        disk_every_steps: int = 0,
        disk_every_s: float = 0.0,
        prior_mtbf_s: float = PRIOR_MTBF_S,
    ) -> None:
        self.failures, self.wall_s, self.prior_mtbf_s = failures, wall_s, prior_mtbf_s
        self.disk_every_steps, self.disk_every_s = disk_every_steps, disk_every_s
        self.interval_steps = 0
        self.choice: Choice | None = None
        self._stalls: deque[float] = deque(maxlen=STALL_WINDOW)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._pending: list[Choice] = []  # proposals in a row asking for a change the same way

    def step_measured(self, step_s: float) -> None:
        """One training step took `step_s` (without any save or snapshot)."""
        if step_s > 0 and math.isfinite(step_s):
            self._steps.append(step_s)

    def snapshot_measured(self, stall_s: float, *, elapsed_s: float = 0.0) -> Choice | None:
        """A snapshot stalled the loop `stall_s`, `elapsed_s` after `wall_s` was counted: re-evaluate."""
        if stall_s >= 0 and math.isfinite(stall_s):
            self._stalls.append(stall_s)
        if len(self._stalls) < MEASURED_FIRST or not self._steps:
            return None
        proposal = choose_interval(
            Inputs(
                stall_s=statistics.median(self._stalls),
                step_s=statistics.median(self._steps),
                failures=self.failures,
                wall_s=self.wall_s + max(0.0, elapsed_s),
                disk_every_steps=self.disk_every_steps,
                disk_every_s=self.disk_every_s,
                prior_mtbf_s=self.prior_mtbf_s,
            )
        )
        return self.consider(proposal)

    def consider(self, proposal: Choice) -> Choice | None:
        """Take `proposal` (its new Choice returned) if it is the first, shorter than the current interval (a shorter
        one can only lose less work: taken at once), or the CONFIRMth longer one in a row; None otherwise."""
        current = self.interval_steps
        if current and abs(proposal.interval_steps - current) <= DEAD_BAND * current:
            self._pending.clear()
            return None
        if current and proposal.interval_steps > current:  # shorter is taken at once: it only loses less work
            self._pending.append(proposal)
            if len(self._pending) < CONFIRM:
                return None
        self._pending.clear()
        self.interval_steps, self.choice = proposal.interval_steps, proposal
        return proposal


class SnapshotSchedule:
    """When `auto` snapshots are due, the same on every rank: each rank's cadence proposes its interval, the ranks
    agree on the lowest (`agree`, riding the step guard's all-reduce), and a snapshot is due that many steps after
    the newest snapshot or save. Until every rank has measured MEASURED_FIRST, a snapshot is due at every second
    step from the first step after the first one trained (so there are measurements; the first step pays the
    warm-up)."""

    def __init__(self, cadence: SnapshotCadence, *, counted_at: float = 0.0) -> None:
        self.cadence = cadence
        self.counted_at = counted_at  # when the cadence's wall time was counted (monotonic; its clock, not ours)
        self.agreed = 0  # the interval every rank agreed on; 0: some rank has not measured a snapshot yet
        self.last: int | None = None  # the newest step snapshotted or saved (None: before the first step)

    @property
    def proposed(self) -> int:
        """This rank's interval, for the agreement (0: not measured yet)."""
        return self.cadence.interval_steps

    def resumed(self, interval_steps: int) -> None:
        """The run resumed from a state saved under this agreed interval: start from it (every rank resumed from the
        same state) rather than measure afresh at every relaunch; measurements go on and may change it."""
        if interval_steps > 0:
            self.agreed = self.cadence.interval_steps = int(interval_steps)

    def agree(self, lowest: int) -> None:
        """The lowest interval any rank proposed (0 if some rank has none yet)."""
        self.agreed = max(0, int(lowest))

    def due(self, step: int) -> bool:
        """Whether to snapshot after `step` was applied (every rank asks at the same steps)."""
        if self.last is None:
            self.last = step - 1  # the step resumed from (or 0)
        return step - self.last >= (self.agreed or 2)

    def saved(self, step: int) -> None:
        """A regular checkpoint of `step` was saved: the interval counts from it."""
        self.last = step

    def snapshotted(self, step: int, stall_s: float, *, now: float = 0.0) -> Choice | None:
        """A snapshot of `step` stalled the loop `stall_s` (at `now`, on `counted_at`'s clock): the new Choice when
        this rank's interval changed."""
        self.last = step
        return self.cadence.snapshot_measured(stall_s, elapsed_s=now - self.counted_at)
