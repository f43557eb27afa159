"""examples/gpt_train.py under the real supervisor: float16 with a GradScaler, gradient accumulation and prefetch,
through a skipped spike, a kill, a stop and a rerun, ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.checkpoint_files import assert_bitwise_equal, load_saved
from tests.conftest import wait_until
from tests.e2e.conftest import REPO, Finished, finish, heartbeat, journal, run_supervisor, start_supervisor

pytestmark = pytest.mark.timeout(240)

SAVE_EVERY = 10
SPIKE_STEP = 68  # past the adaptive rule's 64 normal steps of history, so the spike is judged and skipped
KILL_STEP = 72  # after checkpoint 70, which follows the spike: the relaunch resumes from 70
SPIKE = f"0:spike@{SPIKE_STEP}"
# A stop lands about 1.5 s of steps after it is asked for (LEAD_S, the stop file's settle time): 30 steps on a busy
# machine, 150 on a fast one. So the run that is stopped has no end of its own, and the end every run trains to is
# set past the stop; --steps then only says where training ends, the LR schedule is the same for every run.
UNTIL_STOPPED = 100_000
STEPS_AFTER_STOP = 20
# float16 (the GradScaler's case) is slow on CPU: a smaller model than the example's defaults.
ARGS = [
    "--lr-decay-steps",
    "300",
    "--dtype",
    "float16",
    "--grad-accum",
    "2",
    "--batch-size",
    "4",
    "--block",
    "32",
    "--n-embd",
    "32",
]
COMPARED = (
    "model",
    "optimizer",
    "scheduler",
    "extra_state",
    "rng",
    "data_position",
    "anomaly_history",
    "feature_history",
)


@dataclass(frozen=True)
class Stopped:
    """The interrupted run as it was when its supervisor exited after the stop."""

    tmp: Path
    returncode: int
    stderr: str
    status: dict[str, Any]
    metrics_tail: dict[str, Any]

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    @property
    def step(self) -> int:
        return self.status["stopped_at"]["step"]


def gpt_job(tmp: Path, *, faults: str, steps: int) -> Path:
    """examples/gpt.yaml with the test's arguments, `faults` injected, and quick relaunches."""
    config = yaml.safe_load((REPO / "examples" / "gpt.yaml").read_text())
    config["script"] = str(REPO / "examples" / "gpt_train.py")
    config["args"] = [*ARGS, "--steps", str(steps), "--metrics-file", str(tmp / "metrics.jsonl")]
    config["env"] = {**config["env"], "TRAINWARDEN_FAULTS": faults}
    config["worker"]["save_checkpoint_steps"] = SAVE_EVERY
    config["restart"]["backoff_initial_s"] = 0.2
    config["stop"]["kill_grace_s"] = 1.0
    config["standby"] = {"enabled": False}  # tested in test_warm_standby.py; here two torch imports for nothing
    path = tmp / f"job_{steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def final_state(run_dir: Path, rank: int, step: int) -> dict[str, Any]:
    return load_saved(run_dir / "checkpoint" / f"rank_{rank}" / f"gpt_rank_{rank}-{step}.ckpt")


def rank_events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def last_metrics_line(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "metrics.jsonl").read_text().splitlines()[-1])


def assert_spike_skipped_once(run_dir: Path) -> None:
    """Rank 0 saw the spike; both ranks skipped that batch, once."""
    (seen,) = rank_events(run_dir, 0, "step_skipped")
    assert (seen["step"], seen["local"]) == (SPIKE_STEP, True) and "global_norm_spike" in seen["reasons"], seen
    (told,) = rank_events(run_dir, 1, "step_skipped")
    assert (told["step"], told["local"]) == (SPIKE_STEP, False), told


def wait_for_attempt_step(run_dir: Path, attempt: int, step: int) -> None:
    """Block until both ranks of `attempt` are training past `step`."""

    def past() -> bool:
        beats = [heartbeat(run_dir, rank) for rank in (0, 1)]
        return all(b and b["attempt"] == attempt and b["phase"] == "train" and b["step"] > step for b in beats)

    wait_until(past, timeout=90, what=f"both ranks of attempt {attempt} past step {step}")


def stop_run(run_dir: Path) -> None:
    """`trainwarden stop RUN_DIR`: save at the next step every rank can agree on, then exit."""
    subprocess.run(
        [sys.executable, "-m", "supervisor", "stop", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Stopped:
    """Rank 1 killed after step 72, the relaunch from checkpoint 70 stopped by `trainwarden stop` once it is past
    step 72; what the supervisor and the metrics file said then (a later rerun changes both)."""
    tmp = tmp_path_factory.mktemp("interrupted")
    proc = start_supervisor(gpt_job(tmp, faults=f"{SPIKE},1:sigkill@{KILL_STEP}", steps=UNTIL_STOPPED), tmp / "run")
    wait_for_attempt_step(tmp / "run", 1, KILL_STEP)
    stop_run(tmp / "run")
    done = finish(proc, tmp / "run", timeout=120)
    return Stopped(tmp, done.returncode, done.stderr, done.status(), last_metrics_line(tmp))


@pytest.fixture(scope="module")
def final_step(stopped: Stopped) -> int:
    """Where both runs end: a little past the stop."""
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    return stopped.step + STEPS_AFTER_STOP


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, final_step: int) -> Finished:
    """The uninterrupted run, with the same spike: the state every interrupted run must end in."""
    tmp = tmp_path_factory.mktemp("reference")
    done = run_supervisor(gpt_job(tmp, faults=SPIKE, steps=final_step), tmp / "run", timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_spike_under_amp_is_skipped_on_both_ranks_and_the_scaler_is_checkpointed(
    reference: Finished, final_step: int
) -> None:
    """The uninterrupted run skips the spiked batch on both ranks (one extra batch read), saves the GradScaler's
    state with the model, and its metrics end with the line written after the training loop."""
    run_dir = reference.run_dir
    status = reference.status()
    assert (status["state"], status["restarts"], status["last_checkpoint"]) == ("finished", 0, {"step": final_step})
    assert_spike_skipped_once(run_dir)
    for rank in (0, 1):
        state = final_state(run_dir, rank, final_step)
        assert state["data_position"] == final_step + 1  # the skipped batch is consumed too
        scale = state["extra_state"]["scaler"]["scale"]
        assert isinstance(scale, float) and 0 < scale < float("inf")
    assert last_metrics_line(run_dir.parent) == {"event": "finished", "step": final_step}


def test_a_stop_in_the_relaunched_attempt_exits_0_after_the_code_past_the_loop(stopped: Stopped) -> None:
    """After the kill and the relaunch from 70, the stop saves at the step it ordered and exits 0, and the script's
    code after its training loop ran: the metrics file ends with its `finished` line."""
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert (stopped.status["state"], stopped.status["restarts"]) == ("stopped", 1)
    # the save of 70 (snapshots in memory by default): its pin persisted by then, or the kill was first
    assert stopped.status["resumed_from"] in ({"step": 70}, {"step": 70, "source": "memory"})
    events = journal(stopped.run_dir)
    assert [(e["rank"], e["returncode"]) for e in events if e["event"] == "rank_crashed"] == [(1, -signal.SIGKILL)]
    (ordered,) = [e for e in events if e["event"] == "stop_ordered"]
    assert stopped.step == ordered["step"] > KILL_STEP
    assert stopped.status["last_checkpoint"] == {"step": stopped.step}
    assert stopped.metrics_tail == {"event": "finished", "step": stopped.step}
    assert_spike_skipped_once(stopped.run_dir)


def test_a_rerun_after_the_kill_and_the_stop_ends_bitwise_equal_to_the_uninterrupted_run(
    stopped: Stopped, reference: Finished, final_step: int
) -> None:
    """The rerun resumes from the stop's checkpoint and ends with model, optimizer, scheduler, scaler, RNG, data
    position and spike history bitwise equal to the uninterrupted run's, on both ranks."""
    (stopped.run_dir / "stop").unlink()  # the stop file stays until someone removes it: a rerun would not start
    config = gpt_job(stopped.tmp, faults=f"{SPIKE},1:sigkill@{KILL_STEP}", steps=final_step)
    rerun = run_supervisor(config, stopped.run_dir, timeout=120)

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    status = rerun.status()
    assert (status["state"], status["resumed_from"], status["last_checkpoint"]) == (
        "finished",
        {"step": stopped.step},
        {"step": final_step},
    )
    assert last_metrics_line(stopped.tmp) == {"event": "finished", "step": final_step}
    for rank in (0, 1):
        got, want = final_state(stopped.run_dir, rank, final_step), final_state(reference.run_dir, rank, final_step)
        for part in COMPARED:
            assert_bitwise_equal(got[part], want[part], f"rank {rank} {part}")
