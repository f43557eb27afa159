"""systemd's notify protocol, written by hand, and what the supervisor tells systemd about its run.

`Notifier` speaks sd_notify(3): newline-separated `KEY=VALUE` lines in one datagram to the AF_UNIX
socket named by `NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace). Without that variable
every method does nothing, so the foreground `trainwarden run` is unaffected. A failed send is logged
once and never raised: systemd being unreachable must not stop supervision.

`ServiceReporter` turns the supervisor's `State` into messages, called from the main loop only:
READY=1 once the first attempt's ranks are launched, STATUS= whenever the one-line summary changes,
WATCHDOG=1 every half `WATCHDOG_USEC` (so a wedged loop stops pinging and systemd restarts it),
STOPPING=1 when the supervisor's own final stop begins, and EXTEND_TIMEOUT_USEC= while a rank saves
during that stop (so systemd's stop timeout does not cut a checkpoint in half).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from typing import Any

from supervisor.core import Phase, State, StopStage, Then, saving, stopping_on_request

__all__ = ["SEND_TIMEOUT_S", "Notifier", "ServiceReporter", "status_line", "stop_extension_s"]

SEND_TIMEOUT_S = 1.0  # a full socket queue (PID 1 busy) may delay the loop this long, never longer


class Notifier:
    """Sends sd_notify messages to `address` (None: do nothing)."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: str | None = None,
        watchdog_pid: str | None = None,
        pid: int | None = None,
        log: Any = None,
    ) -> None:
        self.address = _socket_address(address)
        self._watchdog_interval_s = _watchdog_interval(watchdog_usec, watchdog_pid, os.getpid() if pid is None else pid)
        self._log = log
        self._sock: socket.socket | None = None
        self._failed = False
        if address and self.address is None:
            self._warn_once(address, "unsupported NOTIFY_SOCKET address (not an absolute path or @abstract)")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *, log: Any = None) -> Notifier:
        """A notifier for the socket and watchdog systemd gave this process (none when run by hand)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=env.get("WATCHDOG_USEC"),
            watchdog_pid=env.get("WATCHDOG_PID"),
            log=log,
        )

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the timeout, as systemd advises), or None if not asked for."""
        return self._watchdog_interval_s if self.enabled else None

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *_status_field(status))

    def status(self, text: str) -> bool:
        return self.send(*_status_field(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status_field(status))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd to wait `seconds` more (from now) for the current start or stop to complete."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")

    def send(self, *fields: str) -> bool:
        """Send `fields` as one datagram; True when it was handed to the socket."""
        if self.address is None or not fields:
            return False
        try:
            self._socket().sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            self._warn_once(self.address, str(exc))
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # not inherited by ranks (PEP 446)
            self._sock.settimeout(SEND_TIMEOUT_S)
        return self._sock

    def _warn_once(self, address: str, error: str) -> None:
        if self._failed:
            return
        self._failed = True
        if self._log is not None:
            self._log.warning("systemd_notify_failed", socket=address.replace("\0", "@"), error=error)


def _socket_address(address: str | None) -> str | None:
    """The sendto() address: an absolute path as is, `@name` as the abstract name `\\0name`."""
    if not address:
        return None
    if address.startswith("@") and len(address) > 1:
        return "\0" + address[1:]
    return address if address.startswith("/") else None


def _watchdog_interval(usec: str | None, for_pid: str | None, pid: int) -> float | None:
    """Half of WATCHDOG_USEC in seconds, when it is set, valid and (per WATCHDOG_PID) meant for `pid`."""
    try:
        timeout_us = int(usec) if usec else 0
        if for_pid and int(for_pid) != pid:
            return None
    except ValueError:
        return None
    return timeout_us / 2 / 1_000_000 if timeout_us > 0 else None


def _status_field(text: str | None) -> list[str]:
    return [] if text is None else ["STATUS=" + " ".join(text.split())]  # one line: a newline would end the field


class ServiceReporter:
    """Tells systemd, through a `Notifier`, what the supervisor's main loop is doing."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self._ready = False
        self._stopping = False
        self._last_status: str | None = None
        self._next_ping = 0.0

    def next_ping(self) -> float:
        """Monotonic time the loop must wake by to ping the watchdog (inf when there is no watchdog)."""
        return self._next_ping if self.notifier.watchdog_interval() is not None else math.inf

    def observe(self, state: State, now: float, *, launched: bool) -> None:
        """Report `state`; `launched`: ranks have been started at least once. Call from the main loop only."""
        if not self.notifier.enabled:
            return
        self._report_status(state, launched)
        self._extend_stop(state, now)
        self._ping(now)

    def _report_status(self, state: State, launched: bool) -> None:
        """STATUS= when the line changes; READY=1 and STOPPING=1 ride along the first time each applies."""
        line = status_line(state)
        flags = []
        if launched and not self._ready:
            self._ready = True
            flags.append("READY=1")
        if _final_stop(state) and not self._stopping:
            self._stopping = True
            flags.append("STOPPING=1")
        if flags or line != self._last_status:
            self._last_status = line
            self.notifier.send(*flags, *_status_field(line))

    def _extend_stop(self, state: State, now: float) -> None:
        """While the final stop waits on a save, keep systemd waiting until that save would count as hung."""
        if not self._stopping:
            return
        extension = stop_extension_s(state, now)
        if extension is not None:
            self.notifier.extend_timeout(extension)

    def _ping(self, now: float) -> None:
        interval = self.notifier.watchdog_interval()
        if interval is None or now < self._next_ping:
            return
        self.notifier.watchdog()
        self._next_ping = now + interval


def _final_stop(state: State) -> bool:
    """The supervisor is on its way out: stopping without a relaunch to follow, or already done."""
    return (
        state.phase.terminal
        or (state.phase is Phase.STOPPING and state.then is not Then.RELAUNCH)
        or stopping_on_request(state)
    )


def stop_extension_s(state: State, now: float) -> float | None:
    """Seconds the final stop may still take while ranks save on the way down (the agreed checkpoint of a
    graceful stop, or a save in flight the supervisor waits for); None when nobody saves or time is up."""
    graceful = state.phase is Phase.RUNNING  # every rank is on its way to the agreed checkpoint
    if not (saving(state) or graceful) or state.deadline is None or state.deadline <= now:
        return None
    return state.deadline - now + state.policy.kill_grace_s + state.policy.sigkill_wait_s


def status_line(state: State) -> str:
    """One line for `systemctl status`: the phase, the attempt, and the step or the reason."""
    describe = _DESCRIBE.get(state.phase)
    return describe(state) if describe else state.phase.value


def _attempt(state: State) -> str:
    if state.attempt == 0:
        return ""
    return f" attempt {state.attempt} (restart {state.restarts}/{state.policy.max_restarts})"


def _starting(state: State) -> str:
    return "starting" + _attempt(state)


def _running(state: State) -> str:
    steps = [r.step for r in state.ranks if r.step is not None]
    line = "running" + _attempt(state) + (f", step {max(steps)}" if steps else "")
    order = state.stop_order
    if order is None:
        return line
    then = "exit" if order.exit else "continue"
    if stopping_on_request(state):
        return f"stopping on request ({state.stop_source}): checkpoint at step {order.step}, then exit" + _saving(state)
    return f"{line}, checkpoint ordered at step {order.step}, then {then}"


def _saving(state: State) -> str:
    ranks = [str(r.rank) for r in saving(state)]
    return f", rank {', '.join(ranks)} saving" if ranks else ""


def _stopping(state: State) -> str:
    why = {
        Then.STOP: "on request",
        Then.FAIL: f"to give up after {state.last_failure}",
        Then.RELAUNCH: f"to relaunch after {state.last_failure}",
    }
    stages = {StopStage.STACKS: "collecting stacks", StopStage.KILL: "SIGKILL sent"}
    parts = ["stopping" + _attempt(state) + (f" {why[state.then]}" if state.then else "")]
    if state.stop_stage in stages:
        parts.append(stages[state.stop_stage])
    return ", ".join(parts) + _saving(state)


def _backoff(state: State) -> str:
    delay = state.policy.backoff_s(state.restarts)
    return f"backoff {delay:g} s before attempt {state.attempt + 1} after {state.last_failure}"


def _finished(state: State) -> str:
    return "finished" if state.restarts == 0 else f"finished after {state.restarts} restarts"


def _stopped(state: State) -> str:
    if state.saves_lost and state.reason:  # never a clean stop's words for a stop that lost a save
        return state.reason
    return "stopped on request" + ("" if state.stopped_at is None else f" at step {state.stopped_at}")


def _failed(state: State) -> str:
    return f"failed: {state.reason}"


_DESCRIBE = {
    Phase.STARTING: _starting,
    Phase.RUNNING: _running,
    Phase.STOPPING: _stopping,
    Phase.BACKOFF: _backoff,
    Phase.FINISHED: _finished,
    Phase.STOPPED: _stopped,
    Phase.FAILED: _failed,
}
