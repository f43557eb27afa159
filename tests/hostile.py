"""Hostile files for tests: what a broken or malicious process may leave where a run-dir file goes, and a
bounded call that fails the test if a reader blocks on one."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["KINDS", "bounded", "plant"]

KINDS = ["fifo", "directory", "symlink to /dev/zero", "symlink outside", "huge", "character device"]


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put a hostile `kind` of file at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink outside":
        (outside / "secret").write_text('{"step": 1}')
        path.symlink_to(outside / "secret")
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(3 << 30)  # 3 GB, sparse: a reader without a cap would take it all in
    else:
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers


def bounded(call: Callable[[], Any], timeout: float = 5.0) -> Any:
    """What `call()` returns or raises, failing the test if it takes longer than `timeout` (it blocked)."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(("returned", call()))
        except BaseException as exc:  # noqa: BLE001 - the test judges what escaped
            outcome.append(("raised", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for more than {timeout} s"
    return outcome[0]
