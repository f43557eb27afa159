"""The job's end time as Slurm says it: `scontrol show job` parsed (seconds, the standard ISO form, UNLIMITED,
Unknown), the batch script's `--signal` lead, and the watch that turns a reading into the core's TimeLimitRead
(through a stand-in `scontrol` on PATH: a real process, as the supervisor runs it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.core import TimeLimitRead
from supervisor.launch import slurmctl
from supervisor.launch.slurmctl import SlurmError, parse_end_time, parse_signal_lead, parse_time_limit
from supervisor.launch.time_limit import TimeLimitWatch

RUNNING = (
    "JobId=42 JobName=train UserId=me(1000) JobState=RUNNING Reason=None RunTime=00:01:05 TimeLimit=01:00:00 "
    "TimeMin=N/A SubmitTime=1795852800 StartTime=1795852805 EndTime={end} Deadline=N/A NodeList=twnode[1-3]"
)
DEMO_HEADER = """#!/bin/bash
# The demo job
#SBATCH --job-name=trainwarden-demo
#SBATCH --no-kill                    # a dead node must not end the allocation
#SBATCH --signal=B:USR1@120          # 120 s before the time limit
set -u
"""


def test_end_time_in_seconds_as_asked_for():
    assert parse_end_time(RUNNING.format(end="1795856405")) == (1795856405.0, "1795856405")


def test_end_time_in_the_standard_form_is_local_time():
    """A Slurm that ignores SLURM_TIME_FORMAT writes local time without a zone, as the client's clock reads it."""
    end, text = parse_end_time(RUNNING.format(end="2026-11-28T12:00:00"))
    assert text == "2026-11-28T12:00:00"
    assert end == time.mktime((2026, 11, 28, 12, 0, 0, 0, 0, -1))


@pytest.mark.parametrize(
    "line",
    [
        RUNNING.format(end="Unknown"),  # not started (pending, or requeued)
        RUNNING.replace("TimeLimit=01:00:00", "TimeLimit=UNLIMITED").format(end="1827388805"),  # a year ahead
        "JobId=42 JobState=RUNNING NodeList=twnode1",  # no EndTime at all (a stand-in Slurm)
    ],
)
def test_no_limit_or_no_end_time_yet_is_none(line):
    assert parse_end_time(line)[0] is None


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [
        ("01:00:00", 3600),
        ("1-02:03:04", 93784),
        ("05:30", 330),
        ("5", 300),
        ("2-00", 172800),
        ("2-1:30", 178200),
        ("UNLIMITED", None),
        ("N/A", None),
    ],
)
def test_the_jobs_whole_time_limit_in_seconds(limit: str, seconds: int | None):
    assert parse_time_limit(RUNNING.replace("TimeLimit=01:00:00", f"TimeLimit={limit}").format(end="0")) == seconds


def test_a_margin_longer_than_half_a_short_job_is_cut_to_half_of_it(tmp_path, monkeypatch):
    """A 4-minute job with the default 300 s margin would stop before its first step, and a resubmitting script
    would loop: the margin is half the job's time limit then, and the log says so."""
    start = int(time.time())
    short = RUNNING.replace("TimeLimit=01:00:00", "TimeLimit=00:04:00").format(end=start + 240)
    fake_scontrol(tmp_path, monkeypatch, short, None)
    posted: list[object] = []
    log = Log()
    TimeLimitWatch("42", 300.0, posted.append, log).read()
    assert [read.margin_s for read in posted] == [120.0]  # type: ignore[attr-defined]
    assert log.records[-1][2]["margin_from"] == "half the job's time limit"


def test_an_end_time_that_is_no_time_is_an_error_naming_it():
    with pytest.raises(SlurmError, match="EndTime='Tomorr' is not a time"):  # SLURM_TIME_FORMAT=relative
        parse_end_time(RUNNING.format(end="Tomorr"))
    with pytest.raises(SlurmError, match="is not a time"):
        parse_end_time(RUNNING.format(end="28/11/2026"))


@pytest.mark.parametrize(
    ("script", "lead"),
    [
        (DEMO_HEADER, 120.0),
        ("#!/bin/bash\n#SBATCH --signal=USR1@90\n", 90.0),  # to the steps: the agents pass it on
        ("#!/bin/bash\n#SBATCH --signal USR1\n", 60.0),  # Slurm's default lead
        ("#!/bin/bash\n#SBATCH --signal=SIGUSR1@30\n#SBATCH --signal=B:10@45\n", 45.0),  # the last one counts
        ("#!/bin/bash\n#SBATCH --signal=R:USR1@300\n", None),  # a reservation's end, not the job's
        ("#!/bin/bash\n#SBATCH --signal=B:USR2@300\n", None),  # not the warning trainwarden acts on
        ("#!/bin/bash\nset -u\n#SBATCH --signal=B:USR1@120\n", None),  # after the first command: sbatch ignores it
        ("#!/bin/bash\necho hi\n", None),
    ],
)
def test_the_batch_scripts_signal_lead(script, lead):
    assert parse_signal_lead(script) == lead


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.records.append((level, event, fields))


def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, show: str, script: str | None) -> Path:
    """An `scontrol` on PATH answering `show job` with `show` (from a file, changed at will) and `write batch_script`
    with `script` (None: failing as for an salloc job); it records the SLURM_TIME_FORMAT it was run with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "show").write_text(show)
    if script is not None:
        (tmp_path / "script").write_text(script)
    (bin_dir / "scontrol").write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"d = {str(tmp_path)!r}\n"
        "if sys.argv[1:3] == ['show', 'job']:\n"
        "    open(os.path.join(d, 'format'), 'w').write(os.environ.get('SLURM_TIME_FORMAT', ''))\n"
        "    text = open(os.path.join(d, 'show')).read()\n"
        "    sys.exit(print(text) if text else 'slurm_load_jobs error: Unable to contact slurm controller')\n"
        "if sys.argv[1:3] == ['write', 'batch_script'] and os.path.exists(os.path.join(d, 'script')):\n"
        "    sys.exit(print(open(os.path.join(d, 'script')).read()))\n"
        "sys.exit('no batch script for job 42')\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_job_end_asks_for_seconds_and_reads_the_lead(tmp_path, monkeypatch):
    where = fake_scontrol(tmp_path, monkeypatch, RUNNING.format(end="1795856405"), DEMO_HEADER)
    assert slurmctl.job_end("42", with_signal_lead=True) == slurmctl.JobEnd(1795856405.0, "1795856405", 120.0, 3600.0)
    assert (where / "format").read_text() == "%s"
    (where / "script").unlink()  # an salloc job: no batch script, no lead
    assert slurmctl.job_end("42", with_signal_lead=True).signal_lead_s is None


def test_the_watch_posts_each_new_reading_with_the_scripts_lead_as_margin(tmp_path, monkeypatch):
    """The end time in the supervisor's clock, the --signal lead as margin; the same reading again posts nothing,
    a changed limit (`scontrol update TimeLimit=`) posts again."""
    end = time.time() + 600
    where = fake_scontrol(tmp_path, monkeypatch, RUNNING.format(end=int(end)), DEMO_HEADER)
    posted: list[object] = []
    log = Log()
    watch = TimeLimitWatch("42", 300.0, posted.append, log)
    watch.read()
    (read,) = posted
    assert isinstance(read, TimeLimitRead) and read.margin_s == 120.0
    assert read.at is not None and abs(read.at - (time.monotonic() + int(end) - time.time())) < 5
    assert read.end_time == time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(int(end)))
    level, event, fields = log.records[-1]
    assert (event, fields["margin_from"]) == ("time_limit_read", "the batch script's --signal")
    watch.read()
    assert len(posted) == 1
    (where / "show").write_text(RUNNING.format(end=int(end) - 300))
    watch.read()
    assert len(posted) == 2 and posted[1].at == pytest.approx(read.at - 300, abs=5)


def test_the_watch_uses_the_config_margin_and_survives_an_unreachable_controller(tmp_path, monkeypatch):
    """No --signal: slurm.time_limit_margin_s. The controller out of reach: one warning per streak, nothing posted
    (the last reading stands), and the next reading once it answers."""
    where = fake_scontrol(tmp_path, monkeypatch, "", None)
    posted: list[object] = []
    log = Log()
    watch = TimeLimitWatch("42", 300.0, posted.append, log)
    watch.read()
    watch.read()
    assert posted == [] and [r[1] for r in log.records] == ["time_limit_unknown"]
    assert "Unable to contact slurm controller" in log.records[0][2]["error"]
    (where / "show").write_text(RUNNING.replace("TimeLimit=01:00:00", "TimeLimit=UNLIMITED").format(end="0"))
    watch.read()
    assert posted == [TimeLimitRead(None, 300.0, "")]
    assert log.records[-1][2]["margin_from"] == "slurm.time_limit_margin_s"
