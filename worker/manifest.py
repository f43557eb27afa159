"""A sharded checkpoint's manifest: what makes a DCP directory a checkpoint, checked without torch.

A sharded checkpoint of step S is the directory `PREFIX-S.dcp/` of a checkpoint store. Every rank writes its
DCP shard (`__R_0.distcp`), its own state (`rank_R.pt`: RNG, data position, scheduler, extra_state) and then its
record (`rank_R.json`: each file it wrote with size and CRC-32, computed while writing, and its health); rank 0
also writes DCP's `.metadata`. Once every rank's record exists, rank 0 writes `MANIFEST.json`, atomically and
last: without it the directory is a save in flight or a torn one, never a checkpoint. The supervisor checks a
manifest and every file it lists by size and checksum; it never opens `.metadata` (a pickle) or the shards.

A framework's checkpoint (Lightning, the Hugging Face Trainer: worker.integrations) is a directory `PREFIX-S/` the
framework wrote its own files into; after it, each rank writes a record of its share of those files (size, CRC-32)
and its health, and rank 0 the manifest (format FRAMEWORK_FORMAT, naming the framework), again last.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path
from typing import Any

from worker.files import file_crc32, is_plain_dir, is_plain_file, read_json, unlink_quietly

__all__ = [
    "MANIFEST",
    "FORMAT",
    "FRAMEWORK_FORMAT",
    "METADATA",
    "ManifestError",
    "build_manifest",
    "file_problem",
    "is_our_file",
    "manifest_problem",
    "rank_record_name",
    "rank_state_name",
    "read_manifest",
    "remove_sharded",
]

MANIFEST = "MANIFEST.json"  # a checkpoint directory's, written last: it is complete once this exists
FORMAT = "trainwarden-dcp"
FRAMEWORK_FORMAT = "trainwarden-framework"
VERSION = 1
METADATA = ".metadata"  # DCP's own index of the shards: a pickle, opened only by the worker's restricted reader
MAX_RANKS = 1 << 20
# Every name a rank of ours writes into a sharded checkpoint directory (and their temporaries).
_OURS = re.compile(r"^(__\d{1,9}_\d{1,9}\.distcp|\.metadata|rank_\d{1,9}\.(pt|json)|MANIFEST\.json)$", re.ASCII)
_TEMPORARY = re.compile(r"^(\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp|\.metadata\.tmp)$", re.ASCII)
_HEX8 = re.compile(r"^[0-9a-f]{8}$", re.ASCII)
# A framework's file: a relative path of at most two plain names (Lightning's FSDP save is a directory of shards).
_FRAMEWORK_PART = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.=+-]{1,200}$", re.ASCII)


class ManifestError(ValueError):
    """A manifest or rank record that is not what this module writes."""


def rank_state_name(rank: int) -> str:
    return f"rank_{rank}.pt"


def rank_record_name(rank: int) -> str:
    return f"rank_{rank}.json"


def is_our_file(name: str) -> bool:
    """A name one of our ranks writes into a sharded checkpoint directory, or its temporary."""
    temporary = _TEMPORARY.match(name)
    return bool(_OURS.match(name) or (temporary and (temporary["name"] is None or _OURS.match(temporary["name"]))))


def build_manifest(
    step: int, records: list[dict[str, Any]], *, torch_version: str, common: dict[str, Any], format: str = FORMAT
) -> dict[str, Any]:
    """Rank 0's manifest from every rank's record (rank order); ManifestError if a record is not one of ours."""
    files: dict[str, Any] = {}
    ranks = []
    for rank, record in enumerate(records):
        checked = _record(record, rank, format)
        for name, entry in checked["files"].items():
            files[name] = {**entry, "rank": rank}
        ranks.append({"rank": rank, "is_health": checked["is_health"], "health_reasons": checked["health_reasons"]})
    _files(files, format)
    return {
        "format": format,
        "version": VERSION,
        "step": step,
        "world_size": len(records),
        "torch": torch_version,
        **common,
        "files": files,
        "ranks": ranks,
        "is_health": int(any(r["is_health"] for r in ranks)),
    }


def _record(record: Any, rank: int, format: str) -> dict[str, Any]:
    if not isinstance(record, dict) or record.get("rank") != rank:
        raise ManifestError(f"rank {rank}'s record is not one of ours")
    if format == FORMAT or record.get("files") != {}:  # a framework's rank may have no share of its files
        _files(record.get("files"), format)
    if record.get("is_health") not in (0, 1) or not isinstance(record.get("health_reasons"), list):
        raise ManifestError(f"rank {rank}'s record has no health")
    return record


def _files(files: Any, format: str = FORMAT) -> dict[str, Any]:
    if not isinstance(files, dict) or not files:
        raise ManifestError("'files' is not a mapping of file names")
    for name, entry in files.items():
        if not (
            framework_name(name)
            if format == FRAMEWORK_FORMAT
            else is_our_file(name) and (not name.startswith(".") or name == METADATA)
        ):
            raise ManifestError(f"lists {name[:80]!r}, not a file name of ours")
        if (
            not isinstance(entry, dict)
            or type(entry.get("size")) is not int
            or entry["size"] < 0
            or not isinstance(entry.get("crc32"), str)
            or not _HEX8.match(entry["crc32"])
        ):
            raise ManifestError(f"the entry of {name} has no size and CRC-32")
    return files


def framework_name(name: str) -> bool:
    """A file a framework wrote into its checkpoint directory: one or two plain names, none of ours."""
    parts = name.split("/")
    return len(parts) <= 2 and all(_FRAMEWORK_PART.match(part) for part in parts) and not is_our_file(parts[0])


def read_manifest(directory: Path, step: int | None = None, *, format: str | None = FORMAT) -> dict[str, Any]:
    """The manifest of a checkpoint directory (sharded, a framework's, or either for `format=None`), checked for every
    field resume relies on; OSError (missing, a symlink, too big) or ValueError (not strict JSON, not ours, another
    step) naming the problem."""
    manifest = read_json(directory / MANIFEST)
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found not in (FORMAT, FRAMEWORK_FORMAT) or format is not None and found != format:
        raise ManifestError(f"not a {format or FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ManifestError(f"manifest version {str(manifest.get('version'))[:20]}, this trainwarden reads {VERSION}")
    world = manifest.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_RANKS:
        raise ManifestError(f"'world_size' is {str(world)[:20]!r}")
    if step is not None and manifest.get("step") != step:
        raise ManifestError(f"the manifest is of step {str(manifest.get('step'))[:20]}, the directory of {step}")
    files = _files(manifest.get("files"), found)
    if found == FRAMEWORK_FORMAT and not isinstance(manifest.get("framework"), str):
        raise ManifestError("the manifest does not name its framework")
    if found == FORMAT and (METADATA not in files or any(rank_state_name(rank) not in files for rank in range(world))):
        raise ManifestError("the manifest lacks DCP's .metadata or a rank's state")
    ranks = manifest.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world or not all(isinstance(r, dict) for r in ranks):
        raise ManifestError("'ranks' does not list every rank")
    return manifest


def manifest_problem(directory: Path, step: int, *, require_healthy: bool, verify: bool = True) -> str | None:
    """Why the sharded checkpoint in `directory` must not be resumed (None: it may). `verify` reads every listed
    file for its checksum; without it sizes are compared only."""
    try:
        manifest = read_manifest(directory, step, format=None)
    except FileNotFoundError:
        return "incomplete: no manifest (a save in flight, or killed before every rank was done)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    for name, entry in manifest["files"].items():
        nested = "/" in name and not is_plain_dir(directory / name.split("/")[0])  # a symlink is followed nowhere
        problem = "not a plain directory" if nested else file_problem(directory / name, entry, verify=verify)
        if problem:
            return f"{problem} (rank {entry.get('rank', '?')}'s {name})"
    if require_healthy and manifest.get("is_health", 0) != 0:
        unhealthy = [r for r in manifest["ranks"] if r.get("is_health", 0) != 0]
        reasons = ", ".join(str(reason)[:200] for r in unhealthy for reason in (r.get("health_reasons") or [])[:10])
        return f"unhealthy on rank {unhealthy[0].get('rank') if unhealthy else '?'}: {reasons or 'tagged unhealthy'}"
    return None


def file_problem(path: Path, entry: dict[str, Any], *, verify: bool = True) -> str | None:
    """A listed file missing, of another size, or (verify) with another checksum; None when it matches."""
    try:
        if not verify:
            info = os.lstat(path)
            size = info.st_size if stat.S_ISREG(info.st_mode) else -1
            return None if size == entry["size"] else f"size {size}, {entry['size']} written"
        size, crc = file_crc32(path, limit=entry["size"])
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if size != entry["size"]:
        return f"truncated: {size} bytes, {entry['size']} written"
    return None if crc == entry["crc32"] else "corrupted: checksum differs from the one written"


def remove_sharded(directory: Path) -> list[str]:
    """Delete a checkpoint directory: manifest first (a kill leaves junk, not a lie), then our files and those the
    manifest lists (a framework's), then the directory if empty. Other names are left in place and returned."""
    try:
        listed = set(read_manifest(directory, format=None)["files"])
    except (OSError, ValueError):
        listed = set()
    unlink_quietly(directory / MANIFEST)
    for name in sorted(n for n in listed if "/" in n):
        if is_plain_dir(directory / name.split("/")[0]) and is_plain_file(directory / name):
            unlink_quietly(directory / name)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    left = []
    for name in names:
        if (is_our_file(name) or name in listed) and is_plain_file(directory / name):
            unlink_quietly(directory / name)
        elif not (is_plain_dir(directory / name) and _removed_if_empty(directory / name)):
            left.append(name)
    if not left:
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    return left


def _removed_if_empty(directory: Path) -> bool:
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True
