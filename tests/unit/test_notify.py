"""The sd_notify adapter against real AF_UNIX datagram sockets, and what the supervisor's states make it say."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.core import (
    ChildExited,
    HeartbeatSeen,
    Phase,
    Policy,
    RanksLaunched,
    SignalReceived,
    Started,
    State,
    StopStage,
    Then,
    Tick,
    decide,
    initial_state,
)
from supervisor.observe.notify import Notifier, ServiceReporter, status_line, stop_extension_s

NOW = 1000.0
POLICY = Policy(
    nproc=2,
    max_restarts=3,
    backoff_initial_s=1.0,
    backoff_factor=2.0,
    backoff_max_s=5.0,
    kill_grace_s=10.0,
    sigkill_wait_s=5.0,
)


class Listener:
    """A bound datagram socket standing in for systemd; every read is bounded."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address  # as NOTIFY_SOCKET spells it

    def messages(self, timeout: float = 0.5) -> list[str]:
        """Every datagram queued now (waiting at most `timeout` for the first)."""
        got: list[str] = []
        self.sock.settimeout(timeout)
        try:
            while True:
                got.append(self.sock.recv(4096).decode())
                self.sock.settimeout(0.05)
        except (TimeoutError, BlockingIOError):
            return got


class Recorder:
    """A structlog-shaped logger that keeps what it was told."""

    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


@pytest.fixture
def path_listener() -> Iterator[Listener]:
    with tempfile.TemporaryDirectory(prefix="tw-", dir="/tmp") as short:  # sun_path holds 108 bytes at most
        path = os.path.join(short, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            yield Listener(sock, path)


@pytest.fixture
def abstract_listener() -> Iterator[Listener]:
    name = f"trainwarden-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield Listener(sock, "@" + name)


def notifier_for(listener: Listener, **kwargs: Any) -> Notifier:
    return Notifier(listener.address, **kwargs)


# ---- the protocol ---------------------------------------------------------------------------


def test_ready_with_status_is_one_datagram_on_a_path_socket(path_listener: Listener) -> None:
    """READY=1 and its STATUS= travel together, newline-separated, to a socket named by its path."""
    notifier = notifier_for(path_listener)

    assert notifier.ready("running, step 3")
    assert path_listener.messages() == ["READY=1\nSTATUS=running, step 3"]


def test_abstract_namespace_address_is_reached(abstract_listener: Listener) -> None:
    """An `@name` NOTIFY_SOCKET is the abstract socket `\\0name`."""
    notifier = notifier_for(abstract_listener)

    assert notifier.status("starting")
    assert abstract_listener.messages() == ["STATUS=starting"]


def test_each_message_has_the_documented_format(path_listener: Listener) -> None:
    """STATUS=, STOPPING=1, WATCHDOG=1 and EXTEND_TIMEOUT_USEC= (whole microseconds) as sd_notify(3) spells them."""
    notifier = notifier_for(path_listener)

    notifier.status("backoff 2 s\nbefore attempt 2")
    notifier.stopping("stopping on request")
    notifier.watchdog()
    notifier.extend_timeout(90.5)
    notifier.stopping()

    assert path_listener.messages() == [
        "STATUS=backoff 2 s before attempt 2",  # a newline would end the field early
        "STOPPING=1\nSTATUS=stopping on request",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=90500000",
        "STOPPING=1",
    ]


def test_from_environ_reads_notify_socket(path_listener: Listener) -> None:
    """from_environ() takes the socket from NOTIFY_SOCKET."""
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": path_listener.address})

    assert notifier.enabled and notifier.watchdog()
    assert path_listener.messages() == ["WATCHDOG=1"]


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "1000000"}])
def test_without_notify_socket_nothing_is_sent(environ: dict[str, str]) -> None:
    """Without NOTIFY_SOCKET (run by hand) every method is a no-op that reports False, and there is no watchdog."""
    notifier = Notifier.from_environ(environ)

    assert not notifier.enabled
    assert not any(
        [
            notifier.ready("x"),
            notifier.status("x"),
            notifier.stopping(),
            notifier.watchdog(),
            notifier.extend_timeout(1),
        ]
    )
    assert notifier.watchdog_interval() is None


def test_send_error_is_logged_once_and_never_raised(tmp_path: Path) -> None:
    """A socket nobody listens on makes sends return False and logs one warning, however often it is tried."""
    log = Recorder()
    notifier = Notifier(str(tmp_path / "gone"), log=log)

    assert not notifier.ready("x")
    assert not notifier.watchdog()
    assert [event for event, _ in log.warnings] == ["systemd_notify_failed"]
    assert log.warnings[0][1]["socket"] == str(tmp_path / "gone")


def test_unsupported_address_is_disabled_with_a_warning() -> None:
    """A relative NOTIFY_SOCKET (neither a path nor @abstract) disables notify and says so once."""
    log = Recorder()
    notifier = Notifier("relative/notify", log=log)

    assert not notifier.enabled and not notifier.status("x")
    assert [event for event, _ in log.warnings] == ["systemd_notify_failed"]


@pytest.mark.parametrize(
    ("usec", "for_pid", "expected"),
    [
        ("60000000", None, 30.0),  # ping at half the timeout
        ("60000000", "OWN", 30.0),
        ("60000000", "1", None),  # meant for another process
        ("0", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval_honours_watchdog_pid(
    path_listener: Listener, usec: str | None, for_pid: str | None, expected: float | None
) -> None:
    """The ping interval is half WATCHDOG_USEC, and none when WATCHDOG_PID names another process or the value is bad."""
    pid = str(os.getpid()) if for_pid == "OWN" else for_pid
    notifier = notifier_for(path_listener, watchdog_usec=usec, watchdog_pid=pid)

    assert notifier.watchdog_interval() == expected


# ---- what the supervisor says ---------------------------------------------------------------


def launched(state: State | None = None) -> State:
    state = state or initial_state(POLICY)
    state, _ = decide(state, Started(), NOW)
    state, _ = decide(state, RanksLaunched(state.attempt, (100, 101), None), NOW)
    return state


def beat(state: State, rank: int, step: int, phase: str = "train", seq: int = 1, now: float = NOW) -> State:
    return decide(state, HeartbeatSeen(state.attempt, rank, seq, step, phase), now)[0]


def test_status_lines_name_phase_attempt_step_and_reason() -> None:
    """Each phase reads as one line an operator understands."""
    running = beat(launched(), 0, 340)
    crashed, _ = decide(running, ChildExited(0, 1, 3), NOW)
    backoff = replace(crashed, phase=Phase.BACKOFF, restarts=2, stop_stage=None)
    again = replace(running, attempt=2, restarts=2)

    assert status_line(initial_state(POLICY)) == "starting"
    assert status_line(running) == "running, step 340"
    assert status_line(again) == "running attempt 2 (restart 2/3), step 340"
    assert status_line(crashed) == "stopping to relaunch after rank 1 exited with code 3 in attempt 0"
    assert status_line(backoff) == "backoff 2 s before attempt 1 after rank 1 exited with code 3 in attempt 0"
    assert status_line(replace(running, phase=Phase.FAILED, reason="restarts exhausted")) == (
        "failed: restarts exhausted"
    )
    assert status_line(replace(running, phase=Phase.FINISHED, restarts=1)) == "finished after 1 restarts"


def test_status_line_of_a_final_stop_names_saving_ranks_and_stage() -> None:
    """Stopping on request says so, at which step ranks save, which ranks are saving, and when SIGKILL went out."""
    saving = beat(launched(), 0, 40, phase="save")
    graceful, _ = decide(saving, SignalReceived(signal.SIGTERM), NOW)
    step = graceful.stop_order.step
    assert status_line(graceful) == (
        f"stopping on request (SIGTERM): checkpoint at step {step}, then exit, rank 0 saving"
    )

    stopping, _ = decide(graceful, Tick(), graceful.deadline)  # the stop timeout: SIGTERM to the ranks
    assert status_line(stopping) == "stopping on request, rank 0 saving"
    killing = replace(stopping, stop_stage=StopStage.KILL)
    assert status_line(killing) == "stopping on request, SIGKILL sent, rank 0 saving"


def test_reporter_sends_ready_once_after_launch_then_status_changes(path_listener: Listener) -> None:
    """READY=1 comes with the first observation after launch; later only changed STATUS lines are sent."""
    reporter = ServiceReporter(notifier_for(path_listener))
    starting, _ = decide(initial_state(POLICY), Started(), NOW)
    running = launched()

    reporter.observe(starting, NOW, launched=False)
    reporter.observe(running, NOW, launched=True)
    reporter.observe(running, NOW + 1, launched=True)
    reporter.observe(beat(running, 0, 5), NOW + 2, launched=True)

    assert path_listener.messages() == ["STATUS=starting", "READY=1\nSTATUS=running", "STATUS=running, step 5"]


def test_reporter_sends_stopping_once_on_final_stop_not_on_relaunch(path_listener: Listener) -> None:
    """A stop before a relaunch is only a STATUS; stopping on request sends STOPPING=1, once, then the end."""
    reporter = ServiceReporter(notifier_for(path_listener))
    running = launched()
    reporter.observe(running, NOW, launched=True)
    path_listener.messages()

    relaunching = replace(running, phase=Phase.STOPPING, then=Then.RELAUNCH, last_failure="rank 1 crashed")
    reporter.observe(relaunching, NOW, launched=True)
    stopping, _ = decide(running, SignalReceived(signal.SIGTERM), NOW)  # no heartbeats: SIGTERM at once
    reporter.observe(stopping, NOW, launched=True)
    reporter.observe(replace(stopping, phase=Phase.STOPPED), NOW, launched=True)

    assert path_listener.messages() == [
        "STATUS=stopping to relaunch after rank 1 crashed",
        "STOPPING=1\nSTATUS=stopping on request",
        "STATUS=stopped on request",
    ]


def test_reporter_pings_watchdog_at_half_the_timeout(path_listener: Listener) -> None:
    """WATCHDOG=1 goes out at once and then whenever half WATCHDOG_USEC has passed, as the loop observes."""
    reporter = ServiceReporter(notifier_for(path_listener, watchdog_usec="4000000"))
    running = launched()

    for t in (0.0, 1.0, 1.9, 2.0, 3.0, 4.5):
        reporter.observe(running, NOW + t, launched=True)

    pings = [m for m in path_listener.messages() if m == "WATCHDOG=1"]
    assert len(pings) == 3  # at 0, 2.0 and 4.5
    assert reporter.next_ping() == NOW + 6.5


def test_reporter_without_watchdog_never_pings(path_listener: Listener) -> None:
    """Without WATCHDOG_USEC the loop need not wake for the watchdog and no WATCHDOG=1 is sent."""
    reporter = ServiceReporter(notifier_for(path_listener))
    reporter.observe(launched(), NOW, launched=True)

    assert reporter.next_ping() == float("inf")
    assert "WATCHDOG=1" not in path_listener.messages()


def test_reporter_extends_stop_timeout_while_ranks_save_on_the_way_down(path_listener: Listener) -> None:
    """A graceful stop extends systemd's timeout to the stop timeout plus teardown; once escalated, a rank in
    phase save extends it to its save timeout (the supervisor waits for it) plus teardown, and nothing else does."""
    reporter = ServiceReporter(notifier_for(path_listener))
    graceful, _ = decide(beat(launched(), 0, 40, now=NOW), SignalReceived(signal.SIGTERM), NOW)
    reporter.observe(graceful, NOW + 100, launched=True)
    teardown = POLICY.kill_grace_s + POLICY.sigkill_wait_s
    assert [m for m in path_listener.messages() if m.startswith("EXTEND")] == [
        f"EXTEND_TIMEOUT_USEC={round((POLICY.stop_timeout_s - 100 + teardown) * 1_000_000)}"
    ]

    saving = beat(graceful, 0, 41, phase="save", seq=2, now=NOW + 250)
    escalated, _ = decide(saving, Tick(), NOW + POLICY.stop_timeout_s)
    reporter.observe(escalated, NOW + 400, launched=True)
    done = beat(escalated, 0, 41, phase="train", seq=3, now=NOW + 401)
    reporter.observe(done, NOW + 402, launched=True)
    extension = 250 + 1800 - 400 + teardown  # default save timeout: 1800 s
    assert [m for m in path_listener.messages() if m.startswith("EXTEND")] == [
        f"EXTEND_TIMEOUT_USEC={round(extension * 1_000_000)}"
    ]


def test_no_extension_for_a_save_past_its_timeout() -> None:
    """A save already silent past its timeout is a hang: systemd is not asked to wait for it."""
    saving = beat(launched(), 0, 40, phase="save", now=NOW)
    escalated, _ = decide(saving, ChildExited(0, 1, 3), NOW)  # waits for the save up to its 1800 s timeout

    assert stop_extension_s(escalated, NOW + 1801) is None
    assert stop_extension_s(launched(), NOW) is None
