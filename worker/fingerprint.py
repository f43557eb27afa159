"""Each rank's fingerprint of its own gradients, taken inside DDP's communication hook, before the reduction.

The Warden of a DistributedDataParallel model installs `fingerprinted(allreduce_hook)` as its communication hook
(DDP's own reduction, in Python); a script with a hook of its own wraps it: `ddp.register_comm_hook(state,
worker.fingerprinted(my_hook))` (`worker.exact.average_gradients_in_rank_order` does). For each bucket DDP hands over,
the hook adds the bucket's squared norm and non-finite count to a running sum on the bucket's device (no host
sync); the step guard takes the sum, sends it along in the all-reduce it makes anyway (worker.guard), and names the
ranks whose values stand out (worker.sdc). `bitflip` faults strike here too: they corrupt a rank's own gradient
before the reduction, as a faulty GPU's backward would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.faults import FaultPlan, flip_bit

__all__ = ["Recorder", "fingerprinted", "install"]

_MARK = "__trainwarden_fingerprints__"
_active: Recorder | None = None  # the live Warden's: DDP's hook was registered before the Warden existed


class Recorder:
    """The running fingerprint of one rank's current step: squared norm and non-finite count of its buckets."""

    def __init__(self, model: Any, faults: FaultPlan, step: Callable[[], int]) -> None:
        self._faults, self._step = faults, step
        self._names = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
        self._sums: Any = None  # a tensor [squared norm, non-finite count] on the gradients' device

    def record(self, bucket: Any) -> None:
        """Called by the hook with each bucket, before its reduction."""
        import torch

        self._strike(bucket)
        buffer = bucket.buffer()
        sums = torch.stack(
            [
                torch.linalg.vector_norm(buffer, dtype=torch.float64).square(),
                torch.count_nonzero(buffer * 0).to(torch.float64),  # inf * 0 and NaN * 0 are NaN: 3x isfinite's speed
            ]
        )
        self._sums = sums if self._sums is None else self._sums.add_(sums)

    def take(self) -> Any:
        """The step's sums so far ([squared norm, non-finite count]; None if no bucket came); starts anew."""
        sums, self._sums = self._sums, None
        return sums

    def _strike(self, bucket: Any) -> None:
        fault = self._faults.bitflip(self._step())
        if fault is None:
            return
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if fault.target is None or self._names.get(id(param)) == fault.target:
                flip_bit(grad, fault)
                self._faults.flipped(fault, self._step())
                return


def fingerprinted(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`hook` (a DDP communication hook), fingerprinting each bucket before it reduces it."""

    def with_fingerprint(state, bucket):  # noqa: ANN001, ANN202 - DDP checks annotations: none, or its own types
        if _active is not None:
            _active.record(bucket)
        return hook(state, bucket)

    setattr(with_fingerprint, _MARK, True)
    with_fingerprint.__qualname__ = f"fingerprinted({getattr(hook, '__qualname__', 'hook')})"
    return with_fingerprint


def install(model: Any, recorder: Recorder, world_size: int) -> str | None:
    """Fingerprint `model`'s buckets from now on; None when it does, else why not (not DDP; a hook of its own)."""
    global _active
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None or not callable(getattr(model, "register_comm_hook", None)):
        return "not a DistributedDataParallel model"
    group = getattr(model, "process_group", None)
    if group is not None and group.size() != world_size:  # the guard's all-reduce compares every rank of the world
        return f"DDP reduces over {group.size()} of the {world_size} ranks: only data parallelism over all is compared"
    if not hooks:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(group, fingerprinted(allreduce_hook))  # DDP's own reduction, over DDP's group
    elif not all(getattr(hook, _MARK, False) for hook, _ in hooks):
        return "its communication hook is its own: wrap it in worker.fingerprinted() to fingerprint it"
    _active = recorder
    return None


def uninstall(recorder: Recorder) -> None:
    """The Warden that owned `recorder` closes: its hook records nothing more."""
    global _active
    if _active is recorder:
        _active = None
