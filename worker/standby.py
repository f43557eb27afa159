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

In a job on GPUs (`TRAINWARDEN_STANDBY_DEVICE=cuda`), a standby for local rank r then creates its CUDA context on GPU
r and initializes cuBLAS and cuBLASLt with a few small matrix products, once it said it is ready: a replacement
rank's script start-up, checkpoint load and first step are what remain of a relaunch (a standby activated while it
warms runs the script once warm). Every standby also runs one weights-only `torch.load` of a tiny buffer, so that
a replacement's resume does not import and set up torch's loader first. The fork server never touches
CUDA (a forked process could not use it); each standby forked from it does, for the local rank it is forked for.

A fork server (`python -u -m worker.standby --fork-server`) imports once and then forks a standby per request, so
refilling the pool after a relaunch costs a fork instead of every standby's own `import torch` (seconds of CPU
beside the training ranks). It forks only what is safe to fork: no Python thread started and no CUDA context made
by the imports (torch's own CUDA check is made to use NVML while they run); otherwise it says why and exits, and the
supervisor spawns standbys as above. Each standby is forked twice over, so that it is re-parented to the
supervisor (a child subreaper), which waits for it as for any rank; it leads its own session, dies with the
supervisor, and is named `tw-standby` until it runs the script.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import io
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import setproctitle

__all__ = [
    "ENV_DEVICE",
    "ENV_PREWARM",
    "ENV_SCRIPT",
    "ENV_STANDBY_FD",
    "FORK",
    "FORK_SERVER_FLAG",
    "READY",
    "REFUSED",
    "STANDBY_NAME",
    "activate_message",
    "main",
    "script_imports",
    "warm_device",
    "warm_loader",
]

ENV_STANDBY_FD = "TRAINWARDEN_STANDBY_FD"
ENV_PREWARM = "TRAINWARDEN_PREWARM"
ENV_SCRIPT = "TRAINWARDEN_STANDBY_SCRIPT"
ENV_DEVICE = "TRAINWARDEN_STANDBY_DEVICE"  # the job's `device`: cuda warms each standby's GPU
READY = b"R"
_ORDER = b"A"  # sent with the two log descriptors
FORK = b"F"  # to the fork server, with the new standby's socket and log descriptors
REFUSED = b"N"  # the fork server's answer to its own imports when forking them is unsafe, then the reason
FORK_SERVER_FLAG = "--fork-server"
STANDBY_NAME = b"tw-standby"  # the process name (`ps -o comm`) while it waits
FORK_SERVER_NAME = b"tw-fork-server"  # the fork server's
_PID = struct.Struct("!i")
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
_SETTLE_S = 5.0  # a forked standby's wait for its re-parenting (the intermediate process exits at once)
_LENGTH = struct.Struct("!I")
MAX_ORDER_BYTES = 16 << 20  # an environment and argv are far smaller
MAX_SCRIPT_BYTES = 4 << 20  # the script is parsed for its imports only up to this size
# torch._dynamo: DistributedDataParallel and torch.compile import it at their first use, 1 s of CPU of a relaunch.
ALWAYS = ("torch", "torch._dynamo")
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


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
    fds = _receive_fds(sock, _ORDER)
    if fds is None:
        return None
    header = _read_exactly(sock, _LENGTH.size)
    size = _LENGTH.unpack(header)[0] if header is not None else MAX_ORDER_BYTES + 1
    body = _read_exactly(sock, size) if size <= MAX_ORDER_BYTES else None
    if body is None:
        return None
    return json.loads(body), fds


def _receive_fds(sock: socket.socket, tag: bytes) -> list[int] | None:
    """Two descriptors sent with `tag`, or None at the end of the stream (any stray descriptor closed)."""
    got, fds, _flags, _addr = socket.recv_fds(sock, 1, 2)
    if got == tag and len(fds) == 2:
        return fds
    for fd in fds:
        os.close(fd)
    return None


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _look_like_a_rank(argv: list[str]) -> None:
    """The command line and name `ps` shows, as a rank started cold has them (`python -u script ARGS`, `python`),
    not the standby's (or its fork server's)."""
    setproctitle.setproctitle(" ".join([sys.executable, "-u", *argv]))
    _set_name(Path(sys.executable).name.encode())  # setproctitle named it after the title


def _set_name(name: bytes) -> None:
    """This process's name, as `ps -o comm` shows it (the kernel keeps 15 bytes)."""
    ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


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


def _unforkable() -> str | None:
    """Why a fork of this process after its imports would not be a sound standby, or None."""
    if threading.active_count() > 1:
        return f"the imports started Python threads: {[t.name for t in threading.enumerate()][1:]}"
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the imports initialized CUDA, which a forked process cannot use"
    return None


def _serve_forks(server: socket.socket) -> tuple[socket.socket, int] | None:
    """Fork a standby per request until the supervisor closes the socket (None); in a forked standby, its socket and
    the local rank it stands by for."""
    supervisor = os.getppid()
    while True:
        try:
            fds = _receive_fds(server, FORK)
            rank = _read_exactly(server, _PID.size) if fds is not None else None
        except OSError:
            fds = rank = None
        if fds is None or rank is None:
            return None
        standby = _fork_standby(server, supervisor, fds)
        if standby is not None:
            return standby, _PID.unpack(rank)[0]


def _fork_standby(server: socket.socket, supervisor: int, fds: list[int]) -> socket.socket | None:
    """Fork twice (the middle process exits at once, so the standby is re-parented to the supervisor, a child
    subreaper) and answer the standby's pid, or -1; in the standby, return its socket."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        me = os.getpid()
        try:
            standby = os.fork()
            if standby == 0:
                os.close(read_end)
                os.close(write_end)
                server.close()
                return _settle(me, supervisor, fds)
            os.write(write_end, _PID.pack(standby))
        finally:
            if os.getpid() == me:
                os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read(_PID.size)
    os.waitpid(middle, 0)  # reaped: the standby's re-parenting is done
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        server.sendall(answer if len(answer) == _PID.size else _PID.pack(-1))
    return None


def _settle(middle: int, supervisor: int, fds: list[int]) -> socket.socket:
    """The forked standby: its own session and log, re-parented to the supervisor and dying with it, its own seeds."""
    os.setsid()
    _set_name(STANDBY_NAME)  # at once: no longer the fork server
    sock, log = socket.socket(fileno=fds[0]), fds[1]
    for target in (1, 2):
        os.dup2(log, target)
    os.close(log)
    deadline = time.monotonic() + _SETTLE_S
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0005)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != supervisor:  # its supervisor is gone (or never adopted it): no standby of nobody
        os._exit(1)
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()  # as a fresh process seeds it (Python reseeds `random` at a fork itself)
    return sock


def warm_device(device: str | None, local_rank: int) -> str | None:
    """On a GPU job, the CUDA context on this local rank's GPU, and cuBLAS and cuBLASLt initialized (they start
    lazily, at the first product); what was done, in one line. None where the job runs on CPUs."""
    if device != "cuda":
        return None
    torch = importlib.import_module("torch")
    if not torch.cuda.is_available():
        return "no CUDA device is visible: nothing warmed"
    started = time.perf_counter()
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.ones(64, 64, device=f"cuda:{index}", dtype=dtype)
        torch.mm(a, a)  # cuBLAS
        torch.nn.functional.linear(a, a, a[0])  # a 1-D bias: cuBLASLt's epilogue
    torch.cuda.synchronize()
    return f"CUDA context on cuda:{index}, cuBLAS and cuBLASLt warmed in {time.perf_counter() - started:.2f} s"


def warm_loader() -> None:
    """torch.load's weights-only path imported and run once (a few ms at a replacement's first load, on its way back
    to training: it resumes at once); nothing where torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with contextlib.suppress(Exception):  # a warm-up, never a reason for a standby to fail
        buffer = io.BytesIO()
        torch.save({"step": 0, "tensor": torch.zeros(1), "plain": [1, (2.0, None)]}, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)


def _imported(script: Path) -> None:
    sys.path[0] = str(script.resolve().parent)  # find modules as the script will (`-m` put the cwd there)
    nvml_check = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"  # an import asking torch.cuda.is_available() must not initialize CUDA
    try:
        _prewarm(_prewarm_list(os.environ.pop(ENV_PREWARM, "auto"), script))
    finally:
        if nvml_check is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = nvml_check


def main() -> None:
    setproctitle.getproctitle()  # first: it claims the environment's memory for a longer title while it is untouched
    sock = socket.socket(fileno=int(os.environ.pop(ENV_STANDBY_FD)))
    script = Path(os.environ.pop(ENV_SCRIPT))
    if FORK_SERVER_FLAG in sys.argv:
        _set_name(FORK_SERVER_NAME)
    _imported(script)
    if FORK_SERVER_FLAG in sys.argv:
        if why := _unforkable():
            with contextlib.suppress(OSError):
                sock.sendall(REFUSED + why.encode()[:1000])
            return
        sock.sendall(READY)
        forked = _serve_forks(sock)
        if forked is None:
            return
        sock, local_rank = forked  # in a forked standby from here on
    else:
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    with contextlib.suppress(OSError):  # taken while still importing: the order is already in the socket
        sock.sendall(READY)
    # After READY (a fork's caller waits for it): an order that comes meanwhile waits in the socket until warm.
    if said := warm_device(os.environ.get(ENV_DEVICE), local_rank):
        print(f"trainwarden standby: {said}", file=sys.stderr, flush=True)
    warm_loader()
    try:
        received = _receive(sock)
    except OSError:
        received = None
    if received is None:
        return  # retired before use
    argv = _become_rank(*received)
    sock.close()
    _look_like_a_rank(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
