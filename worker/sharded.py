"""Sharded checkpoints through torch.distributed.checkpoint (DCP): saved by every rank, resharded on load,
written in the background, and never trusted before their manifest checks out.

Model and optimizer go through DCP (`get_state_dict`/`set_state_dict`: plain modules, DDP and FSDP2 alike), so a
checkpoint written by N ranks loads on M. What belongs to one rank (RNG states, data position, scheduler,
extra_state, anomaly history) goes beside it in `rank_R.pt`, one file per rank: DCP keeps a single copy of a
non-tensor key that several ranks share, which would collapse every rank's RNG state into rank 0's.

Our DCP file system follows no symlink, creates every file new, and checksums (CRC-32) each file while writing it;
our reader unpickles DCP's `.metadata` with an allow-list of DCP's own metadata classes only, and loads non-tensor
items with `weights_only=True` (DCP's default planner unpickles them unrestricted). A background save
runs in one thread of this process ("thread" async mode): measured here against DCP's process-based executor in
`bench/checkpoint_stall.py`, and the process mode re-imports the training script in a spawned child, which a
script without a `__main__` guard (and our warm standbys, which run scripts through runpy) cannot survive.
The background writer serves the disk saves a rank makes itself: every save with the memory tier off, and with it
on, stop orders' saves and the final one. A snapshot into memory (worker.memory) is written synchronously: the copy
into tmpfs is all it costs, and the supervisor, not the rank, copies it to disk.

torch.distributed's object collectives, which DCP plans with, need NumPy (`pip install 'trainwarden[dcp]'`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from worker.checkpoint import HashingWriter, restore_rng
from worker.contract import CHECKPOINT_WRITER_GROUP
from worker.files import (
    Refused,
    atomic_write,
    atomic_write_json,
    ensure_dir,
    open_in,
    open_regular,
    read_bytes,
    read_json,
    unlink_quietly,
)
from worker.manifest import (
    MANIFEST,
    METADATA,
    ManifestError,
    build_manifest,
    file_problem,
    rank_record_name,
    rank_state_name,
    read_manifest,
)

__all__ = [
    "NUMPY_NEEDED",
    "Loaded",
    "ShardedCheckpointer",
    "derived_rng",
    "holds_dtensors",
    "load_sharded_model",
    "numpy_missing",
]

NUMPY_NEEDED = (
    "checkpoint_format dcp needs NumPy: torch.distributed's object collectives, which DCP plans with, "
    "use it (pip install 'trainwarden[dcp]')"
)
# DCP warns on every save and load in one process without a process group, which is what we mean there.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
GROUP_TIMEOUT = timedelta(minutes=10)  # a peer that died mid-save fails the background collectives within this
MAX_METADATA_BYTES = 1 << 30


def numpy_missing() -> bool:
    """Whether NumPy cannot be imported (then DCP's collectives fail with 'Numpy is not available')."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def holds_dtensors(model: Any) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2's fully_shard, tensor parallelism). Never imports
    torch.distributed.tensor (0.6 s at every rank's start): without it loaded, nothing can be a DTensor."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


# -- files: no symlink followed, every file new, each checksummed while it is written --------------------------------


class _HashingStream(io.RawIOBase):
    """A new file opened for writing, counted and CRC-32'd as DCP writes it (its offsets come from `tell`)."""

    def __init__(self, fd: int, on_write: Callable[[], None] | None) -> None:
        self._file = os.fdopen(fd, "wb")
        self._hash = HashingWriter(self._file)
        self._on_write = on_write

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._hash.write(bytes(data))
        if self._on_write is not None:
            self._on_write()
        return written

    def tell(self) -> int:
        return self._hash.size

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        self._file.close()
        super().close()


def _file_system(root: Path, on_write: Callable[[], None] | None = None) -> Any:
    """A DCP FileSystem inside the run dir `root`: reads refuse symlinks and FIFOs, writes create new files only
    and record {name: (size, crc32)} in `.written`."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class SafeFileSystem(FileSystem):
        def __init__(self) -> None:
            self.written: dict[str, tuple[int, str]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            path = Path(path)
            if "r" in mode:
                with os.fdopen(open_regular(path), "rb") as stream:
                    yield stream
                return
            unlink_quietly(path)  # a leftover of a save killed at this step: this one starts it anew
            hashing = _HashingStream(open_in(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, root=root), on_write)
            try:
                yield hashing
            finally:
                hashing.close()
                self.written[path.name] = (hashing.tell(), hashing._hash.hexdigest())

        def rename(self, path: Any, new_path: Any) -> None:
            os.replace(path, new_path)  # DCP's .metadata.tmp -> .metadata, in the directory we created
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)

        def mkdir(self, path: Any) -> None:
            ensure_dir(root, Path(path))

        def exists(self, path: Any) -> bool:
            return os.path.lexists(path)

        def rm_file(self, path: Any) -> None:
            unlink_quietly(path)

    return SafeFileSystem()


# -- DCP's metadata pickle, unpickled with an allow-list ----------------------------------------------------------

_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata`: its own dataclasses, torch.Size, dtypes and layouts; any other global is refused, so a
    crafted file cannot call anything (the pickle module's "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return getattr(sys.modules[module] if module in sys.modules else __import__(module, fromlist=[name]), name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not DCP's metadata")


def _read_metadata(directory: Path) -> Any:
    """DCP's `.metadata` of `directory`, unpickled with the allow-list; UnpicklingError names a foreign global."""
    return _MetadataUnpickler(io.BytesIO(read_bytes(directory / METADATA, MAX_METADATA_BYTES))).load()


def _reader(directory: Path, root: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def __init__(self) -> None:
            super().__init__(directory)
            self.fs = _file_system(root)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader()


def _safe_bytes(planner: Any, read_item: Any, value: io.BytesIO) -> None:
    """DCP's load_bytes with `weights_only=True`: a non-tensor item (an optimizer's lr) is plain data or refused."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper

    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


def _load_planner(*, empty: bool = False, keys: set[str] | None = None) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        load_bytes = _safe_bytes

    class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
        load_bytes = _safe_bytes

    return SafeEmptyPlanner(keys=keys) if empty else SafeLoadPlanner()


# -- the checkpointer --------------------------------------------------------------------------------------------


@dataclass
class _Save:
    """One save: where, which step, and (once the background write ends) how it went."""

    directory: Path
    step: int
    stall_s: float
    started: float
    root: Path  # no symlink below it is followed: the run dir, or the memory directory for a snapshot in memory
    thread: threading.Thread | None = None
    error: BaseException | None = None
    duration_s: float = 0.0  # from the call to the manifest (this rank's part: to its record)
    write_s: float = 0.0  # the write alone, after the staging: what a save interval must leave it time for
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Loaded:
    """What a sharded resume restored besides model and optimizer: this rank's state, and how it was chosen."""

    state: dict[str, Any]
    manifest: dict[str, Any]
    resharded: bool  # written by another world size: RNG streams derived, shared state from rank 0


class ShardedCheckpointer:
    """Save and load one rank's part of sharded checkpoints; at most one save in flight."""

    def __init__(
        self, *, rank: int, world_size: int, root: Path, async_save: bool, on_write: Callable[[int], None] | None = None
    ) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.root, self.async_save = rank, world_size, root, async_save
        self._distributed = dist.is_available() and dist.is_initialized()
        if not self._distributed:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        # A step saved again (after a rollback) is written anew: DCP's notice that it overwrites says nothing more.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint in", category=UserWarning)
        # The background write plans and gathers on a group of its own, never interleaved with training collectives.
        self._group = _writer_group() if self._distributed else None
        self._on_write = on_write  # fault injection: called at each write into a shard
        self._inflight: _Save | None = None
        self._staged: dict[str, Any] | None = None  # the staging buffers, kept for the next save
        self._preparing: threading.Thread | None = None  # allocating them before the first save (`prepare`)

    @property
    def in_flight(self) -> int | None:
        """The step of a save still being written, if any."""
        return None if self._inflight is None or self._inflight.done.is_set() else self._inflight.step

    def save(
        self,
        directory: Path,
        step: int,
        model: Any,
        optimizer: Any,
        rank_state: dict[str, Any],
        health: dict[str, Any],
        common: dict[str, Any],
        *,
        started: float | None = None,
        root: Path | None = None,
        background: bool | None = None,
    ) -> float:
        """Start saving step `step` into `directory` (the previous save finished first); returns the training
        thread's stall in seconds, from `started` (the caller's start of the save; default: now). Synchronous unless
        async_save (or `background`, when given): then it returns once the state is staged. `root`: no symlink
        below it is followed (default: the run dir; a snapshot in memory passes the memory directory)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        started = time.perf_counter() if started is None else started
        root = self.root if root is None else root
        background = self.async_save if background is None else background
        self.wait()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        ensure_dir(root, directory)
        if self.rank == 0:
            unlink_quietly(directory / MANIFEST)  # a checkpoint of this step saved before is no longer one
        if background:
            state = self._stage(state)  # a copy: the optimizer may change the live tensors now
        save = _Save(directory, step, 0.0, started, root=root)
        job = (save, state, rank_state, health, common)
        if background:
            save.thread = threading.Thread(target=self._write, args=job, name=f"trainwarden-save-{step}", daemon=True)
            save.thread.start()
        self._inflight = save
        if not background:
            self._write(*job)
        save.stall_s = time.perf_counter() - started
        return save.stall_s

    def prepare(self, model: Any, optimizer: Any) -> None:
        """Allocate the staging buffers of the first save now, in a thread of their own, so that the first save
        stalls the loop no more than the others (pinned buffers took 5.8 s at the first save on an H200). Call it
        between steps once the optimizer has stepped (its state then has the layout a save copies), on the training
        thread: the state dict is taken here (FSDP2's state-dict hooks reshard the live modules), only the buffers
        are made in the background. A save waits for them; if anything fails, the first save allocates as before."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.async_save or self._staged is not None or self._preparing is not None:
            return
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._preparing = threading.Thread(
            target=self._allocate, args=(state, device), name="trainwarden-staging", daemon=True
        )
        self._preparing.start()

    def _allocate(self, state: dict[str, Any], device: int | None) -> None:
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        try:
            if device is None:
                staged = _create_cpu_state_dict(state)
                _copy_state_dict(state, staged)  # fresh pages are slow to copy into the first time: touch them now
            else:
                torch.cuda.set_device(device)  # a new thread is on device 0: no CUDA context of this rank there
                # torch copies a DTensor's shard to the host to shape its buffer: on a stream of its own, not queued
                # between the training's kernels on the default one
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    staged = _create_cpu_state_dict(state, pin_memory=True)
            self._staged = staged
        except Exception:  # noqa: BLE001 - an optimisation only: the first save then allocates, as without it
            pass

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `state` in buffers kept from one save to the next (pinned on a GPU machine): copying into
        memory already touched is ~15x faster than into fresh pages (0.08 s against 1.2 s for 768 MB per rank here).
        The previous save's write is over before they are reused (`wait`); a state whose layout changed (the
        optimizer's first step) gets new buffers. DCP's own BlockingAsyncStager does the same copies, without
        keeping them on a CPU-only machine; its DefaultStager failed on its second use with torch 2.11 on a GPU."""
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._preparing is not None:
            self._preparing.join()  # the first save's buffers, allocated since the first step (`prepare`)
        cuda = torch.cuda.is_available()
        try:
            if self._staged is None:
                raise KeyError("nothing staged yet")
            staged = _copy_state_dict(state, self._staged, non_blocking=cuda)
        except Exception:  # noqa: BLE001 - the layout changed (torch's CompanionMismatch): new buffers, else it raises
            self._staged = _create_cpu_state_dict(state, pin_memory=cuda)
            staged = _copy_state_dict(state, self._staged, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the copies are complete before the loop changes the tensors again
        return staged

    def wait_quietly(self) -> None:
        """Wait for the save in flight without taking its result (safe in a signal handler: nothing is logged)."""
        if self._inflight is not None:
            self._inflight.done.wait()

    def wait(self) -> _Save | None:
        """Wait for the save in flight; returns it once (for its figures), raising what its write raised."""
        save, self._inflight = self._inflight, None
        if save is None:
            return None
        save.done.wait()
        if save.thread is not None:
            save.thread.join()  # its last references to the staged copy and the group are gone
        if save.error is not None:
            raise save.error
        return save

    def finished(self) -> _Save | None:
        """The save in flight if it has just ended (returned once), else None; raises what its write raised."""
        return self.wait() if self._inflight is not None and self._inflight.done.is_set() else None

    def _write(
        self,
        save: _Save,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        health: dict[str, Any],
        common: dict[str, Any],
    ) -> None:
        begun = time.perf_counter()
        try:
            self._write_all(save.root, save.directory, save.step, state, rank_state, health, common)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
            save.error = exc
        finally:
            ended = time.perf_counter()
            save.write_s, save.duration_s = ended - begun, ended - save.started
            save.done.set()

    def _write_all(
        self,
        root: Path,
        directory: Path,
        step: int,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        health: dict[str, Any],
        common: dict[str, Any],
    ) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        on_write = self._on_write
        fs = _file_system(root, (lambda: on_write(step)) if on_write else None)
        writer = dcp.FileSystemWriter(
            directory, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True
        )
        writer.fs = fs
        dcp.save(state, storage_writer=writer, process_group=self._group, no_dist=not self._distributed)
        hashing = HashingWriter(None)

        def write(f: Any) -> None:
            hashing.file = f
            # torch.save writes to any object with write() and flush(); its annotation says IO[bytes]
            torch.save(rank_state, hashing)  # type: ignore[arg-type]

        atomic_write(directory / rank_state_name(self.rank), write, root=root)
        files = {name: {"size": size, "crc32": crc} for name, (size, crc) in fs.written.items()}
        files[rank_state_name(self.rank)] = {"size": hashing.size, "crc32": hashing.hexdigest()}
        record = {"rank": self.rank, "step": step, "files": files, **health}
        atomic_write_json(directory / rank_record_name(self.rank), record, root=root)
        if self._distributed:
            dist.barrier(group=self._group)  # every rank's record is durable
        if self.rank == 0:
            records = [read_json(directory / rank_record_name(rank)) for rank in range(self.world_size)]
            manifest = build_manifest(step, records, torch_version=torch.__version__, common=common)
            atomic_write_json(directory / MANIFEST, manifest, root=root)  # last: now it is a checkpoint

    def load(self, directory: Path, step: int, model: Any, optimizer: Any) -> Loaded:
        """Restore model and optimizer from the sharded checkpoint (any world size) and return this rank's state.

        The manifest is checked first (sizes of every file, checksums of the files this rank opens whole, the
        supervisor having checked every checksum before the launch); what does not check out raises ManifestError."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        manifest = read_manifest(directory, step)
        resharded = manifest["world_size"] != self.world_size
        own = rank_state_name(0 if resharded else self.rank)
        for name, entry in manifest["files"].items():
            problem = file_problem(directory / name, entry, verify=name in (METADATA, own))
            if problem:
                raise ManifestError(f"{name}: {problem}")
        _read_metadata(directory)  # refused here, in our words, rather than wrapped in DCP's exception
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(
            state,
            storage_reader=_reader(directory, self.root),
            planner=_load_planner(),
            process_group=self._group,
            no_dist=not self._distributed,
        )
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return Loaded(_load_rank_state(directory / own), manifest, resharded)


def _writer_group() -> Any:
    """The background write's gloo group, named (torch >= 2.4) so the flight recorder tells its collectives apart."""
    import inspect

    import torch.distributed as dist

    if "group_desc" in inspect.signature(dist.new_group).parameters:
        return dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT, group_desc=CHECKPOINT_WRITER_GROUP)
    return dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)


def _load_rank_state(path: Path) -> dict[str, Any]:
    import torch

    try:
        fd = open_regular(path)
    except Refused as exc:
        raise ManifestError(f"{path.name}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ManifestError(f"{path.name} holds no rank state")
    return state


def derived_rng(saved_rng: dict[str, Any], step: int, rank: int) -> None:
    """Seed this rank's generators after a change of world size: rank r's seed is a hash of rank 0's saved torch
    RNG state, the step and r, so the streams are deterministic and distinct per rank (not those of an
    uninterrupted run, which had other ranks)."""
    import torch

    digest = hashlib.blake2b(bytes(saved_rng["torch"].tolist()) + f"/{step}/{rank}".encode(), digest_size=8)
    seed = int.from_bytes(digest.digest(), "little") >> 1
    restore_rng(saved_rng)  # restores what is not reseeded below (NumPy only if present, CUDA only if available)
    random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA device
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def load_sharded_model(directory: Path, root: Path) -> dict[str, Any]:
    """The whole model state_dict of a sharded checkpoint, in one process without a process group (for export):
    the manifest and every file checked first."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # dcp.load fills a copy of `state`

    read_manifest(directory)  # the caller checked the files; this names a missing manifest
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=_reader(directory, root), planner=_load_planner(empty=True, keys={"model"}), no_dist=True
    )
    return state.get("model", {})
