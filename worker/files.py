"""Run-dir file access a hostile file cannot abuse: bounded, non-blocking reads that refuse symlinks,
FIFOs, devices and directories; strict JSON; writes that never follow a symlink out of the run dir.

A run dir may be written by ranks, other users of a shared filesystem, or an attacker. Reading one of
its files must never block (a FIFO), read without end (a symlink to /dev/zero), or crash on odd JSON
(NaN, 1e999, 10^400, 100000 nested brackets, duplicate keys); writing one must never land outside it
(a symlinked directory). Everything here raises OSError or ValueError, which callers turn into one
warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MAX_JSON_BYTES",
    "Refused",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "ensure_dir",
    "file_crc32",
    "is_plain_dir",
    "is_plain_file",
    "open_append",
    "open_dir",
    "open_in",
    "open_regular",
    "parse_json",
    "read_bytes",
    "read_json",
    "unlink_quietly",
]

MAX_JSON_BYTES = 1 << 20  # every JSON file trainwarden writes is far smaller
MAX_INT = 2**63 - 1  # what a C long holds: anything beyond is not a step, pid or size of ours
FILE_MODE = 0o600  # control files, logs and checkpoints: the run's owner only
DIR_MODE = 0o700
_CHUNK = 1 << 20
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: opening a FIFO never waits for a writer
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A file that is not what it should be: a symlink, a FIFO, a device, a directory, or too large."""


def open_regular(path: str | Path, *, follow_symlinks: bool = False) -> int:
    """A read-only descriptor for a regular file; Refused for anything else (nothing is waited on)."""
    flags = _READ if follow_symlinks else _READ | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(errno.ELOOP, "a symbolic link (not followed)", str(path)) from None
        raise
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise Refused(errno.EINVAL, f"not a regular file ({_KINDS.get(kind, 'special file')})", str(path))
    return fd


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def read_bytes(path: str | Path, limit: int, *, follow_symlinks: bool = False) -> bytes:
    """The whole content of a regular file of at most `limit` bytes; Refused for a larger or odd one."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise Refused(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return b"".join(chunks)


def file_crc32(path: str | Path, limit: int | None = None) -> tuple[int, str]:
    """(size, CRC-32) of a regular file as the worker's HashingWriter writes it, reading at most `limit` + 1
    bytes (a file longer than its record says is not read to its end); symlinks and FIFOs are refused."""
    crc, size = 0, 0
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK if limit is None else min(_CHUNK, limit + 1 - size)):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file read bounded and parsed strictly; OSError (missing, refused) or ValueError (not strict JSON)."""
    return parse_json(read_bytes(path, limit))


def parse_json(data: bytes | str) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, finite floats, integers that fit 64 bits, no duplicate keys,
    bounded nesting; ValueError naming what is wrong otherwise."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data  # UnicodeDecodeError is a ValueError
    try:
        return json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # checked before int(): a 10^400 literal is never even converted
        raise ValueError(f"integer of {len(text)} digits is out of range")
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError(f"{text} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen.add(key)
    return dict(pairs)


def open_dir(root: Path, directory: Path, *, create: bool = True) -> int:
    """A descriptor for `directory` inside `root`, reached without following any symlink below `root`
    (created with DIR_MODE where missing); ValueError if it lies outside, Refused if a part is a symlink."""
    parts = Path(directory).relative_to(root).parts  # ValueError: outside the run dir
    if ".." in parts:
        raise ValueError(f"{directory} climbs out of {root}")
    if create:
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)  # the root itself, and above it: the user's choice
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in parts:
        try:
            child = _step_into(fd, part, create)
        finally:
            os.close(fd)
        fd = child
    return fd


def _step_into(parent: int, name: str, create: bool) -> int:
    """Open the directory `name` below `parent`, refusing a symlink."""
    try:
        try:
            return os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, DIR_MODE, dir_fd=parent)
            return os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused(exc.errno, "a symbolic link or not a directory (not followed)", name) from None
        raise


def ensure_dir(root: Path, directory: Path) -> None:
    """Create `directory` inside `root` (DIR_MODE) as open_dir does; Refused where a part is a symlink."""
    os.close(open_dir(root, directory))


@contextlib.contextmanager
def _in_dir(root: Path, directory: Path) -> Iterator[int]:
    fd = open_dir(root, directory)
    try:
        yield fd
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], object],
    *,
    root: Path,
    durable: bool = True,
    before_rename: Callable[[Path], object] | None = None,
) -> None:
    """Create `path` (inside `root`) through `write(file)` so that readers see the old or the new content,
    never a torn file. No symlink below `root` is followed, and a symlink at `path` is replaced, not
    written through. `durable=False` skips the fsyncs: still atomic for readers, not across a power cut.
    `before_rename(temporary)` is a fault-injection hook."""
    with _in_dir(root, path.parent) as dir_fd:
        tmp = f".{path.name}.{secrets.token_hex(4)}.tmp"  # the shape the supervisor knows as our temporary
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            if before_rename is not None:
                before_rename(path.parent / tmp)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)


def atomic_write_bytes(path: Path, data: bytes, *, root: Path, durable: bool = True) -> None:
    """Atomically write `data` to `path` inside `root` (see atomic_write)."""
    atomic_write(path, lambda f: f.write(data), root=root, durable=durable)


def atomic_write_json(path: Path, obj: Any, *, root: Path, durable: bool = True) -> None:
    """Atomically write `obj` as JSON (strict: NaN and Infinity are refused, so readers never see them)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode(), root=root, durable=durable)


def open_append(path: Path, *, root: Path) -> int:
    """A descriptor appending to the regular file `path` inside `root` (created FILE_MODE), following no
    symlink; Refused for a FIFO, device or directory in its place."""
    return open_in(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, root=root)


def open_in(path: Path, flags: int, *, root: Path) -> int:
    """`os.open(path, flags)` for a regular file inside `root`, reached without following any symlink,
    never blocking on a FIFO; Refused for anything but a regular file."""
    with _in_dir(root, path.parent) as dir_fd:
        try:
            fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # ENXIO: a FIFO nobody reads
                raise Refused(exc.errno, "not a regular file (not opened)", str(path)) from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(errno.EINVAL, "not a regular file (not opened)", str(path))
    os.set_blocking(fd, True)
    return fd


def is_plain_file(path: str | Path) -> bool:
    """A regular file itself, not a symlink to one (lstat): what we may read as ours or delete."""
    return _kind(path) == stat.S_IFREG


def is_plain_dir(path: str | Path) -> bool:
    """A directory itself, not a symlink to one (lstat)."""
    return _kind(path) == stat.S_IFDIR


def _kind(path: str | Path) -> int | None:
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except OSError:
        return None


def unlink_quietly(path: str | Path) -> None:
    """Remove a file (or the symlink itself) if it is there; a directory in its place is left alone."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
        os.unlink(path)
