"""A rate limit for copies made beside a training job: the persister's writes to disk average at most a set number
of bytes per second (`worker.persist_mb_s`), so a persist does not take the disk's bandwidth from the job's own I/O.

Pure pacing: the clock and the way to wait are arguments (a stop event's `wait` lifts the limit at once, as at a
run's end, when no rank trains any more).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["MB", "Throttle"]

MB = 1_000_000  # `persist_mb_s` counts in megabytes, as disks' bandwidth is quoted


class Throttle:
    """Paces one copy: after each chunk, `sent` waits until the bytes so far average at most `bytes_per_s` since
    the copy began; 0 (or less) means no limit."""

    def __init__(
        self,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] = time.sleep,
    ) -> None:
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._wait = wait
        self._began = clock()
        self._bytes = 0

    def sent(self, count: int) -> float:
        """Count `count` bytes copied, then wait while the copy is ahead of its rate; the seconds waited for."""
        self._bytes += count
        if self.bytes_per_s <= 0:
            return 0.0
        ahead_s = self._began + self._bytes / self.bytes_per_s - self._clock()
        if ahead_s <= 0:
            return 0.0
        self._wait(ahead_s)
        return ahead_s
