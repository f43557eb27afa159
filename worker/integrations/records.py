"""A trainer's own checkpoint made one of ours: completion records and a manifest, and where to resume from.

After the framework wrote its checkpoint of step S into `PREFIX-S/`, every rank checksums its share of the files
(round robin over the sorted names: the cost is spread) and writes its record with its health; rank 0, once every
record is there, writes the manifest, atomically and last (worker.manifest). The supervisor then checks it like a
sharded checkpoint: every file by size and checksum, the health of every rank.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from worker.contract import ENV_RESUME_DIR, ENV_RESUME_STEP, RunLayout, WorkerConfig
from worker.files import atomic_write_json, file_crc32, is_plain_dir, is_plain_file, read_json
from worker.manifest import FRAMEWORK_FORMAT, MANIFEST, build_manifest, framework_name, rank_record_name
from worker.store import CheckpointStore

__all__ = ["framework_files", "record_completion", "resume_directory"]


def framework_files(directory: Path) -> list[str]:
    """The files the framework wrote into `directory` (and one level of directories below), sorted; ours, symlinks
    and anything else not a plain file are left out."""
    found = []
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if is_plain_dir(path):
            found += [f"{name}/{inner}" for inner in sorted(os.listdir(path)) if is_plain_file(path / inner)]
        elif is_plain_file(path):
            found.append(name)
    return [name for name in found if framework_name(name)]


def record_completion(
    directory: Path, *, step: int, rank: int, world_size: int, health: dict[str, Any], framework: str, root: Path
) -> float:
    """This rank's record, then (rank 0) the manifest once every rank's is there; the seconds it took. Every rank
    calls it for the same step, after the framework's save returned on every rank."""
    started = time.perf_counter()
    _barrier(world_size)  # every rank's part of the framework's save is written
    share = framework_files(directory)[rank::world_size]
    files = {}
    for name in share:
        size, crc = file_crc32(directory / name)
        files[name] = {"size": size, "crc32": crc}
    record = {
        "rank": rank,
        "world_size": world_size,
        "files": files,
        "is_health": health["is_health"],
        "health_reasons": health["health_reasons"],
    }
    atomic_write_json(directory / rank_record_name(rank), record, root=root)
    _barrier(world_size)  # every record is durable
    if rank == 0:
        import torch

        records = [read_json(directory / rank_record_name(r)) for r in range(world_size)]
        manifest = build_manifest(
            step, records, torch_version=torch.__version__, common={"framework": framework}, format=FRAMEWORK_FORMAT
        )
        atomic_write_json(directory / MANIFEST, manifest, root=root)  # last: now it is a checkpoint
    return time.perf_counter() - started


def resume_directory(layout: RunLayout, config: WorkerConfig) -> Path | None:
    """The framework checkpoint directory to resume from: the supervisor's choice (TRAINWARDEN_RESUME_STEP; empty:
    from scratch), else (plain torchrun) the newest with a manifest, else None."""
    named = os.environ.get(ENV_RESUME_STEP)
    if named is not None:
        if not named:
            return None
        where = os.environ.get(ENV_RESUME_DIR)
        store = CheckpointStore(Path(where)) if where else layout.checkpoints
        return store.framework_dir(int(named), config.prefix)
    if config.resume_training is False:
        return None
    steps = layout.checkpoints.sharded_steps(config.prefix)
    return layout.checkpoints.framework_dir(max(steps), config.prefix) if steps else None


def _barrier(world_size: int) -> None:
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
