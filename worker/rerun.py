"""Re-running a suspect step inside the job, to tell a bad GPU from a bad batch (worker.sdc judges).

On an alarm (an anomalous step, or a rank whose own values stood out), before the optimizer steps, every rank
computes the step's forward and backward again, with the torch random state it started from (CPU and CUDA: dropout's);
Python's and NumPy's are put back as the original step left them, afterwards:

1. for each suspect, a *partner* (another rank, holding the same parameters, as data-parallel ranks do) recomputes
   the suspect's batch alone (`no_sync`), with the suspect's torch random state, and fingerprints the gradients it
   gets;
2. then every rank recomputes its own batch through DDP as usual: the fingerprinting hook records it exactly as it
   recorded the original, and DDP averages the re-run's gradients into every rank's `.grad`;
3. one all-reduce makes every rank's re-run and every partner's result job-wide, and every rank judges alike.

At most two extra forward and backward passes per rank (its own, and one suspect's), and only on alarms. What the
loop hands over is one callable, `recompute(rank)`: the loss of the batch that `rank` trained at this step, computed
through the DDP model (the Warden runs its backward). It must draw that batch from the step's sample ids, not from
a random state other than torch's (the only one restored for a re-run, and sent to the partner). Reproducing a
result needs deterministic kernels (on GPUs: `torch.use_deterministic_algorithms(True)` and
`CUBLAS_WORKSPACE_CONFIG=:4096:8`); results agree within `sdc.REPRODUCED_RTOL`, Megatron-LM's tolerance for
non-deterministic backward kernels.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.sdc import (
    Fingerprint,
    SdcVerdict,
    fingerprint_rows,
    fingerprint_values,
    from_rows,
    judge,
    partners,
    reproduced,
)

__all__ = ["RandomState", "Rerun", "capture", "rerun_step", "restore"]


@dataclass(frozen=True)
class RandomState:
    """A random state: torch's (CPU, and the current CUDA device's), and Python's and NumPy's (None: not taken)."""

    torch_cpu: Any
    torch_cuda: Any
    python: Any
    numpy: Any


@dataclass(frozen=True)
class Rerun:
    """What re-running a suspect step found: the verdicts, and every rank's re-run fingerprint."""

    verdicts: tuple[SdcVerdict, ...]
    reruns: tuple[Fingerprint, ...]
    reproduced: bool  # every rank's averaged gradient norm came out as in the original step
    norm: float  # this rank's, in the re-run


def capture(*, everything: bool = True) -> RandomState:
    """The process's random state now; torch's only unless `everything` (taken at every step's start while re-runs
    are on: torch's costs a microsecond, NumPy's 35)."""
    import torch

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy = sys.modules.get("numpy") if everything else None
    numpy_state = None if numpy is None else numpy.random.get_state()
    return RandomState(torch.get_rng_state(), cuda, random.getstate() if everything else None, numpy_state)


def restore(state: RandomState) -> None:
    import torch

    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None:
        torch.cuda.set_rng_state(state.torch_cuda)
    if state.python is not None:
        random.setstate(state.python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and state.numpy is not None:
        numpy.random.set_state(state.numpy)


def rerun_step(
    model: Any,
    recompute: Callable[[int], Any],
    *,
    originals: Sequence[Fingerprint],
    suspects: Sequence[int],
    started: RandomState,
    take_fingerprint: Callable[[], list[float] | None],
    original_norm: float,
    after_backward: Callable[[], None] = lambda: None,
) -> Rerun:
    """Re-run the step on every rank (see the module's docstring); leaves the re-run's averaged gradients in
    `.grad` and the random state as the original step left it. `original_norm`: this rank's gradient norm after
    the original step's reduction, compared with the re-run's; `after_backward` does to the re-run's gradients what
    was done to the original's (a fault that stands for bad data strikes again)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    left = capture()
    params = [p for p in model.parameters() if p.requires_grad]
    checked: dict[int, tuple[float, float, int]] = {}  # the suspects' batches this rank ran as their partner
    if suspects:  # agreed on every rank, so every rank takes part in the gather, or none
        states = _gather(started.torch_cpu, world)
        for suspect, partner in partners(suspects, world).items():
            if partner == rank:
                torch.set_rng_state(states[suspect])
                _zero(params)
                with model.no_sync():
                    loss = recompute(suspect)
                    loss.backward()
                checked[suspect] = fingerprint_values(float(loss.detach()), _local_squares(params))
    restore(started)
    _zero(params)  # a partner's run went through no hook: the recorder holds nothing of it
    loss = recompute(rank)
    loss.backward()
    after_backward()
    squares = take_fingerprint()
    mine = {} if squares is None else {rank: fingerprint_values(float(loss.detach()), squares)}
    norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))  # as the guard measured it, without clipping
    differs = 0.0 if reproduced(_as_print(original_norm), _as_print(norm)) else 1.0
    rows = fingerprint_rows(world, mine) + fingerprint_rows(world, checked) + [differs]
    both = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    values = both.tolist()
    reruns = from_rows(values[: 3 * world])
    crosses = {s: p for s, p in enumerate(from_rows(values[3 * world : 6 * world])) if p is not None}
    restore(left)
    own = [p for p in reruns if p is not None]
    if len(own) != world:  # a rank's hook recorded nothing (not with DDP): judged on the originals, so skipped
        own = list(originals)
    return Rerun(tuple(judge(originals, own, crosses, suspects)), tuple(own), values[-1] == 0.0, norm)


def _as_print(norm: float) -> Fingerprint:
    """A gradient norm alone, as a fingerprint to compare (NaN and inf both count as non-finite)."""
    return Fingerprint(0.0, norm if math.isfinite(norm) else math.inf, 0 if math.isfinite(norm) else 1)


def _gather(state: Any, world: int) -> list[Any]:
    """Every rank's torch CPU random state (a few KB each): the partner of a suspect re-runs with the suspect's."""
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(gathered, state)
    return gathered


def _zero(params: list[Any]) -> None:
    for p in params:
        p.grad = None


def _local_squares(params: list[Any]) -> list[float]:
    """The squared norm of each gradient now in `.grad` (the partner's run: no hook saw them)."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads]).tolist()
