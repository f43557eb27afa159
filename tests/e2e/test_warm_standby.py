"""Warm standby ranks: a relaunch runs in processes that started Python and imported torch beforehand, and the run
resumes exactly as a cold relaunch does (crash, hang, anomaly rollback, stop and resume); standbys never outlive
the supervisor, and a run whose standbys cannot work goes on cold."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import wait_until
from tests.e2e.conftest import (
    FAST_HANG,
    SPIKE_STREAK,
    assert_same_training_state,
    finish,
    heartbeat,
    journal,
    run_supervisor,
    start_supervisor,
    write_config,
)
from worker.standby import FORK_SERVER_FLAG, FORK_SERVER_NAME, STANDBY_NAME

pytestmark = pytest.mark.timeout(300)

WARM, COLD = {"enabled": True}, {"enabled": False}  # on by default, and in write_config
# After a stop, each once: rank 1 killed after step 29, rank 0 frozen (SIGSTOP: a hang) after 32, and SPIKE_STREAK's
# spike streak at 45. Slower steps (a sleep: the numbers stay the same) give the pool time to be refilled (a fork
# from the fork server) in between, and the stop below time to come before step 20.
WARM_STREAM = {
    **SPIKE_STREAK,
    "env": {
        "TRAINWARDEN_FAULTS_ONCE": "1",
        "TRAINWARDEN_FAULTS": ",".join(
            ["1:sigkill@29", "0:sigstop@32", SPIKE_STREAK["env"]["TRAINWARDEN_FAULTS"], "0:slow@1:0.1", "1:slow@1:0.1"]
        ),
    },
    "hang": FAST_HANG,
    "restart": {"max_restarts": 5, "in_place": False},  # every rank relaunched, from standbys (in place: test_in_place)
}


def standbys(supervisor: subprocess.Popen | int, *, server: bool = False) -> dict[int, psutil.Process]:
    """The supervisor's waiting standby processes (forked ones are named so, and keep the fork server's command line
    when they run the script; spawned ones have theirs until then), or with `server` its fork server, by pid."""
    pid = supervisor if isinstance(supervisor, int) else supervisor.pid
    found = {}
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return {}
    for child in children:
        try:
            cmdline, name = child.cmdline(), child.name()
            if child.status() == psutil.STATUS_ZOMBIE or "worker.standby" not in cmdline:
                continue
            forked = FORK_SERVER_FLAG in cmdline
            if (name == FORK_SERVER_NAME.decode()) if server else (name == STANDBY_NAME.decode() or not forked):
                found[child.pid] = child
        except psutil.Error:
            continue
    return found


def standbys_ready(proc: subprocess.Popen, run_dir: Path) -> int | None:
    """What this supervisor (not a predecessor) last wrote in the status file."""
    try:
        status = json.loads((run_dir / "supervisor" / "state.json").read_text())
    except (OSError, ValueError):  # not written yet
        return None
    return status.get("standbys_ready") if status.get("supervisor_pid") == proc.pid else None


def wait(proc: subprocess.Popen, predicate: Callable[[], object], what: str) -> Any:
    """wait_until, and the supervisor killed if it never comes (nothing of the test may outlive it)."""
    try:
        return wait_until(predicate, timeout=90, what=what)
    except BaseException:
        proc.kill()
        proc.communicate(timeout=30)
        raise


def wait_for_standbys(proc: subprocess.Popen, run_dir: Path) -> set[int]:
    """Both standbys spawned and done importing (the status file says so); their pids."""
    wait(proc, lambda: standbys_ready(proc, run_dir) == 2, "both standbys to be ready")
    return set(standbys(proc))


def kept_standbys(proc: subprocess.Popen, run_dir: Path, *, launches: int = 1) -> set[int]:
    """The standbys waiting once the run dir's journal has `launches` launches (the ranks forked for the last,
    briefly standbys themselves, left out)."""
    try:
        launched = [e for e in journal(run_dir) if e["event"] == "ranks_launched"]
    except (OSError, ValueError):  # not written yet, or a line being written
        return set()
    ranks = {pid for e in launched for pid in e["pids"]}
    return set(standbys(proc)) - ranks if len(launched) == launches else set()


def spawned_standbys(proc: subprocess.Popen) -> set[int]:
    """Both standbys spawned (perhaps still importing); their pids."""
    return set(wait(proc, lambda: len(found := standbys(proc)) == 2 and found, "both standbys to be spawned"))


def warm_launches(run_dir: Path) -> list[tuple[int, list[int]]]:
    return [(e["attempt"], e["ranks"]) for e in journal(run_dir) if e["event"] == "standbys_used"]


def launched_pids(run_dir: Path, attempt: int) -> set[int]:
    (launch,) = [e for e in journal(run_dir) if e["event"] == "ranks_launched" and e["attempt"] == attempt]
    return set(launch["pids"])


def test_a_stopped_run_resumes_warm_through_a_kill_a_hang_and_a_rollback_bitwise_as_a_cold_one(
    tmp_path: Path, rollback_run: Path
) -> None:
    """SIGTERM: the ranks save and exit, the standbys go with the supervisor. The next supervisor resumes from the
    stop with standbys of its own; a kill, a freeze (a hang) and a spike streak (a rollback past the bad data) are
    each relaunched in standby processes that waited, the pool refilled after each, and the run ends bitwise equal
    to the cold run through the spike streak alone: it resumed from the same checkpoint and skipped the same data."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", **WARM_STREAM, standby=WARM)
    proc = start_supervisor(config, run_dir)
    waiting = set(wait(proc, lambda: standbys(proc, server=True), "the fork server to be started"))
    wait(proc, lambda: (beat := heartbeat(run_dir, 0)) and beat["step"] >= 2, "rank 0 to train")
    proc.send_signal(signal.SIGTERM)  # at step 2 or so (a step takes 0.1 s or more): before step 20
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.status()["state"] == "stopped"
    assert not [pid for pid in waiting if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    stop_step = stopped.status()["last_checkpoint"]["step"]
    assert stop_step < 20, "stopped before the checkpoint the first fault resumes from"

    proc = start_supervisor(config, run_dir)
    first = set(wait(proc, lambda: len(kept := kept_standbys(proc, run_dir, launches=2)) == 2 and kept, "standbys"))
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["resume_step"] for e in journal(run_dir) if e["event"] == "ranks_launched"][1:] == [stop_step, 20, 30, 30]
    assert [(f["attempt"], f["kind"]) for f in done.status()["failures"]] == [
        (0, "signal"),
        (1, "hang"),
        (2, "anomaly"),
    ]
    # The frozen rank: its hang declared, the job's stacks collected, named silent by its process state (a stopped
    # process), both ranks stopped (it by SIGKILL, if need be).
    (frozen,) = [e for e in journal(run_dir) if e["event"] == "stacks_collected"]
    assert frozen["attempt"] == 1 and frozen["paths"]
    (hang,) = [e for e in journal(run_dir) if e["event"] == "hang_detected"]
    assert (hang["rank"], hang["class"], hang["named_by"], hang["evidence"]) == (
        0,
        "silent",
        "process_state",
        "process stopped (SIGSTOP)",
    )
    assert sorted(e["rank"] for e in journal(run_dir) if e["event"] == "rank_stopped" and e["attempt"] == 1) == [0, 1]
    assert warm_launches(run_dir) == [(0, [0, 1]), (0, [0, 1]), (1, [0, 1]), (2, [0, 1]), (3, [0, 1])]
    assert launched_pids(run_dir, 1) == first
    assert warm_launches(rollback_run) == []
    assert rollbacks(run_dir) == rollbacks(rollback_run) == [(35, 52)]
    assert_same_training_state(run_dir, rollback_run)


def rollbacks(run_dir: Path) -> list[tuple[int, int]]:
    return [(e["resume_at_most"], e["skip_to_batch"]) for e in journal(run_dir) if e["event"] == "rollback_scheduled"]


# ---- the mechanics, with a script that needs no torch ---------------------------------------------------------

# The standbys prewarm a standard module the script does not import (torch would cost 2 s of CPU a standby here;
# the demo tests above prewarm it).
PREWARMED = "wave"
FACTS_SCRIPT = """
import json, os, random, sys, time
from pathlib import Path
from worker.heartbeat import Heartbeat

run, rank = Path(os.environ["TRAINWARDEN_RUN_DIR"]), int(os.environ["RANK"])
attempt = int(os.environ["TRAINWARDEN_ATTEMPT"])
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
                  "prewarmed": "wave" in sys.modules, "restart_count": os.environ["TORCHELASTIC_RESTART_COUNT"],
                  "port": os.environ["MASTER_PORT"], "stdin": sys.stdin.read(), "pid": os.getpid(),
                  "standby_env": sorted(k for k in os.environ if "STANDBY" in k or "PREWARM" in k),
                  "tag": os.environ.get("FROM_CONFIG"), "comm": Path("/proc/self/comm").read_text(),
                  "random": random.random(), "cmdline": Path("/proc/self/cmdline").read_text().split("\\0")}),
      flush=True)
print("stderr of attempt", attempt, file=sys.stderr, flush=True)
Heartbeat(run / "ranks" / f"rank_{rank}" / "heartbeat.json", root=run, rank=rank, attempt=attempt,
          interval_s=0.1).beat(1, "train", force=True)
if attempt == 0:
    while not Path(sys.argv[1]).exists():  # the test says when to crash
        time.sleep(0.05)
    sys.exit(3)
"""


def facts_job(tmp_path: Path, standby: dict[str, Any] | None = None) -> tuple[Path, Path, Path]:
    script = tmp_path / "facts.py"
    script.write_text(FACTS_SCRIPT)
    crash = tmp_path / "crash_now"
    config = write_config(
        tmp_path / "job.yaml",
        script=str(script),
        args=[str(crash)],
        hang={"heartbeat": "off"},
        env={"FROM_CONFIG": "yes"},
        standby={**WARM, "prewarm_imports": [PREWARMED], **(standby or {})},
    )
    return config, tmp_path / "run", crash


def facts(run_dir: Path, attempt: int, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / "logs" / f"attempt_{attempt}" / f"rank_{rank}.out").read_text())


def test_a_standby_runs_the_script_as_main_with_the_attempts_environment_and_log_files(tmp_path: Path) -> None:
    """The first launch's ranks and the standbys kept while they train are forked from the fork server and adopted
    by the supervisor; once used, nothing tells them from a freshly started `python -u facts.py` (a cold run's: but
    the prewarmed module), not even their name or random seed."""
    config, run_dir, crash = facts_job(tmp_path)
    proc = start_supervisor(config, run_dir)
    waiting = wait_for_standbys(proc, run_dir)
    assert len(standbys(proc, server=True)) == 1
    assert {psutil.Process(pid).name() for pid in waiting} == {"tw-standby"}
    crash.touch()
    done = finish(proc, run_dir)
    cold_run = tmp_path / "cold"  # the same job without standbys: its first attempt fails at once, its second ends
    assert run_supervisor(facts_job(tmp_path, COLD)[0], cold_run).returncode == 0

    assert done.returncode == 0, done.stderr[-3000:]
    assert warm_launches(run_dir) == [(0, [0, 1]), (1, [0, 1])]
    assert not [e for e in journal(run_dir) if e["event"] in ("fork_server_off", "standbys_off")]
    cold, first, warm = facts(cold_run, 1, 0), facts(run_dir, 0, 0), facts(run_dir, 1, 0)
    assert (cold["name"], cold["path0"], cold["standby_env"], cold["prewarmed"]) == (
        "__main__",
        str(tmp_path),
        [],
        False,
    )
    assert " ".join(cold["cmdline"]).strip() == f"{sys.executable} -u {tmp_path / 'facts.py'} {tmp_path / 'crash_now'}"
    for forked in (first, warm):  # both forked: no fork_server_off, and only the fork server gives a first launch's
        assert forked["prewarmed"]
        for key in ("name", "file", "argv", "path0", "stdin", "standby_env", "tag", "comm"):
            assert forked[key] == cold[key], key  # as `python -u facts.py` has them
        assert " ".join(forked["cmdline"]).strip() == " ".join(cold["cmdline"]).strip()  # `ps -o args` alike
    assert warm["pid"] in waiting and first["pid"] not in waiting
    assert warm["random"] != facts(run_dir, 1, 1)["random"] != first["random"]  # each fork seeded afresh
    assert (first["restart_count"], warm["restart_count"]) == ("0", "1") and warm["port"] != first["port"]
    assert (run_dir / "logs" / "attempt_1" / "rank_1.err").read_text() == "stderr of attempt 1\n"
    assert facts(run_dir, 1, 1)["pid"] in waiting


def test_standbys_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    """The fork server, the standbys and the ranks forked from it (adopted by the supervisor)."""
    config, run_dir, _ = facts_job(tmp_path)
    proc = start_supervisor(config, run_dir)
    waiting = wait_for_standbys(proc, run_dir) | set(standbys(proc, server=True)) | launched_pids(run_dir, 0)
    assert len(waiting) == 5
    proc.kill()
    proc.communicate(timeout=30)
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in waiting if psutil.pid_exists(pid)], timeout=10)
    assert not alive


def test_a_standby_that_dies_unused_turns_standbys_off_and_the_relaunch_starts_cold(tmp_path: Path) -> None:
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(3)\n")
    config, run_dir, crash = facts_job(tmp_path, {"prewarm_imports": ["exits_on_import"]})
    proc = start_supervisor(config, run_dir)
    wait(
        proc,
        lambda: (
            (run_dir / "supervisor" / "events.jsonl").exists()
            and any(e["event"] == "standbys_off" for e in journal(run_dir))
        ),
        "standbys to be turned off",
    )
    crash.touch()
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    (server_off,) = [e for e in journal(run_dir) if e["event"] == "fork_server_off"]
    assert server_off["reason"] == "it exited while importing"  # then standbys are spawned, which exit too
    (off,) = [e for e in journal(run_dir) if e["event"] == "standbys_off"]
    assert "exited with 3 before it was used" in off["reason"] and "standby_rank_" in off["reason"]
    assert warm_launches(run_dir) == []
    assert facts(run_dir, 1, 0)["restart_count"] == "1"


@pytest.mark.parametrize(
    ("standby", "warm"),
    [(COLD, []), ({"keep_warm": False}, [(1, [0, 1])])],
    ids=["turned off", "not kept warm"],
)
def test_no_standby_waits_while_the_run_trains_when_turned_off_or_not_kept_warm(
    tmp_path: Path, standby: dict[str, Any], warm: list[tuple[int, list[int]]]
) -> None:
    """`enabled: false`: every rank starts cold. `keep_warm: false`: nothing idle while the run trains, yet the
    relaunch's ranks start as standbys, spawned when it is decided, so their imports overlap the choice of the
    resume point."""
    config, run_dir, crash = facts_job(tmp_path, standby)
    proc = start_supervisor(config, run_dir)
    first = run_dir / "logs" / "attempt_0" / "rank_1.out"
    wait(proc, lambda: first.exists() and first.stat().st_size > 0, "rank 1 to start")
    time.sleep(1.5)  # the pool would be filled at the next poll (once a second) after the ranks' training heartbeat
    assert standbys(proc) == standbys(proc, server=True) == {}
    crash.touch()
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    assert warm_launches(run_dir) == warm
    assert facts(run_dir, 1, 0)["prewarmed"] == bool(warm)
    assert ("standbys_ready" in done.status()) == bool(warm)


def test_a_fork_server_whose_imports_start_a_thread_is_refused_and_standbys_are_spawned(tmp_path: Path) -> None:
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), name='poller', daemon=True).start()\n"
    )
    config, run_dir, crash = facts_job(tmp_path, {"prewarm_imports": ["starts_a_thread"]})
    proc = start_supervisor(config, run_dir)
    waiting = wait_for_standbys(proc, run_dir)
    crash.touch()
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    (off,) = [e for e in journal(run_dir) if e["event"] == "fork_server_off"]
    assert off["reason"] == "the imports started Python threads: ['poller']"
    assert off["log"].endswith("logs/standby_fork_server.log")
    assert warm_launches(run_dir) == [(1, [0, 1])]
    assert {facts(run_dir, 1, rank)["pid"] for rank in (0, 1)} == waiting


def test_a_standby_taken_while_still_importing_runs_the_script_once_its_imports_are_done(tmp_path: Path) -> None:
    """Spawned standbys (no fork server: one still importing has no standby to give) are taken importing."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(3)\n")
    config, run_dir, crash = facts_job(tmp_path, {"prewarm_imports": ["slow_to_import"], "fork_server": False})
    proc = start_supervisor(config, run_dir)
    waiting = spawned_standbys(proc)
    assert standbys_ready(proc, run_dir) in (None, 0)
    crash.touch()
    done = finish(proc, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    assert warm_launches(run_dir) == [(1, [0, 1])]
    assert {facts(run_dir, 1, rank)["pid"] for rank in (0, 1)} == waiting
