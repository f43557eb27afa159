"""The systemd unit: systemd itself accepts it, and it keeps the settings long GPU jobs depend on."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import StopConfig
from worker.contract import EXIT_ANOMALY, EXIT_CONFIG, EXIT_CRASH_LOOP

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "trainwarden@.service"
INSTALLED_COMMAND = "/opt/trainwarden/.venv/bin/trainwarden"
_SECONDS = {"": 1, "s": 1, "sec": 1, "min": 60, "h": 3600}


def service_section() -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return dict(parser["Service"])


def seconds(timespan: str) -> float:
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", timespan)
    assert match is not None, f"unexpected timespan {timespan!r}"
    return int(match[1]) * _SECONDS[match[2]]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on an instance of the template prints nothing: no unknown key, no bad value."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (no systemd on this machine)")
    command = Path(sys.executable).parent / "trainwarden"
    if not command.exists():
        pytest.skip(f"the trainwarden command is not installed next to {sys.executable} (pip install -e .)")
    text = UNIT.read_text()
    assert INSTALLED_COMMAND in text
    # verify insists that ExecStart's program exists: point it at this checkout's installed command.
    instance = tmp_path / "trainwarden@demo.service"
    instance.write_text(text.replace(INSTALLED_COMMAND, str(command)))
    result = subprocess.run([analyze, "verify", str(instance)], capture_output=True, text=True, timeout=60)

    assert (result.returncode, result.stderr) == (0, "")


def test_unit_is_a_notify_service_that_restarts_on_failure_but_not_on_config_errors() -> None:
    """Type=notify for the main process only, restart on failure, never after exit 65, 70 or 78, one per config."""
    service = service_section()

    assert (service["Type"], service["NotifyAccess"]) == ("notify", "main")
    assert service["Restart"] == "on-failure" and seconds(service["RestartSec"]) >= 5
    assert {str(code) for code in (EXIT_ANOMALY, EXIT_CRASH_LOOP, EXIT_CONFIG)} <= set(
        service["RestartPreventExitStatus"].split()
    )
    assert service["ExecStart"] == f"{INSTALLED_COMMAND} run /etc/trainwarden/%i.yaml"
    assert seconds(service["WatchdogSec"]) > 0


def test_unit_stops_gracefully_and_outlasts_the_supervisors_own_stop() -> None:
    """SIGTERM to the supervisor alone, and a stop timeout longer than its default SIGTERM-to-SIGKILL grace."""
    service = service_section()
    stop = StopConfig()

    assert service["KillMode"] == "mixed"
    assert seconds(service["TimeoutStopSec"]) > stop.kill_grace_s + stop.sigkill_wait_s
    assert service["OOMPolicy"] == "continue"


def test_unit_limits_and_hardening_leave_gpus_and_nccl_working() -> None:
    """Raised fd and memlock limits, and none of the settings that hide devices, /tmp or shared memory."""
    service = service_section()

    assert (service["LimitNOFILE"], service["LimitMEMLOCK"]) == ("1048576", "infinity")
    hiding = {
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "PrivateTmp",
        "PrivateIPC",
        "RemoveIPC",
        "MemoryDenyWriteExecute",
        "NoNewPrivileges",
        "PrivateNetwork",
    }
    assert hiding.isdisjoint(service)
    assert service["ProtectSystem"] == "full"
