"""The step guard: whether an optimizer step is applied or skipped, decided identically on every rank.

A rank-local decision desynchronises data parallelism (one replica steps, another does not), so each
rank's local verdict is combined with one tiny all-reduce (MAX) before anyone acts on it. When
feature-value faults abort (seed 002, levels 2 and 3), the same all-reduce carries one flag per rank,
so every rank learns which ranks saw a fault. It also carries the id of the stop order each rank holds
(as -id and id, so MAX yields the lowest and the highest), so every rank knows, at the same step,
whether all of them hold the same order. Two more flags ride along: a time-based checkpoint is due (any rank's
clock says so, every rank saves) and a GradScaler overflow (the scaler skips the step; not an anomaly); and with
`snapshot_steps: auto`, each rank's snapshot interval, so that all of them take the lowest (worker.cadence).
With fingerprints (a DDP model under a Warden: worker.fingerprint), three more values per rank: its own loss,
gradient norm and non-finite count from before the gradient reduction, so every rank names the same ranks whose
values stand out (worker.sdc).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from worker.anomaly import AnomalyDetector
from worker.anomaly import Verdict as LocalVerdict
from worker.contract import EXIT_ANOMALY, EXIT_BAD_DEVICE, WorkerConfig
from worker.exits import leave
from worker.faults import FaultPlan
from worker.sdc import (
    PERSISTENT,
    TRANSIENT,
    Fingerprint,
    Outlier,
    SdcVerdict,
    fingerprint_rows,
    fingerprint_values,
    from_rows,
    outliers,
    whole_step,
)

# Re-runs a suspect step given every rank's fingerprint and the suspects (worker.rerun, bound by the Warden).
# Its arguments: every rank's fingerprint, the suspects, this rank's gradient norm, and what to do again to the
# re-run's gradients (a fault standing for bad data strikes again).
RerunStep = Callable[[tuple[Fingerprint, ...], tuple[int, ...], float, Callable[[], None]], Any]

__all__ = ["StepGuard", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on for one step."""

    apply: bool
    grad_norm: float
    suspects: tuple[int, ...] = ()  # ranks that saw a feature-value fault: the caller aborts
    orders: tuple[int, int] = (0, 0)  # the lowest and highest stop-order id any rank holds (0: none)
    save_due: bool = False  # some rank's clock says a time-based checkpoint is due
    snapshot_every: int = 0  # the lowest snapshot interval any rank proposed (0: some rank has none yet)
    stood_out: tuple[Outlier, ...] = ()  # ranks whose own values stood out from the others' (fingerprints)
    sdc: tuple[SdcVerdict, ...] = ()  # what re-running the step found


@dataclass(frozen=True)
class _Agreed:
    """The job-wide view of one step's local flags."""

    anomaly: bool
    overflow: bool
    save_due: bool
    snapshot_every: int
    suspects: tuple[int, ...]
    orders: tuple[int, int]
    stood_out: tuple[Outlier, ...] = ()
    prints: tuple[Fingerprint, ...] = ()  # every rank's, in rank order ((): not fingerprinted this step)
    listed: bool = False  # some rank's skip list holds this batch (worker.skip_list)


class StepGuard:
    """Checks each step's gradients and loss; skips anomalous steps and aborts a streak of them."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        log: Any,
        faults: FaultPlan,
        world_size: int,
        rank: int = 0,
        on_leave: Callable[[], None] = lambda: None,
        where: tuple[str, int | None] = ("", None),
    ) -> None:
        monitor = config.monitor_config
        skip_on_norm = config.use_skip_data_by_global_norm and monitor.monitor_on
        self.threshold = monitor.global_norm_spike_threshold if skip_on_norm else None
        self.count_threshold = monitor.global_norm_spike_count_threshold
        self.detector = AnomalyDetector(self.threshold, config.adaptive_spike)
        self.skipped = 0  # batches skipped, anomalies and AMP overflows alike
        self.anomalies: dict[str, int] = {}  # what this rank saw itself, by kind: the heartbeat reports it
        self.fingerprint_s = 0.0  # spent on fingerprints here (their rows, and reading them back), measured
        self._log, self._faults, self._world_size, self._rank = log, faults, world_size, rank
        self._on_leave = on_leave  # an abort's teardown takes a while: the heartbeat says this rank is leaving
        self._node, self._gpu = where  # this rank's host and GPU index (None: not on a GPU), for its verdicts

    def check(
        self,
        params: Iterable[Any],
        loss: float,
        *,
        step: int,
        batch: int,
        max_norm: float,
        feature_fault: bool | None = None,
        order_id: int = 0,
        save_due: bool = False,
        amp_scaling: bool = False,
        snapshot_every: int | None = None,
        fingerprint: Any = None,
        rerun: RerunStep | None = None,
        listed: bool = False,
    ) -> Verdict:
        """Clip the gradients and decide, together with every rank.

        `feature_fault` is this rank's (None: faults do not abort, nothing to agree on); `order_id` the stop
        order it holds; `save_due` whether its clock says a checkpoint is due; `amp_scaling` whether an enabled
        GradScaler scaled the loss (then inf/NaN gradients with a finite loss are its overflow, not an anomaly);
        `snapshot_every` the snapshot interval it proposes (`auto` only, else None; 0: none yet); `fingerprint`
        this rank's gradient buckets' squared norms from before the reduction (worker.fingerprint; None: not
        fingerprinted);
        `rerun` re-runs a step that alarmed (worker.rerun), whose verdicts then decide: any data or persistent one
        skips the step, transient ones apply the re-run's gradients if they are clean; `listed`: this batch is in
        this rank's skip list (a re-run judged it the data's before a resume): skipped on every rank, not re-run.
        With suspect ranks the caller aborts, so nothing is recorded. Exits with EXIT_ANOMALY on a streak of skips.
        """
        import torch

        grads = [p for p in params if p.grad is not None]
        injected = self._faults.gradient_fault(step)
        _strike(injected, grads)
        grad_norm = _whole(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        overflow = amp_scaling and not math.isfinite(grad_norm) and math.isfinite(loss)
        verdict = LocalVerdict() if overflow else self.detector.judge(loss, grad_norm)
        agreed = self._agree(
            verdict.anomalous,
            overflow,
            save_due,
            grads,
            feature_fault,
            order_id,
            step,
            snapshot_every,
            None if fingerprint is None else (loss, fingerprint),
            listed,
        )
        if agreed.stood_out:
            self._log.warning(
                "ranks_stood_out",
                step=step,
                batch=batch,
                ranks=[o.rank for o in agreed.stood_out],
                why=[o.why for o in agreed.stood_out],
                anomaly=agreed.anomaly,
            )
        if agreed.suspects:
            return Verdict(False, grad_norm, agreed.suspects, agreed.orders)
        for kind in ("amp_overflow",) if overflow else verdict.reasons:
            self.saw(kind)
        skip = agreed.anomaly or agreed.listed
        if agreed.overflow and not skip:  # the scaler lowers its scale and skips the step itself
            self.skipped += 1
            self._log.info("amp_overflow", step=step, batch=batch, global_norm=_json_number(grad_norm))
            return Verdict(
                False, grad_norm, (), agreed.orders, agreed.save_due, agreed.snapshot_every, agreed.stood_out
            )
        verdicts: tuple[SdcVerdict, ...] = ()
        if rerun is not None and agreed.prints and (skip or agreed.stood_out) and not agreed.listed:
            again = functools.partial(_strike, injected, grads)
            skip, grad_norm, verdicts = self._rerun(rerun, agreed, grads, (max_norm, grad_norm), step, batch, again)
        self.skipped += skip
        self.detector.record(step, skipped=skip, loss=loss, grad_norm=grad_norm)
        if skip:
            self._log.warning(
                "step_skipped",
                opt_global_step=step - 1,
                step=step,
                batch=batch,
                global_norm=_json_number(grad_norm),
                loss=_json_number(loss),
                skip_data_grad_norm_threshold=self.threshold,
                is_skip=True,
                consecutive=self.detector.consecutive,
                reasons=list(verdict.reasons)
                + [f"sdc_{v.verdict}" for v in verdicts if v.verdict != TRANSIENT]
                + (["skip_list"] if agreed.listed else []),
                local=verdict.anomalous,
            )
            if any(v.verdict == PERSISTENT for v in verdicts):
                self._on_leave()  # the supervisor relaunches without the suspect's node or GPU
                leave(EXIT_BAD_DEVICE)
            if self.detector.consecutive >= self.count_threshold:
                self._abort(step, batch, grad_norm)
        return Verdict(
            not skip, grad_norm, (), agreed.orders, agreed.save_due, agreed.snapshot_every, agreed.stood_out, verdicts
        )

    def _rerun(
        self,
        rerun: RerunStep,
        agreed: _Agreed,
        grads: list[Any],
        norms: tuple[float, float],
        step: int,
        batch: int,
        again: Callable[[], None],
    ) -> tuple[bool, float, tuple[SdcVerdict, ...]]:
        """Re-run the alarmed step (suspects: the ranks that stood out); (skip it?, its gradient norm, the
        verdicts), alike on every rank. `norms`: the clipping norm and the step's gradient norm."""
        import torch

        max_norm, norm = norms
        found = rerun(agreed.prints, tuple(o.rank for o in agreed.stood_out), norm, again)
        verdicts = found.verdicts or (whole_step(norm, found.norm, found.reproduced),)
        for v in verdicts:
            log = self._log.error if v.verdict != TRANSIENT else self._log.warning
            mine = v.rank == self._rank or (v.rank is None and self._rank == 0)  # counted once: `status` sums ranks
            if mine:
                self.saw(f"sdc_{v.verdict}")
            # The suspect's own event says where it runs: the supervisor charges that node (GPU) from it, the one its
            # heartbeat's count (`count`, this process's so far) says is new.
            where = {"node": self._node, "gpu": self._gpu} if v.rank == self._rank else {}
            counted = {"count": self.anomalies[f"sdc_{v.verdict}"]} if mine else {}
            log(
                "sdc_verdict",
                step=step,
                batch=batch,
                suspect=v.rank,
                verdict=v.verdict,
                evidence=v.evidence,
                **where,
                **counted,
            )
        if any(v.verdict != TRANSIENT for v in verdicts):
            return True, norm, verdicts
        # Only one-off faults: the re-run's gradients, averaged by DDP, are in `.grad`: applied if they are clean.
        norm = _whole(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        clean = math.isfinite(norm) and all(p.nonfinite == 0 for p in found.reruns) and not outliers(found.reruns)
        return not clean, norm, verdicts

    def saw(self, kind: str) -> None:
        """Count an anomaly this rank saw itself."""
        self.anomalies[kind] = self.anomalies.get(kind, 0) + 1

    def _agree(
        self,
        anomaly: bool,
        overflow: bool,
        save_due: bool,
        grads: list[Any],
        feature_fault: bool | None,
        order_id: int,
        step: int,
        snapshot_every: int | None = None,
        fingerprint: tuple[float, list[float] | None] | None = None,
        listed: bool = False,
    ) -> _Agreed:
        """Every local flag made job-wide (any rank's counts; feature faults per rank; the lowest and highest
        stop-order id held; each rank's fingerprint, given its loss and squared norms): one all-reduce, none when
        alone."""
        import torch
        import torch.distributed as dist

        if self._world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            alone: tuple[int, ...] = (self._rank,) if feature_fault else ()
            orders = (order_id, order_id)
            return _Agreed(anomaly, overflow, save_due, snapshot_every or 0, alone, orders, listed=listed)
        values = [float(anomaly), float(overflow), float(save_due), float(-order_id), float(order_id), float(listed)]
        if snapshot_every is not None:  # only with `auto` (same on every rank): -interval, so MAX is the lowest
            values.append(float(-snapshot_every))
        flagged = len(values)
        if feature_fault is not None:  # one slot per rank, so the MAX keeps every rank that saw a fault
            values += [1.0 if feature_fault and rank == dist.get_rank() else 0.0 for rank in range(self._world_size)]
        device = grads[0].device if grads else torch.device("cpu")
        flags = torch.tensor(values, dtype=torch.float64, device=device)
        started = time.perf_counter()
        if fingerprint is not None:  # no squares: no bucket was reduced this step, nothing to compare
            loss, squares = fingerprint
            mine = {} if squares is None else {dist.get_rank(): fingerprint_values(loss, squares)}
            rows = torch.tensor(fingerprint_rows(self._world_size, mine), dtype=torch.float64, device=device)
            flags = torch.cat([flags, rows])
        self.fingerprint_s += time.perf_counter() - started
        self._faults.all_reduce(flags, dist.ReduceOp.MAX, step)
        seen = flags.tolist()  # the one host transfer
        ranks = len(values) - flagged
        suspects = tuple(rank for rank, flag in enumerate(seen[flagged : flagged + ranks]) if flag > 0)
        every = int(-seen[6]) if snapshot_every is not None else 0
        started = time.perf_counter()
        found = from_rows(seen[len(values) :]) if fingerprint is not None else []
        prints = () if None in found else tuple(p for p in found if p is not None)  # some rank had none: no comparing
        orders = (int(-seen[3]), int(seen[4]))
        stood_out = tuple(outliers(prints))
        self.fingerprint_s += time.perf_counter() - started
        return _Agreed(seen[0] > 0, seen[1] > 0, seen[2] > 0, every, suspects, orders, stood_out, prints, seen[5] > 0)

    def _abort(self, step: int, batch: int, grad_norm: float) -> None:
        # Seed 000: "Current global norm [..] of step N has been K consecutive times greater than threshold".
        self._log.error(
            "anomaly_abort",
            step=step,
            batch=batch,
            global_norm=_json_number(grad_norm),
            threshold=self.threshold,
            consecutive=self.detector.consecutive,
            count_threshold=self.count_threshold,
            first_anomaly_step=self.detector.first_anomaly_step,
            first_anomaly_batch=batch - self.detector.consecutive + 1,
        )
        self._on_leave()
        leave(EXIT_ANOMALY)


def _strike(kind: str | None, grads: list[Any]) -> None:
    """A `spike` or `nan` fault on the parameters' gradients (worker.faults); again in a re-run: it stands for
    bad data, which a re-run reproduces."""
    if kind == "spike":
        for g in grads:
            g.grad.mul_(1000.0)
    elif kind == "nan" and grads:
        grads[0].grad.view(-1)[0] = float("nan")


def _json_number(value: float) -> float | str:
    """JSON has no NaN or Infinity; keep them readable as strings."""
    return value if math.isfinite(value) else str(value)


def _whole(norm: Any) -> float:
    """The global norm as a float; FSDP2's (a DTensor of partial sums over the shards) reduced first."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
