"""Feature-value check points on the backward pass: the activation-gradient norm of normalisation layers (seed 002).

A forward hook on each checked module puts a tensor hook on its output; in the backward pass that
hook computes the gradient's L2 norm and keeps it on the device. Once per step `verdict()` reads all
the norms with one host transfer, judges them with `worker.feature_rule` and logs the findings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from worker.contract import EXIT_ANOMALY
from worker.exits import leave
from worker.faults import FaultPlan
from worker.feature_rule import FeatureValueConfig, Finding, History, judge

__all__ = ["FeatureValueCheck", "checked_layers"]

DEFAULT_SDC_FACTOR = 1e12  # lifts any activation gradient norm above 1e-6 past the L1 threshold
NORM_SUFFIXES = ("LayerNorm", "RMSNorm")  # nn.LayerNorm, nn.RMSNorm, LlamaRMSNorm, FusedLayerNorm, ...


def checked_layers(model: Any, extra: list[str]) -> list[tuple[str, Any]]:
    """(qualified name, module) of every normalisation layer and every module named in `extra`."""
    named = set(extra)
    found = []
    for name, module in _unwrapped(model).named_modules():
        kind = type(module).__name__
        if kind.endswith(NORM_SUFFIXES) or name in named or kind in named:
            found.append((name, module))
    return found


def _unwrapped(model: Any) -> Any:
    """The model inside DistributedDataParallel / DataParallel, so layer names carry no `module.` prefix."""
    import torch

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


class FeatureValueCheck:
    """Check points on one rank's model, their histories, and the per-step verdict."""

    def __init__(
        self,
        model: Any,
        config: FeatureValueConfig,
        *,
        log: Any,
        faults: FaultPlan,
        rank: int,
        attempted_step: Callable[[], int],
        on_leave: Callable[[], None] = lambda: None,
    ) -> None:
        self.config, self._log, self._faults, self._rank = config, log, faults, rank
        self._on_leave = on_leave  # an abort's teardown takes a while: the heartbeat says this rank is leaving
        self._attempted_step = attempted_step  # the step the current backward pass belongs to
        layers = checked_layers(model, config.layers) if config.level > 0 else []
        self.names = [name for name, _ in layers]
        self._histories = [History() for _ in layers]
        self._paused = False  # a step's re-run: its values are not taken
        self._pending: list[Any] = [None] * len(layers)  # this step's norms, still on the device
        self._arrivals: list[int] = []  # layers in the order backward reached them: corruption spreads that way
        self._sdc = self._arm_sdc(faults)
        self._handles = [
            module.register_forward_hook(partial(self._on_forward, i)) for i, (_, module) in enumerate(layers)
        ]
        self.first_fault: tuple[str, Finding] | None = None  # this step's first L1 fault, for the abort event
        if config.level > 0:
            log.info("feature_value_check_started", layers=self.names, **config.thresholds())

    @property
    def aborts(self) -> bool:
        """Whether a fault stops training (levels 2 and 3) and so needs agreeing across ranks."""
        return self.config.aborts and bool(self.names)

    def _arm_sdc(self, faults: FaultPlan) -> dict[int, int]:
        """Layer index of each armed `sdc` fault's step; unknown layers are logged, not armed."""
        armed = {}
        for fault in faults.armed("sdc"):
            target = fault.target or (self.names[0] if self.names else None)
            if target not in self.names:
                self._log.warning(
                    "fault_not_armed",
                    kind="sdc",
                    step=fault.step,
                    layer=target,
                    reason="not a checked layer (or feature_value_check.level is 0)",
                    checked_layers=self.names,
                )
                continue
            armed[fault.step] = self.names.index(target)
        return armed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No values taken meanwhile: a re-run of the step (worker.rerun) is not the next step's."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _on_forward(self, index: int, _module: Any, _inputs: Any, output: Any) -> None:
        if getattr(output, "requires_grad", False) and not self._paused:  # a training forward, not a re-run
            output.register_hook(partial(self._on_grad, index))

    def _on_grad(self, index: int, grad: Any) -> Any:
        import torch

        if self._sdc and self._sdc.get(self._attempted_step()) == index:
            grad = self._inject(grad)
        norm = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)
        previous = self._pending[index]  # a layer run twice in a step (accumulation): keep the worst
        if previous is None:
            self._arrivals.append(index)
        self._pending[index] = norm if previous is None else torch.maximum(previous, norm)
        return grad

    def _inject(self, grad: Any) -> Any:
        fault = self._faults.strike_once("sdc", self._attempted_step())
        if fault is None:
            return grad
        return grad * (fault.arg if fault.arg is not None else DEFAULT_SDC_FACTOR)

    def verdict(self, *, step: int, batch: int, loss_scale: float | None = None) -> bool:
        """Judge this step's values (in backward order) and log the findings; True if an L1 fault was seen here.

        With AMP loss scaling (`loss_scale`: a GradScaler's scale), the values are unscaled first, and a
        non-finite one is the scaler's overflow, which it skips: neither judged nor kept in the history.
        """
        self.first_fault = None
        present, self._arrivals = self._arrivals, []
        if not present:
            return False
        import torch

        values = torch.stack([self._pending[i] for i in present]).tolist()  # the one host sync of the check
        self._pending = [None] * len(self._pending)
        if loss_scale is not None:
            values = [val / loss_scale for val in values]
            if not all(map(math.isfinite, values)):
                return False
        for index, val in zip(present, values, strict=True):
            finding = judge(val, self._histories[index], self.config)
            self._histories[index].record(val)
            self._report(self.names[index], finding, step=step, batch=batch)
        return self.first_fault is not None

    def _report(self, layer: str, finding: Finding, *, step: int, batch: int) -> None:
        if finding.verdict == "normal" and self.config.level < 3:
            return
        fields = _finding_fields(layer, finding) | self.config.thresholds()
        if finding.verdict == "fault":
            self.first_fault = self.first_fault or (layer, finding)
            self._log.error("feature_value_fault", step=step, batch=batch, **fields)
        elif finding.verdict == "warning":
            self._log.warning("feature_value_warning", step=step, batch=batch, **fields)
        else:
            self._log.info("feature_value_normal", step=step, batch=batch, **fields)

    def abort(self, *, step: int, batch: int, suspect_ranks: list[int]) -> None:
        """Log the abort the supervisor reads (seed 000's `anomaly_abort` fields) and exit with EXIT_ANOMALY."""
        local = self.first_fault
        details = _finding_fields(*local) if local is not None else {"layer": None}
        self._log.error(
            "anomaly_abort",
            cause="feature_value",
            step=step,
            batch=batch,
            consecutive=1,
            first_anomaly_step=step,
            first_anomaly_batch=batch,
            suspect_ranks=suspect_ranks,
            local=local is not None,
            **details,
            **self.config.thresholds(),
        )
        self._on_leave()
        leave(EXIT_ANOMALY)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each check point's history by layer name, for a checkpoint: `min_steps` counts across a resume."""
        return {name: dataclasses.asdict(history) for name, history in zip(self.names, self._histories, strict=True)}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Put back the histories of the layers this model still has (by name); others start afresh."""
        for index, name in enumerate(self.names):
            if name in state:
                self._histories[index] = History(**state[name])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _finding_fields(layer: str, finding: Finding) -> dict[str, Any]:
    """The seed's log line as fields: val, pre_val, min_val, max_val, the values judged so far, and why."""
    history = finding.history
    return {
        "layer": layer,
        "val": _number(finding.val),
        "pre_val": _number(history.pre_val),
        "min_val": history.min_val,
        "max_val": history.max_val,
        "checks": history.checks,
        "jump": _number(finding.jump),
        "reasons": list(finding.reasons),
    }


def _number(value: float | None) -> float | str | None:
    """JSON has no NaN or Infinity; keep them readable as strings."""
    return value if value is None or math.isfinite(value) else str(value)
