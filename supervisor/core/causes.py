"""Why a rank failed, in one line: read from the tail of its stderr and its exit status (pure: no files).

The stderr is the rank's to write, so nothing in it is trusted: only its tail is looked at, every line
is cut short and stripped of control characters, and a part that cannot be parsed is simply not used.

What is recognised, in this order:
- a collective that failed, said near the end (gloo's "Received data size doesn't match expected size", a peer's
  connection reset, NCCL's watchdog timeout), whether the rank raised or aborted: `collective failed: ...`
  (`desync: ...` for a mismatch); the culprit is then found from every rank's flight recorder;
- NCCL saying it is used wrongly (`invalid usage`, `ncclInvalidUsage`, "Duplicate GPU detected": two ranks on one
  GPU), whether the rank raised or aborted: `NCCL invalid usage: ...`, a config error, not retryable;
- killed by a signal: `killed by SIGKILL`, plus `(out of memory: ...)` when the caller saw the kernel's
  OOM killer strike (the stderr of a killed process says nothing about who killed it);
- exit 78 (the rank's settings are invalid): `exited with code 78: <its last line>`, not retryable;
- a Python traceback near the end (one followed by more than TRAILING_LINES lines was printed and survived):
  the final exception line and the innermost frame of the user's code (not the standard library,
  site-packages, torch or trainwarden's worker package), `ValueError: boom (train.py:12 in step)`;
  within it "No space left on device" (errno 28) makes it `disk full: ...`, and a `load_state_dict`
  mismatch makes it `checkpoint incompatible with the model: ...`, not retryable;
- otherwise `exited with code N`, with the last line the rank wrote (`disk full: ...` if it says so).
"""

from __future__ import annotations

import re
import signal
import sysconfig
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath

import worker.contract
from worker.contract import EXIT_CONFIG

__all__ = [
    "LIBRARY_DIRS",
    "MAX_CAUSE_CHARS",
    "Cause",
    "poisons_context",
    "CauseKind",
    "explain",
    "explain_exit",
    "oom_kill_count",
]

MAX_CAUSE_CHARS = 300  # one line in a terminal, a journal record and `status`
MAX_MESSAGE_CHARS = 200  # of an exception message or a line the rank wrote
TRACEBACK = "Traceback (most recent call last):"
TRAILING_LINES = 10  # lines a dying interpreter may still print after its traceback (teardown warnings)
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
DISK_FULL_MARKS = ("No space left on device", "[Errno 28]")
# A collective that failed: ranks disagreed on it (a desync), or a peer went away or timed out inside it.
DESYNC_MARKS = (
    "Received data size doesn't match expected size",
    "collective mismatch",
    "Detected mismatch between collectives",
)
COLLECTIVE_MARKS = (
    *DESYNC_MARKS,
    "Connection reset by peer",
    "Connection closed by peer",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)
# NCCL refusing how it is used: the job's setup is wrong (two ranks given one GPU), the same at every relaunch.
NCCL_MISUSE_MARKS = ("Duplicate GPU detected", "ncclInvalidUsage")
NCCL_MISUSE_LINES = 80  # torch prints C++ frames ("frame #12: ...") after NCCL's message
STATE_DICT_MARKS = (
    "Error(s) in loading state_dict",
    "size mismatch for",
    "Missing key(s) in state_dict",
    "Unexpected key(s) in state_dict",
)
_RANK_PREFIX = re.compile(r"^\[rank\d{1,9}\]: ?")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>\S.*)$')
# Frames that are not the user's code: the standard library, installed packages, trainwarden's worker library.
LIBRARY_DIRS: tuple[str, ...] = tuple(
    dict.fromkeys(
        str(Path(p))
        for p in (
            sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["platstdlib"],
            Path(worker.contract.__file__).parent,
        )
    )
)


class CauseKind(Enum):
    """What kind of failure a cause is; it decides whether a relaunch can help and what counts as a repeat."""

    EXCEPTION = "exception"  # a Python traceback
    EXIT = "exit"  # a non-zero exit without a traceback
    SIGNAL = "signal"  # killed by a signal, from who knows where (an operator's kill -9 included)
    OOM = "oom"  # killed while the kernel's OOM killer struck in the ranks' cgroup
    DISK_FULL = "disk_full"
    CHECKPOINT_INCOMPATIBLE = "checkpoint_incompatible"  # the model does not match the checkpoint it loads
    CONFIG = "config"  # the rank's settings are invalid (its exit 78, or NCCL's invalid usage)
    HANG = "hang"
    ANOMALY = "anomaly"  # an anomaly abort (exit 65): rolled back, bounded by anomaly.max_tries
    CHECKPOINT_REFUSED = "checkpoint_refused"  # exit 66: relaunched from an older checkpoint
    NODE_LOST = "node_lost"  # its node went silent or its node agent died: relaunched without that node
    COLLECTIVE = "collective"  # a collective failed (a desync, a peer gone): the flight recorders name the culprit
    BAD_DEVICE = "bad_device"  # a rank's device corrupts results (supervisor.core.devices): relaunched without it
    LAUNCH = "launch"  # the ranks could not be started, for a reason that may pass (Slurm could not create the step)


# A repeat of these at the same step is the script failing the same way: a crash loop.
_REPEATABLE = {CauseKind.EXCEPTION, CauseKind.EXIT, CauseKind.OOM, CauseKind.DISK_FULL, CauseKind.COLLECTIVE}
# These count toward "no progress" too: a kill or a hang before any step past the resume point.
_BREAKABLE = _REPEATABLE | {CauseKind.SIGNAL, CauseKind.HANG, CauseKind.LAUNCH}
_NOT_RETRYABLE = {CauseKind.CHECKPOINT_INCOMPATIBLE, CauseKind.CONFIG}


@dataclass(frozen=True)
class Cause:
    """Why an attempt failed: one line for people (`text`), and what must match for two to be the same (`key`)."""

    kind: CauseKind
    text: str
    key: str = ""  # `text` without what varies from one attempt to the next (a temporary file's name)

    @property
    def retryable(self) -> bool:
        """Whether a relaunch can possibly succeed."""
        return self.kind not in _NOT_RETRYABLE

    @property
    def repeatable(self) -> bool:
        """Whether the same cause at the same step again means the script fails the same way every time."""
        return self.kind in _REPEATABLE

    @property
    def breakable(self) -> bool:
        """Whether it counts toward the crash-loop breaker's no-progress rule."""
        return self.kind in _BREAKABLE

    @property
    def same_as(self) -> str:
        """What two causes must share to be the same failure."""
        return self.key or self.text


def explain(
    stderr_tail: bytes, returncode: int, *, oom_killed: bool = False, library_dirs: tuple[str, ...] = LIBRARY_DIRS
) -> Cause:
    """The cause of a rank's non-zero exit, from the tail of its stderr and its returncode (negative: a signal)."""
    lines = _clean_lines(stderr_tail)
    aborted_or_exited = returncode > 0 and returncode != EXIT_CONFIG or returncode == -signal.SIGABRT
    if aborted_or_exited and (misuse := _nccl_misuse(lines, returncode)):
        return misuse
    if aborted_or_exited and (failed := _collective_failure(lines, returncode)):
        return failed
    if returncode < 0:
        return _signal_cause(-returncode, oom_killed)
    if returncode == EXIT_CONFIG:
        return _exit_cause(returncode, lines, CauseKind.CONFIG)
    chain = _last_traceback_chain(lines)
    if chain:
        return _traceback_cause(chain, library_dirs)
    return _exit_cause(returncode, lines, CauseKind.EXIT)


# A CUDA error can leave the device's context unusable, and every rank's communicator with it (worker.recovery).
_CUDA_WORDS = ("CUDA error", "cudaError", "AcceleratorError", "device-side assert", "CUDA-capable device")


def poisons_context(cause: Cause) -> bool:
    """The failure is a CUDA error: no process of the attempt restarts in place on its context."""
    return any(word in cause.text for word in _CUDA_WORDS)


def explain_exit(returncode: int) -> Cause:
    """The cause when nothing else is known: the exit code or the signal."""
    return explain(b"", returncode)


def oom_kill_count(text: str) -> int | None:
    """The `oom_kill N` counter of a cgroup's memory.events (v2) or memory.oom_control (v1), if it has one."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _collective_failure(lines: list[str], returncode: int) -> Cause | None:
    """A collective failed on this rank, as its last lines say (a rank killed from outside says nothing of it)."""
    said = [line.strip() for line in lines[-40:] if line.strip()]
    line = next((line for line in reversed(said) if any(mark in line for mark in COLLECTIVE_MARKS)), None)
    if line is None:
        return None
    mark = next(mark for mark in COLLECTIVE_MARKS if mark in line)
    kind = "desync" if mark in DESYNC_MARKS else "collective failed"
    line = line[line.index(mark) :] if mark in DESYNC_MARKS else line  # gloo's enforce text before it says nothing
    how = _signal_cause(-returncode, False).text if returncode < 0 else f"exited with code {returncode}"
    return Cause(CauseKind.COLLECTIVE, _cap(f"{kind}: {_brief(line)} ({how})"), f"{kind} ({how})")


def _nccl_misuse(lines: list[str], returncode: int) -> Cause | None:
    """NCCL refused how it was used, as the rank's last lines say: its most telling line (the duplicate GPU, else
    what follows NCCL's "Last error:", else the error itself)."""
    said = [line.strip() for line in lines[-NCCL_MISUSE_LINES:] if line.strip()]
    hits = [i for i, line in enumerate(said) if _is_nccl_misuse(line)]
    if not hits:
        return None
    duplicate = next((line for line in reversed(said) if NCCL_MISUSE_MARKS[0] in line), None)
    if duplicate is not None:
        line = duplicate[duplicate.index(NCCL_MISUSE_MARKS[0]) :]  # without NCCL's "host:pid:tid [0] init.cc:497"
    else:
        after = [i + 1 for i in range(hits[0], len(said) - 1) if said[i] == "Last error:"]
        line = said[after[-1]] if after else said[hits[-1]]
    how = _signal_cause(-returncode, False).text if returncode < 0 else f"exited with code {returncode}"
    return Cause(CauseKind.CONFIG, _cap(f"NCCL invalid usage: {_brief(line)} ({how})"), f"NCCL invalid usage ({how})")


def _is_nccl_misuse(line: str) -> bool:
    return any(mark in line for mark in NCCL_MISUSE_MARKS) or ("NCCL" in line and "invalid usage" in line)


def _signal_cause(signum: int, oom_killed: bool) -> Cause:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if oom_killed and signum == signal.SIGKILL:
        return Cause(
            CauseKind.OOM, f"killed by {name} (out of memory: the kernel's OOM killer struck during the attempt)"
        )
    return Cause(CauseKind.SIGNAL, f"killed by {name}")


def _exit_cause(returncode: int, lines: list[str], kind: CauseKind) -> Cause:
    said = [line.strip() for line in lines if line.strip()]
    last = _brief(said[-1]) if said else ""
    base = f"exited with code {returncode}"
    if kind is CauseKind.EXIT and said and any(mark in line for line in said[-5:] for mark in DISK_FULL_MARKS):
        full = next(line for line in reversed(said[-5:]) if any(mark in line for mark in DISK_FULL_MARKS))
        return Cause(CauseKind.DISK_FULL, _cap(f"disk full: {_brief(full)} ({base})"), f"disk full ({base})")
    return Cause(kind, _cap(f"{base}: {last}" if last else base))


def _last_traceback_chain(lines: list[str]) -> list[str]:
    """The last traceback, with the tracebacks chained before it ('During handling ...'), to the end of its
    exception message; none if the rank wrote more than TRAILING_LINES lines after it (it survived that one)."""
    headers = [i for i, line in enumerate(lines) if line.rstrip().endswith(TRACEBACK)]
    if not headers:
        return []
    end = _message_end(lines, headers[-1])
    if sum(1 for line in lines[end:] if line.strip()) > TRAILING_LINES:
        return []
    start = headers[-1]
    for header in reversed(headers[:-1]):
        between = [line.strip() for line in lines[header:start] if line.strip()]
        if not between or between[-1] not in CHAINED:
            break
        start = header
    return lines[start:end]


def _message_end(lines: list[str], header: int) -> int:
    """The index just past the exception message (its first unindented line and indented details) after `header`."""
    for i in range(header + 1, len(lines)):
        if lines[i].strip() and not lines[i][0].isspace():
            end = i + 1
            while end < len(lines) and lines[end].strip() and lines[end][0].isspace():
                end += 1
            return end
    return len(lines)


def _traceback_cause(chain: list[str], library_dirs: tuple[str, ...]) -> Cause:
    last = max(i for i, line in enumerate(chain) if line.rstrip().endswith(TRACEBACK))
    message = _exception_line(chain[last + 1 :])
    frame = _user_frame(chain[last:], library_dirs) or _user_frame(chain, library_dirs)
    where = f" ({frame})" if frame else ""
    exc_type = message.partition(":")[0].strip()
    if full := next((line.strip() for line in chain if any(mark in line for mark in DISK_FULL_MARKS)), None):
        return Cause(CauseKind.DISK_FULL, _cap(f"disk full: {_brief(full)}{where}"), f"disk full{where}")
    if any(mark in line for line in chain for mark in STATE_DICT_MARKS):
        return Cause(
            CauseKind.CHECKPOINT_INCOMPATIBLE, _cap(f"checkpoint incompatible with the model: {message}{where}")
        )
    key = f"{exc_type}{where}" if frame else message  # the message may vary (sizes, names); type and line do not
    return Cause(CauseKind.EXCEPTION, _cap(f"{message}{where}"), key)


def _exception_line(after_header: list[str]) -> str:
    """`ValueError: boom`: the first unindented line after the frames; a message ending in ':' gets its next line."""
    for i, line in enumerate(after_header):
        if not line.strip() or line[0].isspace() or _FRAME.match(line):
            continue
        message = _brief(line.strip())
        detail = after_header[i + 1].strip() if i + 1 < len(after_header) else ""
        return _brief(f"{message} {detail}") if message.endswith(":") and detail else message
    return "a Python exception (its message was cut off)"


def _user_frame(lines: list[str], library_dirs: tuple[str, ...]) -> str | None:
    """`train.py:12 in step`: the innermost frame whose file is the user's code."""
    frames = [m for line in lines if (m := _FRAME.match(line))]
    for match in reversed(frames):
        file = match["file"]
        if not _is_library(file, library_dirs):
            return _brief(f"{PurePosixPath(file).name or file}:{match['line']} in {match['func'].strip()}")
    return None


def _is_library(file: str, library_dirs: tuple[str, ...]) -> bool:
    if file.startswith("<frozen"):
        return True
    parts = PurePosixPath(file).parts
    if "site-packages" in parts or "dist-packages" in parts or "torch" in parts[:-1]:
        return True
    return any(file == d or file.startswith(d.rstrip("/") + "/") for d in library_dirs)


def _clean_lines(data: bytes) -> list[str]:
    """Lines of untrusted bytes, decoded leniently (a carriage return, as progress bars write, ends a line too),
    without the `[rank0]: ` that torch.distributed puts before every line of an uncaught exception."""
    text = data.decode("utf-8", errors="replace").replace("\r", "\n")
    return [_RANK_PREFIX.sub("", line, count=1) for line in text.split("\n")]


def _brief(text: str) -> str:
    """One printable line of at most MAX_MESSAGE_CHARS."""
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _cap(text: str) -> str:
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."
