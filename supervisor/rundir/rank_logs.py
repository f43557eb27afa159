"""Reading the newest events of a rank's JSON-lines log from its end (logs grow by a line per step); its stderr's tail.

The logs are the rank's to write, so nothing in them is trusted: the tail is read bounded from a regular
file only, lines that are not strict JSON objects are skipped, and numbers are checked before use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from supervisor.core.devices import VERDICTS, DeviceVerdict
from supervisor.core.rollback import AbortInfo
from worker.contract import RunLayout
from worker.files import open_regular, parse_json

__all__ = ["abort_info", "count", "device_verdict", "device_verdicts", "last_event", "last_step", "stderr_tail"]

TAIL_BYTES = 65536
MAX_EVIDENCE = 1000  # a verdict's evidence, as journalled
MAX_NODE = 255  # a host name


def last_event(layout: RunLayout, rank: int, attempt: int, name: str, **fields: object) -> dict[str, Any] | None:
    """The newest `name` event of `attempt` (with these `fields`) within the log's last TAIL_BYTES; torn and odd
    lines are skipped."""
    wanted = {"attempt": attempt, **fields}
    return next((e for e in _newest_first(layout, rank, name) if all(e.get(k) == v for k, v in wanted.items())), None)


def _newest_first(layout: RunLayout, rank: int, name: str) -> Iterator[dict[str, Any]]:
    """The `name` events within the log's last TAIL_BYTES, newest first; torn and odd lines are skipped."""
    try:
        fd = open_regular(layout.rank_events(rank))
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        lines = os.pread(fd, TAIL_BYTES, max(0, size - TAIL_BYTES)).splitlines()
    except OSError:
        return
    finally:
        os.close(fd)
    wanted = f'"{name}"'.encode()
    for line in reversed(lines):
        if wanted not in line:  # most lines are steps: parsed only where the name could be (a crash reads 64 KiB)
            continue
        try:
            event = parse_json(line)
        except ValueError:
            continue  # a torn first or last line, or garbage
        if isinstance(event, dict) and event.get("event") == name:
            yield event


def device_verdicts(layout: RunLayout, rank: int, verdict: str, after: int, upto: int) -> list[DeviceVerdict]:
    """The `verdict` verdicts that the rank's process counted as its `after`+1th to `upto`th (their `count`), those on
    its own device (rank 0 counts the verdicts naming no rank too), oldest first; events that do not read are
    skipped. Newest first, the log may hold later ones than the heartbeat counted, and an earlier process's below."""
    found: list[DeviceVerdict] = []
    wanted = upto - after
    for event in _newest_first(layout, rank, "sdc_verdict"):
        number = event.get("count")
        if wanted <= 0:
            break
        if event.get("verdict") != verdict or type(number) is not int or number > upto:
            continue
        wanted -= 1
        if event.get("suspect") == rank:
            with contextlib.suppress(ValueError):
                found.append(device_verdict(event))
    return found[::-1]


def device_verdict(event: dict[str, Any]) -> DeviceVerdict:
    """A rank's `sdc_verdict` event on its own device; ValueError naming what does not read."""
    node, gpu, evidence = event.get("node"), event.get("gpu"), event.get("evidence")
    if event.get("verdict") not in VERDICTS:
        raise ValueError(f"'verdict' is {str(event.get('verdict'))[:40]!r}")
    if not (node is None or (isinstance(node, str) and node.isprintable())) or not isinstance(evidence, str):
        raise ValueError("'node' or 'evidence' is not a string")
    if gpu is not None and type(gpu) is not int:
        raise ValueError(f"'gpu' is {str(gpu)[:40]!r}, not an index")
    return DeviceVerdict(
        attempt=count(event, "attempt"),
        rank=count(event, "suspect"),
        verdict=event["verdict"],
        step=count(event, "step"),
        batch=count(event, "batch"),
        evidence=evidence[:MAX_EVIDENCE],
        node=None if node is None else node[:MAX_NODE],
        gpu=gpu,
    )


def stderr_tail(layout: RunLayout, rank: int, attempt: int) -> bytes:
    """The last TAIL_BYTES of what the rank wrote to stderr in `attempt` (empty if unreadable: a symlink, a FIFO)."""
    try:
        fd = open_regular(layout.attempt_log(attempt, rank, "err"))
    except OSError:
        return b""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, TAIL_BYTES, max(0, size - TAIL_BYTES))
    except OSError:
        return b""
    finally:
        os.close(fd)


def count(event: dict[str, Any], key: str) -> int:
    """`event[key]` as a step, batch or rank number; ValueError naming the key for anything else."""
    value = event.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"{key!r} is {str(value)[:40]!r}, not a count")
    return value


def abort_info(event: dict[str, Any] | None) -> AbortInfo:
    """What a rank's `anomaly_abort` event says about its streak; ValueError if it says nothing usable."""
    if event is None:
        raise ValueError("no anomaly_abort event in its log")
    suspects = event.get("suspect_ranks") or []
    if not isinstance(suspects, list):
        raise ValueError("'suspect_ranks' is not a list")
    return AbortInfo(
        first_step=count(event, "first_anomaly_step"),
        abort_step=count(event, "step"),
        first_batch=count(event, "first_anomaly_batch"),
        abort_batch=count(event, "batch"),
        suspect_ranks=tuple(count({"rank": rank}, "rank") for rank in suspects),
    )


def last_step(layout: RunLayout, rank: int, attempt: int) -> int | None:
    """The newest step the rank logged in `attempt` (heartbeats are throttled; the event log is not)."""
    event = last_event(layout, rank, attempt, "step")
    try:
        return None if event is None else count(event, "step")
    except ValueError:
        return None
