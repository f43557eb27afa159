"""The step guard: whether an optimizer step is applied or skipped, decided identically on every rank.

A rank-local decision desynchronises data parallelism (one replica steps, another does not), so each
rank's local verdict is combined with one tiny all-reduce (MAX) before anyone acts on it. When
feature-value faults abort (seed 002, levels 2 and 3), the same all-reduce carries one flag per rank,
so every rank learns which ranks saw a fault. It also carries the id of the stop order each rank holds
(as -id and id, so MAX yields the lowest and the highest), so every rank knows, at the same step,
whether all of them hold the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from worker.anomaly import AnomalyDetector
from worker.contract import EXIT_ANOMALY, WorkerConfig
from worker.exits import leave
from worker.faults import FaultPlan

__all__ = ["StepGuard", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on for one step."""

    apply: bool
    grad_norm: float
    suspects: tuple[int, ...] = ()  # ranks that saw a feature-value fault: the caller aborts
    orders: tuple[int, int] = (0, 0)  # the lowest and highest stop-order id any rank holds (0: none)


class StepGuard:
    """Checks each step's gradients and loss; skips anomalous steps and aborts a streak of them."""

    def __init__(self, config: WorkerConfig, *, log: Any, faults: FaultPlan, world_size: int, rank: int = 0) -> None:
        monitor = config.monitor_config
        skip_on_norm = config.use_skip_data_by_global_norm and monitor.monitor_on
        self.threshold = monitor.global_norm_spike_threshold if skip_on_norm else None
        self.count_threshold = monitor.global_norm_spike_count_threshold
        self.detector = AnomalyDetector(self.threshold, config.adaptive_spike)
        self._log, self._faults, self._world_size, self._rank = log, faults, world_size, rank

    def check(
        self, params: Iterable[Any], loss: float, *, step: int, batch: int, max_norm: float,
        feature_fault: bool | None = None, order_id: int = 0,
    ) -> Verdict:
        """Clip the gradients and decide, together with every rank.

        `feature_fault` is this rank's (None: faults do not abort, nothing to agree on); `order_id` the stop
        order it holds. With suspect ranks the caller aborts, so nothing is recorded. Exits with
        EXIT_ANOMALY on a streak of skips.
        """
        import torch

        grads = [p for p in params if p.grad is not None]
        self._inject(grads, step)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        verdict = self.detector.judge(loss, grad_norm)
        skip, suspects, orders = self._agree(verdict.anomalous, grads, feature_fault, order_id)
        if suspects:
            return Verdict(False, grad_norm, suspects, orders)
        self.detector.record(step, skipped=skip, loss=loss, grad_norm=grad_norm)
        if skip:
            self._log.warning("step_skipped", opt_global_step=step - 1, step=step, batch=batch,
                              global_norm=_json_number(grad_norm), loss=_json_number(loss),
                              skip_data_grad_norm_threshold=self.threshold, is_skip=True,
                              consecutive=self.detector.consecutive, reasons=list(verdict.reasons),
                              local=verdict.anomalous)
            if self.detector.consecutive >= self.count_threshold:
                self._abort(step, batch, grad_norm)
        return Verdict(not skip, grad_norm, (), orders)

    def _inject(self, grads: list[Any], step: int) -> None:
        kind = self._faults.gradient_fault(step)
        if kind == "spike":
            for g in grads:
                g.grad.mul_(1000.0)
        elif kind == "nan" and grads:
            grads[0].grad.view(-1)[0] = float("nan")

    def _agree(self, local: bool, grads: list[Any], feature_fault: bool | None,
               order_id: int) -> tuple[bool, tuple[int, ...], tuple[int, int]]:
        """(any rank saw an anomaly, ranks that saw a feature-value fault, (lowest, highest) stop-order id held):
        one all-reduce, none when alone."""
        import torch
        import torch.distributed as dist

        if self._world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return local, (self._rank,) if feature_fault else (), (order_id, order_id)
        values = [1.0 if local else 0.0, float(-order_id), float(order_id)]
        if feature_fault is not None:  # one slot per rank, so the MAX keeps every rank that saw a fault
            values += [1.0 if feature_fault and rank == dist.get_rank() else 0.0 for rank in range(self._world_size)]
        flags = torch.tensor(values, dtype=torch.float64, device=grads[0].device if grads else torch.device("cpu"))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        seen = flags.tolist()  # the one host transfer
        suspects = tuple(rank for rank, flag in enumerate(seen[3:]) if flag > 0)
        return seen[0] > 0, suspects, (int(-seen[1]), int(seen[2]))

    def _abort(self, step: int, batch: int, grad_norm: float) -> None:
        # Seed 000: "Current global norm [..] of step N has been K consecutive times greater than threshold".
        self._log.error("anomaly_abort", step=step, batch=batch, global_norm=_json_number(grad_norm),
                        threshold=self.threshold, consecutive=self.detector.consecutive,
                        count_threshold=self.count_threshold,
                        first_anomaly_step=self.detector.first_anomaly_step,
                        first_anomaly_batch=batch - self.detector.consecutive + 1)
        leave(EXIT_ANOMALY)


def _json_number(value: float) -> float | str:
    """JSON has no NaN or Infinity; keep them readable as strings."""
    return value if math.isfinite(value) else str(value)
