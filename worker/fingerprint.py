"""Each rank's fingerprint of its own gradients, taken before the reduction: in DDP's communication hook, or in
FSDP2's reduce-scatter.

The Warden of a DistributedDataParallel model installs `fingerprinted(allreduce_hook)` as its communication hook
(DDP's own reduction, in Python); a script with a hook of its own wraps it: `ddp.register_comm_hook(state,
worker.fingerprinted(my_hook))` (`worker.exact.average_gradients_in_rank_order` does). For each bucket DDP hands over,
the hook takes the bucket's squared norm (float64; no host sync on a GPU); the step guard takes them (their sum,
and how many were not finite: a non-finite count by buckets, which costs no second pass over the values), sends
them along in the all-reduce it makes anyway (worker.guard), and names the ranks whose values stand out
(worker.sdc). `bitflip` faults strike here too: they corrupt a rank's own gradient
before the reduction, as a faulty GPU's backward would.

An FSDP2 model (`fully_shard`) has no communication hook; its pre-reduce point is the reduce-scatter it runs for each
parameter group, which `FSDPModule.set_custom_reduce_scatter` lets us supply: each rank's input to it is that group's
whole gradient from its own batch, which the comm fingerprints the same way before it reduce-scatters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from worker.faults import FaultPlan, flip_bit

__all__ = ["NOT_DATA_PARALLEL", "Recorder", "fingerprinted", "install"]

NOT_DATA_PARALLEL = "neither a DistributedDataParallel nor an FSDP2 model"  # nothing to fingerprint, nothing to say

_MARK = "__trainwarden_fingerprints__"
_active: Recorder | None = None  # the live Warden's: DDP's hook was registered before the Warden existed


class Recorder:
    """The running fingerprint of one rank's current step: the squared norm of each of its buckets."""

    def __init__(self, model: Any, faults: FaultPlan, step: Callable[[], int]) -> None:
        self._faults, self._step = faults, step
        self._names = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
        self._squares: list[Any] = []  # each bucket's squared norm this step, a float64 tensor on its device
        self.spent_s = 0.0  # in `record` and `take`: what fingerprints cost this process, measured
        self.steps = 0  # steps fingerprinted (re-runs not counted)

    def record(self, bucket: Any) -> None:
        """Called by the hook with each bucket, before its reduction: one norm, nothing else (ops cost here)."""
        started = time.perf_counter()
        self._strike(bucket)
        self._squares.append(_square_norm(bucket.buffer()))
        self.spent_s += time.perf_counter() - started

    def record_flat(self, gradients: Any) -> None:
        """Called with an FSDP2 parameter group's flat gradient before its reduce-scatter (a fault flips its first
        value: the flat buffer names no layer)."""
        started = time.perf_counter()
        fault = self._faults.bitflip(self._step())
        if fault is not None:
            flip_bit(gradients, fault)
            self._faults.flipped(fault, self._step())
        self._squares.append(_square_norm(gradients))
        self.spent_s += time.perf_counter() - started

    def take(self, *, rerun: bool = False) -> list[float] | None:
        """Each bucket's squared norm this step (None: no bucket came); starts anew. One host transfer (on a GPU, it
        waits for the backward, as the step guard's own does). `rerun`: a re-run's, not a step of its own."""
        import torch

        started = time.perf_counter()
        squares, self._squares = self._squares, []
        taken = torch.stack(squares).tolist() if squares else None
        self.steps += not rerun
        self.spent_s += time.perf_counter() - started
        return taken

    def _strike(self, bucket: Any) -> None:
        fault = self._faults.bitflip(self._step())
        if fault is None:
            return
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if fault.target is None or self._names.get(id(param)) == fault.target:
                flip_bit(grad, fault)
                self._faults.flipped(fault, self._step())
                return


def _square_norm(values: Any) -> Any:
    """The squared norm, as a float64 tensor. On the CPU in float32 first, without a copy (a float64 copy of the
    demo's bucket cost 0.4 ms a step in page faults), and again in float64 only if that overflowed; on a GPU in
    float64 at once (its allocator caches the copy, and looking at the float32 result would wait for the device)."""
    import torch

    if values.is_cuda or values.dtype != torch.float32:
        return torch.linalg.vector_norm(values, dtype=torch.float64).square()
    quick = torch.linalg.vector_norm(values)
    if math.isfinite(quick.item()):
        return quick.to(torch.float64).square()
    return torch.linalg.vector_norm(values, dtype=torch.float64).square()  # beyond float32, or NaN: be exact


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
    """Fingerprint `model`'s buckets from now on; None when it does, else why not (neither DDP nor FSDP2; a hook of
    its own)."""
    global _active
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None or not callable(getattr(model, "register_comm_hook", None)):
        why_not = _install_fsdp(model, world_size)
        if why_not is None:
            _active = recorder
        return why_not
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


def _install_fsdp(model: Any, world_size: int) -> str | None:
    """FSDP2: every `fully_shard` module's reduce-scatter fingerprints its input first; None when it does."""
    sharded = [m for m in model.modules() if callable(getattr(m, "set_custom_reduce_scatter", None))]
    if not sharded:
        return NOT_DATA_PARALLEL
    try:  # FSDP's own default, which the comm extends: private, so a torch that moved it leaves fingerprints off
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError as exc:
        return f"FSDP2 of this torch has no default reduce-scatter where it was: {exc}"

    class FingerprintedReduceScatter(DefaultReduceScatter):  # the default, fingerprinting its input first
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
            if _active is not None:
                _active.record_flat(input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    comm = FingerprintedReduceScatter()
    for module in sharded:
        groups = _shard_groups(module)
        if any(group.size() != world_size for group in groups):  # HSDP: the shards of one replica, not the world
            return f"FSDP2 shards over fewer than the {world_size} ranks: only sharding over all is compared"
        try:
            module.set_custom_reduce_scatter(comm)
        except ValueError as exc:  # several parameter groups in one module (shard_placement_fn)
            return f"FSDP2 refused a custom reduce-scatter: {exc}"
    return None


def _shard_groups(module: Any) -> list[Any]:
    """The process groups an FSDP2 module reduce-scatters over (none known: a torch whose internals moved)."""
    try:
        return [g.mesh_info.shard_process_group for g in module._get_fsdp_state()._fsdp_param_groups]
    except AttributeError:
        return []


def uninstall(recorder: Recorder) -> None:
    """The Warden that owned `recorder` closes: its hook records nothing more."""
    global _active
    if _active is recorder:
        _active = None
