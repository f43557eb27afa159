"""Fault injection for demos and tests: real faults (SIGKILL, hangs, SIGSTOP, slow saves) at a chosen rank and step.

`TRAINWARDEN_FAULTS` holds comma-separated `RANK:KIND@STEP[:ARG[:LAYER]]` items, e.g. `1:hang@25`. RANK may be
`HOST/LOCAL_RANK` instead (`node2/0:bitflip_persistent@20`): the fault stays with that host's rank of that local rank,
whatever its global rank in each attempt, as a faulty GPU stays in its machine.
A fault fires only in the first attempt of a run, so the relaunched run can pass the same step. With
`TRAINWARDEN_FAULTS_ONCE=1` each fault fires instead the first time its step is reached in any attempt (a mark
in the rank's folder of the run dir remembers it): a stream of faults over several attempts, as a benchmark
needs, under the supervisor or torchrun alike.
Kinds:
- `sigkill`: the rank SIGKILLs itself right after finishing step STEP.
- `sigkill_in_save`: the rank SIGKILLs itself halfway through writing its checkpoint of step STEP (a sharded
  one: at its first write into its shard, in the background thread with async_save).
- `sigkill_in_async_write`: the same, named for what it tests: the rank dies while its background thread writes
  the sharded checkpoint of step STEP and the training loop has gone on (a background writer killed is its rank).
- `hang_in_async_write`: the background write of step STEP stalls forever; the loop goes on until it must wait
  for that save (the next save, a stop, the end), then hangs in the save phase.
- `slow_async_write`: the background write of step STEP takes ARG seconds longer (default 5), at its first write
  into the shard: saves then come faster than they are written, and the next one waits for it.
- `sigkill_after_save`: the rank SIGKILLs itself right after its checkpoint of step STEP is complete.
- `sigkill_in_forward`, `sigkill_in_backward`, `sigkill_in_guard`, `sigkill_in_optimizer`: the rank SIGKILLs itself
  at that point of step STEP: as its model's forward begins; in the backward, as its first parameter's gradient is
  computed (the last, for the input layer: most of DDP's gradient all-reduces are under way); just before the step
  guard's all-reduce (its peers wait inside it); right after its optimizer's step (its peers apply the step too).
- `peer_gone`: after step STEP the rank's collective fails as if its connection to a peer were lost (it raises
  torch.distributed.DistNetworkError, every rank alive): a rank running through `worker.run` recovers in place,
  and its peers, whose next collective meets a closed connection, with it.
- `hang`: after step STEP the rank sleeps forever, so its peers block in the next step's all-reduce.
- `hang_in_save`: the rank sleeps forever inside its checkpoint save of step STEP.
- `sigstop`: the rank freezes itself with SIGSTOP after step STEP (as `kill -STOP` from outside would).
- `dataloader_hang`: after step STEP the rank waits forever for a batch from a DataLoader worker process that
  never delivers one (a stuck read, a dead filesystem), so its peers block in the next step's all-reduce.
- `stall_in_collective`: the step guard's all-reduce of step STEP never completes on this rank, as if its device
  or link stalled: its completion is stuck in the communication thread, so its peers complete that collective and
  wait in the next one while this rank waits inside it (needs `guard_step`; its peers come to that all-reduce
  half a second late, so the stall is in place before the collective can complete).
- `extra_collective`: before the step guard's all-reduce of step STEP the rank issues one more all-reduce, of one
  element, a desync: its peers' next collective meets it (gloo aborts or hangs; NCCL hangs). One element, smaller
  than any guard all-reduce: gloo aborts a rank that receives more than it expects, which makes it this rank
  (tests/e2e/test_hang_blame.py relies on that; a bigger one made a peer abort, depending on the sizes).
- `collective_sizes`: the step guard's all-reduce of step STEP has one element fewer on this rank, a desync.
- `slow_save`: the checkpoint save of step STEP takes ARG seconds longer (default 5).
- `slow`: a straggler: from step STEP on, every step's compute takes ARG seconds longer on this rank (default
  0.05; at most 3600), before the step guard's all-reduce, so its peers wait for it there (needs `guard_step`).
  Unlike the other kinds it stays in every attempt, as a slow node stays slow after a relaunch.
- `spike`: gradients are scaled by 1000 on this rank when step STEP is attempted, ARG times in a row
  (default 1; skipped steps do not advance the step, so a streak retries the same step number). It stands for
  bad data: a re-run of the step (worker.rerun) gets it again, so the step is judged the data's and skipped.
- `nan`: like `spike`, with a NaN written into the gradients (also in a re-run).
- `sdc`: silent data corruption: the activation gradient of one checked normalisation layer (LAYER, a
  qualified module name; default: the first checked layer) is multiplied by ARG (default 1e12; `nan`
  and `inf` work) when step STEP is attempted, once. Needs `feature_value_check.level` >= 1.
- `bitflip`: a faulty GPU's one wrong result: bit ARG (default 30, float32's highest exponent bit: a small value
  becomes ~1e35) of the first element of one parameter's gradient (LAYER, its name without DDP's `module.`;
  default: the first in DDP's first bucket) flips on this rank, before DDP's reduction, when step STEP is attempted,
  once. Needs a DDP model under a Warden (worker.fingerprint).
- `bitflip_persistent`: the same on every step from STEP on, in every attempt (a faulty GPU stays faulty).
- `poison`: bad data: the batch this rank trains at step STEP when no batch was skipped before it (batch STEP-1)
  has its model outputs multiplied by ARG (default 1000), on whichever rank computes it (a re-run's partner too),
  in every attempt. Needs a Warden (its forward hook).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.files import ensure_dir, open_append

__all__ = ["ENV_FAULTS", "ENV_FAULTS_ONCE", "KINDS", "Fault", "FaultPlan", "flip_bit", "hang_forever", "parse_faults"]

ENV_FAULTS = "TRAINWARDEN_FAULTS"
ENV_FAULTS_ONCE = "TRAINWARDEN_FAULTS_ONCE"
KINDS = (
    "sigkill",
    "sigkill_in_save",
    "sigkill_after_save",
    "hang",
    "hang_in_save",
    "sigstop",
    "slow_save",
    "slow",
    "spike",
    "nan",
    "sdc",
    "sigkill_in_async_write",
    "hang_in_async_write",
    "slow_async_write",
    "dataloader_hang",
    "stall_in_collective",
    "extra_collective",
    "collective_sizes",
    "sigkill_in_forward",
    "sigkill_in_backward",
    "sigkill_in_guard",
    "sigkill_in_optimizer",
    "peer_gone",
    "bitflip",
    "bitflip_persistent",
    "poison",
)
LAYER_KINDS = ("sdc", "bitflip", "bitflip_persistent")  # the kinds that name a layer
BITFLIP_BIT = 30  # float32's highest exponent bit
POISON_FACTOR = 1000.0  # a `poison` fault's factor on the model's outputs by default
GRADIENT_KINDS = ("spike", "nan")
SLOW_S = 0.05  # a `slow` rank's extra seconds per step by default: a few times the demo's step
# The peers of a rank whose all-reduce stalls come to it this much later, so the stall's hook is in place before the
# collective can complete (on CPU it completes as the last rank arrives; a hook on a completed one runs on the caller).
STALL_LEAD_S = 0.5
MAX_SLOW_S = 3600.0
SLOW_WRITE_S = 5.0  # a `slow_async_write` fault's extra seconds by default


@dataclass(frozen=True)
class Fault:
    """One fault to inject: what, on which rank, at which step, with an optional duration."""

    rank: int
    kind: str
    step: int
    # seconds for slow_save, slow_async_write and slow, repetitions for spike and nan, the factor for sdc, the bit
    # for bitflip
    arg: float | None = None
    target: str | None = None  # the layer an sdc or bitflip fault corrupts
    host: str | None = None  # given, `rank` is the local rank on this host (HOST/LOCAL_RANK)

    def strikes(self, rank: int, where: tuple[str, int] | None) -> bool:
        """Whether the fault is the one of global rank `rank`, which runs `where` (its host and local rank)."""
        return self.rank == rank if self.host is None else where is not None and (self.host, self.rank) == where


def parse_faults(spec: str) -> list[Fault]:
    """Parse `RANK:KIND@STEP[:ARG[:LAYER]][,...]`; raises ValueError naming the bad item."""
    return [_parse_item(item) for item in (part.strip() for part in spec.split(",")) if item]


def _parse_item(item: str) -> Fault:
    try:
        rank, rest = item.split(":", 1)
        host, _, local = rank.rpartition("/")
        kind, when = rest.split("@", 1)
        step, _, arg = when.partition(":")
        arg, _, target = arg.partition(":")
        fault = Fault(
            rank=int(local),
            kind=kind,
            step=int(step),
            arg=float(arg) if arg else None,
            target=target or None,
            host=host or None,
        )
    except ValueError:
        raise ValueError(f"{ENV_FAULTS}: cannot parse {item!r}; expected [HOST/]RANK:KIND@STEP[:ARG[:LAYER]]") from None
    if fault.kind not in KINDS:
        raise ValueError(f"{ENV_FAULTS}: unknown fault kind {fault.kind!r} in {item!r}; known: {', '.join(KINDS)}")
    if fault.target is not None and fault.kind not in LAYER_KINDS:
        raise ValueError(f"{ENV_FAULTS}: only {', '.join(LAYER_KINDS)} faults name a layer, in {item!r}")
    if fault.kind.startswith("bitflip") and fault.arg is not None and fault.arg not in range(64):
        raise ValueError(f"{ENV_FAULTS}: a bitflip fault's bit must be a whole number from 0 to 63, in {item!r}")
    if fault.kind in ("slow", "slow_async_write") and fault.arg is not None and not 0 <= fault.arg <= MAX_SLOW_S:
        raise ValueError(
            f"{ENV_FAULTS}: a {fault.kind} fault's seconds must be between 0 and {MAX_SLOW_S:g}, in {item!r}"
        )
    return fault


class FaultPlan:
    """The faults armed for this rank in this attempt; `due()` is a dict lookup, cheap every step."""

    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        attempt: int,
        on_fire: Callable[[Fault], None] = lambda fault: None,
        marks: Path | None = None,
        where: tuple[str, int] | None = None,
    ) -> None:
        armed = attempt == 0 or marks is not None
        mine = [f for f in faults if f.strikes(rank, where)]
        self._due = {(f.kind, f.step): f for f in mine if armed and (marks is None or not _mark(marks, f).exists())}
        self._marks = marks
        self._on_fire = on_fire
        self._repeats = {key: int(f.arg or 1) for key, f in self._due.items() if f.kind in GRADIENT_KINDS}
        stalls = (f for f in faults if armed and f.kind == "stall_in_collective" and f not in mine)
        self._peer_stalls = {f.step for f in stalls}
        slow = (f for f in mine if f.kind == "slow")  # armed or not: it stays
        self._slow = min(slow, key=lambda f: f.step, default=None)
        persistent = (f for f in mine if f.kind == "bitflip_persistent")  # so does this
        self._persistent_flip = min(persistent, key=lambda f: f.step, default=None)
        # Every rank's poisoned batches, in every attempt: bad data is bad wherever and whenever it is trained.
        self._poison = {(f.step - 1, f.rank): f for f in faults if f.kind == "poison"}
        self._rank, self._poison_told = rank, False

    @classmethod
    def from_env(
        cls,
        *,
        rank: int,
        attempt: int,
        on_fire: Callable[[Fault], None] = lambda fault: None,
        rank_dir: Path | None = None,
    ) -> FaultPlan:
        """The plan `TRAINWARDEN_FAULTS` describes; marks go to `rank_dir` under TRAINWARDEN_FAULTS_ONCE=1."""
        once = os.environ.get(ENV_FAULTS_ONCE) == "1" and rank_dir is not None
        return cls(
            parse_faults(os.environ.get(ENV_FAULTS, "")),
            rank=rank,
            attempt=attempt,
            on_fire=on_fire,
            marks=rank_dir if once else None,
            where=(socket.gethostname(), int(os.environ.get("LOCAL_RANK", rank))),
        )

    def due(self, kind: str, step: int) -> Fault | None:
        """The armed fault of `kind` at `step`, announced through `on_fire` (it is about to strike)."""
        fault = self._due.get((kind, step)) if self._due else None
        if fault is not None:
            if self._marks is not None:  # remembered before it strikes: a SIGKILL comes next
                root = self._marks.parents[1]  # RUN_DIR/ranks/rank_N: nothing written outside the run dir
                ensure_dir(root, self._marks)
                os.close(open_append(_mark(self._marks, fault), root=root))
            self._on_fire(fault)
        return fault

    def after_step(self, step: int) -> None:
        """Fire the faults that strike between steps."""
        if not self._due:
            return
        if self.due("sigkill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("sigstop", step):
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.due("hang", step):
            hang_forever()
        if self.due("dataloader_hang", step):
            _wait_for_a_stuck_dataloader()
        if self.due("peer_gone", step):
            import torch.distributed as dist

            raise dist.DistNetworkError(f"peer_gone fault after step {step}: the connection to a peer was lost")

    def all_reduce(self, tensor: Any, op: Any, step: int) -> None:
        """The step guard's all-reduce of `step`, with this rank's collective fault of that step, if any."""
        import torch
        import torch.distributed as dist

        if step in self._peer_stalls:
            time.sleep(STALL_LEAD_S)
        if self._due and self.due("sigkill_in_guard", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if not self._due:
            dist.all_reduce(tensor, op=op)
        elif self.due("extra_collective", step):
            dist.all_reduce(torch.zeros(1, dtype=tensor.dtype, device=tensor.device), op=op)
            dist.all_reduce(tensor, op=op)
        elif self.due("collective_sizes", step):
            dist.all_reduce(tensor[:-1], op=op)
        elif self.due("stall_in_collective", step):
            _stalled_all_reduce(tensor, op)
        else:
            dist.all_reduce(tensor, op=op)

    def hook_step(self, model: Any, optimizer: Any, step: Callable[[], int]) -> list[Any]:
        """Hooks that fire the armed `sigkill_in_*` faults inside step `step()`; their handles (to remove)."""
        handles = []
        if self.armed("sigkill_in_forward"):
            handles.append(model.register_forward_pre_hook(lambda *_: self._kill_at("sigkill_in_forward", step())))
        if self.armed("sigkill_in_backward"):
            first = next(iter(model.parameters()))
            handles.append(first.register_hook(lambda _grad: self._kill_at("sigkill_in_backward", step())))
        if self.armed("sigkill_in_optimizer"):
            hook = lambda *_: self._kill_at("sigkill_in_optimizer", step())  # noqa: E731
            handles.append(optimizer.register_step_post_hook(hook))
        return handles

    def hook_data(self, model: Any, batch: Callable[[], tuple[int, int]]) -> list[Any]:
        """A forward hook that poisons the batch `batch()` names (its index, the rank whose batch it is), if a
        `poison` fault names it; its handle (to remove)."""
        if not self._poison:
            return []

        def poison(_module: Any, _inputs: Any, output: Any) -> Any:
            fault = self._poison.get(batch())
            if fault is None:
                return None
            if fault.rank == self._rank and not self._poison_told:  # said once, by the rank whose batch it is
                self._poison_told = True
                self._on_fire(fault)
            return output * (POISON_FACTOR if fault.arg is None else fault.arg)

        return [model.register_forward_hook(poison)]

    def _kill_at(self, point: str, step: int) -> None:
        if self.strike_once(point, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def in_compute(self, step: int) -> None:
        """Fire the faults that strike inside each step's compute, before the step guard's all-reduce."""
        slow = self._slow
        if slow is None or step < slow.step:
            return
        self.strike_once("slow", slow.step)  # announced once (while armed); it slows every step from then on
        time.sleep(SLOW_S if slow.arg is None else slow.arg)

    def in_save(self, step: int) -> None:
        """Fire the faults that strike inside a checkpoint save, before anything is written."""
        if not self._due:
            return
        if slow := self.due("slow_save", step):
            time.sleep(slow.arg if slow.arg is not None else 5.0)
        if self.due("hang_in_save", step):
            hang_forever()

    def in_background_write(self, step: int) -> None:
        """Fire the faults that strike while a sharded checkpoint is being written (the background thread's write
        with async_save); each strikes once, however many writes follow."""
        if not self._due:
            return
        if self.strike_once("sigkill_in_save", step) or self.strike_once("sigkill_in_async_write", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.strike_once("hang_in_async_write", step):
            hang_forever()
        if slow := self.strike_once("slow_async_write", step):
            time.sleep(SLOW_WRITE_S if slow.arg is None else slow.arg)

    def after_save(self, step: int) -> None:
        """Fire the faults that strike once a checkpoint is complete."""
        if self._due and self.due("sigkill_after_save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def gradient_fault(self, step: int) -> str | None:
        """`spike` or `nan` while such a fault at `step` has repetitions left (each call uses one)."""
        for kind in GRADIENT_KINDS:
            if self._repeats.get((kind, step), 0) > 0 and self.due(kind, step):
                self._repeats[(kind, step)] -= 1
                return kind
        return None

    def bitflip(self, step: int) -> Fault | None:
        """The bit flip due at `step` (a `bitflip` there, still armed; a `bitflip_persistent` from its step on),
        not yet announced: `flipped` does that once it struck."""
        if (once := self._due.get(("bitflip", step))) is not None:
            return once
        stays = self._persistent_flip
        return stays if stays is not None and step >= stays.step else None

    def flipped(self, fault: Fault, step: int) -> None:
        """A bit flip struck: a `bitflip` is disarmed, a `bitflip_persistent` announced the first time."""
        if fault.kind == "bitflip":
            self.strike_once("bitflip", step)
        else:
            self.strike_once("bitflip_persistent", fault.step)

    def armed(self, kind: str) -> list[Fault]:
        """The faults of `kind` still armed for this rank (to set up their injection points)."""
        return [f for (k, _), f in self._due.items() if k == kind]

    def strike_once(self, kind: str, step: int) -> Fault | None:
        """Like `due`, but disarms the fault: it strikes at most once, even if its step is attempted again."""
        if (kind, step) not in self._due:
            return None
        fault = self.due(kind, step)
        del self._due[(kind, step)]
        return fault


def flip_bit(grad: Any, fault: Fault) -> None:
    """Flip bit `fault.arg` (default BITFLIP_BIT) of `grad`'s first element, in place."""
    import torch

    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[grad.element_size()]
    bit = BITFLIP_BIT if fault.arg is None else int(fault.arg)
    if bit >= 8 * grad.element_size():
        raise ValueError(f"bitflip: bit {bit} is past a {grad.dtype} value's {8 * grad.element_size()} bits")
    word = grad.view(-1)[:1].view(bits)
    word.bitwise_xor_(torch.tensor(1 << bit if bit < 63 else -(1 << 63), dtype=torch.int64).to(bits))


def _mark(folder: Path, fault: Fault) -> Path:
    return folder / f"fault_fired_{fault.kind}_{fault.step}"


def _stalled_all_reduce(tensor: Any, op: Any) -> None:
    """An all-reduce that never completes on this rank, as a stalled device or link leaves it."""
    import torch
    import torch.distributed as dist

    if tensor.is_cuda:  # the device stalls: a kernel that spins for years, NCCL's collective queued behind it
        torch.cuda._sleep(1 << 62)
        dist.all_reduce(tensor, op=op)
        tensor.tolist()  # waits for the device
    else:  # the completion callback runs on gloo's communication thread before the work counts as completed
        dist.all_reduce(tensor, op=op, async_op=True).get_future().then(lambda _: hang_forever()).wait()


class _StuckDataset:
    """A dataset whose every item takes forever to read (a DataLoader worker process calls it)."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> Any:
        hang_forever()


def _wait_for_a_stuck_dataloader() -> None:
    from torch.utils.data import DataLoader

    next(iter(DataLoader(_StuckDataset(), num_workers=1)))  # type: ignore[arg-type]  # any map-style dataset will do


def hang_forever() -> None:
    """Block like a rank stuck in a collective that never returns (only a signal ends it)."""
    while True:
        time.sleep(3600)
