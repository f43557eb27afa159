"""Snapshots into memory written off the training thread: the loop pays only a copy of the state into buffers kept
from one snapshot to the next (on a GPU, a device-to-host copy into pinned buffers); serializing it, writing the
file, its record and meta.json, and the pin happen in a background thread.

The guarantees stay those of a synchronous write (worker.checkpoint.save_checkpoint): one snapshot in flight at a
time, and the next one starts only once it is complete, so the slot holding the newest complete snapshot is never
the one being written; the record (size and CRC-32 computed while writing) comes after the file, and the pin links
only a snapshot whose record exists. A kill at any instant leaves the previous snapshot whole.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SnapshotWrite", "SnapshotWriter", "StagedState"]


class StagedState:
    """Copies of a state's tensors in buffers allocated at the first copy and reused while the tensors keep their
    shape, dtype and layout (pinned host memory for GPU tensors: their copies run without blocking the loop until
    the background thread needs them)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}

    def copy(self, state: Any) -> tuple[Any, Any]:
        """A copy of `state` (containers rebuilt, tensors in the kept buffers, other values deep-copied, tensors
        that share memory sharing a buffer, as torch.save would store them) and what to wait on before reading the
        copies (a CUDA event; None when every copy is done)."""
        import torch

        seen: dict[tuple[Any, ...], Any] = {}
        copied = self._copy(state, (), seen)
        event = None
        if any(buffer.is_pinned() for buffer in seen.values()):
            event = torch.cuda.Event()
            event.record()  # after the copies on the current stream; the loop's next kernels queue behind them
        return copied, event

    def _copy(self, value: Any, path: tuple[Any, ...], seen: dict[tuple[Any, ...], Any]) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, seen)
        if isinstance(value, dict):
            rebuilt: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
            for key, item in value.items():
                rebuilt[key] = self._copy(item, (*path, key), seen)
            if hasattr(value, "_metadata"):  # a module state dict's versions, which load_state_dict reads
                rebuilt._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
            return rebuilt
        if isinstance(value, list):
            return [self._copy(item, (*path, index), seen) for index, item in enumerate(value)]
        if type(value) is tuple:
            return tuple(self._copy(item, (*path, index), seen) for index, item in enumerate(value))
        return copy.deepcopy(value)  # plain data the loop may change in place next step (a list, a user's object)

    def _tensor(self, tensor: Any, path: tuple[Any, ...], seen: dict[tuple[Any, ...], Any]) -> Any:
        import torch

        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
            return tensor.detach().clone()  # a subclass, sparse or quantized tensor: a fresh copy, no buffer kept
        identity = (tensor.data_ptr(), tensor.dtype, tensor.device, tuple(tensor.shape), tuple(tensor.stride()))
        if identity in seen and tensor.data_ptr():
            return seen[identity]  # tied weights: one buffer, as one storage is saved once
        buffer = self._buffers.get(path)
        if buffer is None or (buffer.dtype, buffer.shape, buffer.stride()) != (
            tensor.dtype,
            tensor.shape,
            tensor.stride(),
        ):
            pin = tensor.device.type == "cuda"
            buffer = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=pin
            )
            self._buffers[path] = buffer
        buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
        seen[identity] = buffer
        return buffer


@dataclass
class SnapshotWrite:
    """One snapshot being written: its step, slot and whether it is pinned; once done, its size, how long the write
    took, and what it raised."""

    step: int
    slot: int
    pin: bool
    stall_s: float = 0.0  # the loop's: the copy
    write_s: float = 0.0  # the background thread's: serialize, write, record, pin
    bytes: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SnapshotWriter:
    """At most one snapshot write in flight, in a thread kept for them (started at the first): starting a thread per
    snapshot made the loop wait for the new thread to run and then for the interpreter lock it took, ~5 ms."""

    def __init__(self) -> None:
        self._inflight: SnapshotWrite | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.staged = StagedState()

    @property
    def in_flight(self) -> SnapshotWrite | None:
        return self._inflight

    def start(self, write: SnapshotWrite, job: Callable[[], int], ready: Any = None) -> None:
        """Run `job` (it writes the snapshot and returns its bytes) in the background, after `ready` (a CUDA
        event: the copies it reads) has happened. The previous write must have been taken (`finished`, `wait`)."""
        assert self._inflight is None, "one snapshot write at a time"

        def run() -> None:
            begun = time.perf_counter()
            try:
                if ready is not None:
                    ready.synchronize()
                write.bytes = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                write.error = exc
            finally:
                write.write_s = time.perf_counter() - begun
                write.done.set()

        self._inflight = write
        self._jobs.put(run)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="trainwarden-snapshots", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def wait_quietly(self) -> None:
        """Wait for the write in flight without taking it (safe in a signal handler: nothing is logged or raised)."""
        if self._inflight is not None:
            self._inflight.done.wait()

    def wait(self) -> SnapshotWrite | None:
        """Wait for the write in flight; returns it once (raising what it raised), or None when there is none."""
        write, self._inflight = self._inflight, None
        if write is None:
            return None
        write.done.wait()
        if write.error is not None:
            raise write.error
        return write

    def finished(self) -> SnapshotWrite | None:
        """The write in flight if it has ended (returned once, raising what it raised), else None."""
        return self.wait() if self._inflight is not None and self._inflight.done.is_set() else None
