"""The real supervisor talking sd_notify to a datagram socket the test listens on, as systemd would."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import wait_until
from tests.e2e.conftest import finish, journal, start_supervisor

pytestmark = pytest.mark.timeout(120)

# Each rank writes its environment to ENV_DIR/rank_R.json, then sleeps SECONDS (or until SIGTERM).
WRITE_ENV_AND_SLEEP = """
import json, os, sys, time
path = os.path.join(sys.argv[1], "rank_" + os.environ["RANK"] + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(dict(os.environ), f)
os.rename(path + ".tmp", path)
time.sleep(float(sys.argv[2]))
"""
SYSTEMD_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class FakeSystemd:
    """A bound AF_UNIX datagram socket with a reader thread that keeps every message (the queue holds only ~10)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.05)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, name="fake-systemd", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                self.messages.append(self._sock.recv(4096).decode())
            except TimeoutError:
                continue

    def fields(self) -> list[str]:
        """Every KEY=VALUE line received so far, in order."""
        return [line for message in list(self.messages) for line in message.splitlines()]

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def fake_systemd(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSystemd]:
    """NOTIFY_SOCKET points at a socket this test reads; WATCHDOG_* start unset."""
    with tempfile.TemporaryDirectory(prefix="tw-", dir="/tmp") as short:  # sun_path holds 108 bytes at most
        listener = FakeSystemd(os.path.join(short, "notify"))
        monkeypatch.setenv("NOTIFY_SOCKET", listener.path)
        for name in ("WATCHDOG_USEC", "WATCHDOG_PID"):
            monkeypatch.delenv(name, raising=False)
        try:
            yield listener
        finally:
            listener.close()


def job(tmp_path: Path, sleep_s: float) -> Path:
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    config = {
        "command": [sys.executable, "-c", WRITE_ENV_AND_SLEEP, str(env_dir), str(sleep_s)],
        "nproc_per_node": 2,
        "restart": {"max_restarts": 0},
        "stop": {"kill_grace_s": 5.0},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rank_envs(tmp_path: Path) -> list[dict[str, str]]:
    return [json.loads((tmp_path / "env" / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


def test_ready_status_watchdog_and_stopping_over_a_stop_request(
    tmp_path: Path, fake_systemd: FakeSystemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd the supervisor sends READY=1 after launching, pings the watchdog, and STOPPING=1 on SIGTERM."""
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # ping every 0.5 s
    run_dir = tmp_path / "run"
    proc = start_supervisor(job(tmp_path, 60), run_dir)
    wait_until(lambda: "READY=1" in fake_systemd.fields(), timeout=30, what="READY=1")
    launched_before_ready = "ranks_launched" in [e["event"] for e in journal(run_dir)]
    wait_until(lambda: fake_systemd.fields().count("WATCHDOG=1") >= 3, timeout=30, what="three watchdog pings")
    wait_until(lambda: len(list((tmp_path / "env").glob("rank_*.json"))) == 2, timeout=30, what="rank environments")
    proc.send_signal(signal.SIGTERM)
    done = finish(proc, run_dir, timeout=30)

    assert done.returncode == 0, done.stderr[-2000:]
    assert launched_before_ready
    fields = fake_systemd.fields()
    assert fields.index("READY=1") < fields.index("STOPPING=1")
    statuses = [f.removeprefix("STATUS=") for f in fields if f.startswith("STATUS=")]
    assert [f for f in fields if f != "WATCHDOG=1"][0:3] == ["STATUS=starting", "READY=1", "STATUS=running"]
    assert statuses[-2:] == ["stopping on request", "stopped on request"]
    assert fields.count("STOPPING=1") == 1
    for env in rank_envs(tmp_path):
        assert not set(SYSTEMD_ONLY) & set(env), "a rank must not inherit systemd's notify socket or watchdog"


@pytest.mark.parametrize(
    "watchdog", [{}, {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}], ids=["no-watchdog", "watchdog-for-another-pid"]
)
def test_finished_run_sends_stopping_and_no_watchdog_unless_asked(
    tmp_path: Path, fake_systemd: FakeSystemd, monkeypatch: pytest.MonkeyPatch, watchdog: dict[str, str]
) -> None:
    """A run that finishes sends READY=1, STATUS=finished and STOPPING=1, and no WATCHDOG=1 unless meant for it."""
    for name, value in watchdog.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    done = finish(start_supervisor(job(tmp_path, 2.0), run_dir), run_dir, timeout=60)

    assert done.returncode == 0, done.stderr[-2000:]
    fields = fake_systemd.fields()
    assert "READY=1" in fields and fields.count("STOPPING=1") == 1
    assert fields[-2:] == ["STOPPING=1", "STATUS=finished"]
    assert "WATCHDOG=1" not in fields


CRASH_ONCE = """
import os, sys, time
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
if first and os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(30 if first else 0.5)
"""


def test_status_follows_a_crash_and_relaunch_without_stopping(tmp_path: Path, fake_systemd: FakeSystemd) -> None:
    """A crash shows as a STATUS on the way to the next attempt; STOPPING=1 waits for the real end."""
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "command": [sys.executable, "-c", CRASH_ONCE],
                "nproc_per_node": 2,
                "restart": {"max_restarts": 2},
                "stop": {"kill_grace_s": 5.0},
            }
        )
    )
    run_dir = tmp_path / "run"
    done = finish(start_supervisor(config, run_dir), run_dir, timeout=60)

    assert done.returncode == 0, done.stderr[-2000:]
    fields = fake_systemd.fields()
    statuses = [f.removeprefix("STATUS=") for f in fields if f.startswith("STATUS=")]
    assert statuses == [
        "starting",
        "running",
        "stopping to relaunch after rank 1 exited with code 3 in attempt 0",
        "starting attempt 1 (restart 1/2)",
        "running attempt 1 (restart 1/2)",
        "finished after 1 restarts",
    ]
    assert fields.count("READY=1") == 1 and fields.index("STOPPING=1") == len(fields) - 2
