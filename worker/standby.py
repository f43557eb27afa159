"""A warm standby rank: Python started and the heavy modules imported before a relaunch needs a rank.

The supervisor spawns one per local rank while an attempt trains (`python -u -m worker.standby`), with that
rank's environment less what only an attempt knows (its number, port and resume point). The standby imports
the modules it is told to (`TRAINWARDEN_PREWARM`), says it is ready on its socket (`TRAINWARDEN_STANDBY_FD`), and
waits. At a relaunch the supervisor sends the attempt's environment, the script's argv and the rank's two log
files (as descriptors); the standby takes them over and runs the script as `__main__`, as `python -u script.py`
would. When the supervisor closes the socket instead, the standby exits 0.

`TRAINWARDEN_PREWARM` is `auto` or comma-separated module names. `auto`: torch and torch._dynamo (which
DistributedDataParallel imports when first built), and the script's own top-level
`import`s of modules that live outside the script's folder (the standard library and installed packages: not
the project's own modules, whose import may act on the attempt's environment). A module that fails to import
is reported in the standby's log and left to the script, which then imports it itself.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import socket
import struct
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENV_PREWARM", "ENV_SCRIPT", "ENV_STANDBY_FD", "READY", "activate_message", "main", "script_imports"]

ENV_STANDBY_FD = "TRAINWARDEN_STANDBY_FD"
ENV_PREWARM = "TRAINWARDEN_PREWARM"
ENV_SCRIPT = "TRAINWARDEN_STANDBY_SCRIPT"
READY = b"R"
_ORDER = b"A"  # sent with the two log descriptors
_LENGTH = struct.Struct("!I")
MAX_ORDER_BYTES = 16 << 20  # an environment and argv are far smaller
MAX_SCRIPT_BYTES = 4 << 20  # the script is parsed for its imports only up to this size
# torch._dynamo: DistributedDataParallel and torch.compile import it at their first use, 1 s of CPU of a relaunch.
ALWAYS = ("torch", "torch._dynamo")


def activate_message(argv: list[str], env: dict[str, str]) -> bytes:
    """What follows the descriptors: the script's argv and the attempt's whole environment, length-prefixed."""
    body = json.dumps({"argv": argv, "env": env}).encode()
    return _LENGTH.pack(len(body)) + body


def script_imports(script: Path) -> list[str]:
    """Modules the script imports at its top level (also inside top-level try/if), from its text alone."""
    try:
        with open(script, "rb") as file:
            tree = ast.parse(file.read(MAX_SCRIPT_BYTES))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            names.append(node.module)
        elif isinstance(node, (ast.Try, ast.If)):
            pending += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
    return list(dict.fromkeys(names))


def _installed(name: str, script_dir: Path) -> bool:
    """The module's top-level package is found outside the script's folder (finding it imports nothing)."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    if origin in (None, "built-in", "frozen"):
        return True
    return not Path(origin).resolve().is_relative_to(script_dir)


def _prewarm_list(setting: str, script: Path) -> list[str]:
    if setting != "auto":
        return [name for name in (part.strip() for part in setting.split(",")) if name]
    script_dir = script.resolve().parent
    return list(dict.fromkeys([*ALWAYS, *(n for n in script_imports(script) if _installed(n, script_dir))]))


def _prewarm(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # the script imports it again and fails there, in its own words
            print(f"trainwarden standby: prewarm import of {name!r} failed: {exc!r}", file=sys.stderr)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The activation order, or None when the supervisor closed the socket (retired, or gone)."""
    tag, fds, _flags, _addr = socket.recv_fds(sock, 1, 2)
    if tag != _ORDER or len(fds) != 2:
        return None
    header = _read_exactly(sock, _LENGTH.size)
    size = _LENGTH.unpack(header)[0] if header is not None else MAX_ORDER_BYTES + 1
    body = _read_exactly(sock, size) if size <= MAX_ORDER_BYTES else None
    if body is None:
        return None
    return json.loads(body), fds


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _become_rank(order: dict[str, Any], fds: list[int]) -> list[str]:
    """Take over the rank's log files, environment and argv, as a freshly started `python -u script` has them."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(order["env"])
    argv = [str(arg) for arg in order["argv"]]
    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).resolve().parent)  # as Python sets it for a script
    return argv


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop(ENV_STANDBY_FD)))
    script = Path(os.environ.pop(ENV_SCRIPT))
    sys.path[0] = str(script.resolve().parent)  # find modules as the script will (`-m` put the cwd there)
    _prewarm(_prewarm_list(os.environ.pop(ENV_PREWARM, "auto"), script))
    with contextlib.suppress(OSError):  # taken while still importing: the order is already in the socket
        sock.sendall(READY)
    try:
        received = _receive(sock)
    except OSError:
        received = None
    if received is None:
        return  # retired before use
    argv = _become_rank(*received)
    sock.close()
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
