"""`snapshot_steps: auto` in real loops: a measured first snapshot, the interval said (`cadence_chosen`), and every
rank snapshotting at the same steps although each measures and proposes its own interval. `auto` snapshots to
memory only: without a memory directory it is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.launch.ranks import free_port
from worker.contract import ENV_FAILURES, ENV_MEMORY_DIR, RunLayout, WorkerConfig
from worker.memory import create_memory_dir

REPO = Path(__file__).resolve().parents[2]
AUTO = WorkerConfig(save_checkpoint_steps=20, snapshot_steps="auto")


def events(run_dir: Path, rank: int, name: str) -> list[dict]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def snapshot_steps(run_dir: Path, rank: int) -> list[int]:
    """The steps this rank saved into a memory slot."""
    return [e["step"] for e in events(run_dir, rank, "snapshot_saved")]


def memory_dir(tmp_path: Path) -> Path:
    """A memory directory as the supervisor makes one (a private folder: tmpfs or not, the worker cannot tell)."""
    return create_memory_dir(tmp_path / "memory")


def test_auto_measures_a_snapshot_at_the_second_step_and_says_the_interval_chosen(
    loop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first snapshots come at steps 2, 4, 6 (the first step pays the warm-up); their stalls set an interval
    within [1, the disk interval], said with the failures the supervisor counted; snapshots alternate slots."""
    monkeypatch.setenv(ENV_FAILURES, "3/400.0")
    memory = memory_dir(tmp_path)
    monkeypatch.setenv(ENV_MEMORY_DIR, str(memory))
    run = loop(config=AUTO)
    for _ in range(12):
        run.train_batch()
    chosen = events(tmp_path, 0, "cadence_chosen")
    assert chosen[0]["step"] == 6
    assert 1 <= chosen[0]["interval_steps"] <= 20
    assert chosen[0]["failures"] == 3 and chosen[0]["reason"]
    assert 1000.0 <= chosen[0]["mtbf_s"] <= 1010.0  # (3600 s prior + 400 s) / 4, and the seconds since
    steps = snapshot_steps(tmp_path, 0)
    assert steps[:3] == [2, 4, 6]
    layout = RunLayout(tmp_path, memory=memory)
    assert layout.memory_slot(0).steps(0, "ckpt") | layout.memory_slot(1).steps(0, "ckpt") == set(steps[-2:])
    assert steps[-1] in layout.memory_slot(len(steps[:-1]) % 2).steps(0, "ckpt")  # slot 0, 1, 0, ... in turn


def test_auto_without_a_memory_directory_takes_no_snapshot(loop, tmp_path: Path) -> None:
    """No supervisor gave a memory directory (a plain torchrun): `auto` is off; the disk saves go on as set."""
    run = loop(config=AUTO)
    for _ in range(21):
        run.train_batch()
    assert events(tmp_path, 0, "snapshot_saved") == events(tmp_path, 0, "cadence_chosen") == []
    assert [e["step"] for e in events(tmp_path, 0, "checkpoint_saved")] == [20]
    assert not (tmp_path / "snapshot").exists()


RANKS = """
import sys, torch, torch.distributed as dist
from worker import Warden
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
warden = Warden(model, optimizer)
guarded = sys.argv[1] == "guarded"
for _ in warden.steps(26):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).square().mean()
    loss.backward()
    if not guarded or warden.guard_step(loss.detach()):
        optimizer.step()
    warden.step_done(loss=loss.item())
warden.finish()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_ranks_proposing_different_intervals_snapshot_at_the_same_steps(tmp_path: Path, mode: str) -> None:
    """Rank 1 is told of many failures (an interval of 1 step), rank 0 of none (a long one): both take the lowest,
    agreed through guard_step's all-reduce (or, without guard_step, one of their own every 10 steps)."""
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"save_checkpoint_steps": 20, "snapshot_steps": "auto"}),
        ENV_MEMORY_DIR: str(memory_dir(tmp_path)),
    }
    failures = {0: "0/0.0", 1: "100000000/1.0"}  # rank 1: a failure every 36 µs
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS, mode],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), ENV_FAILURES: failures[rank]},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    assert events(tmp_path, 1, "cadence_chosen")[0]["interval_steps"] == 1
    assert events(tmp_path, 0, "cadence_chosen")[0]["interval_steps"] > 1
    steps = snapshot_steps(tmp_path, 0)
    assert steps == snapshot_steps(tmp_path, 1)
    agreed_from = 6 if mode == "guarded" else 10  # the first agreement after the measurements at 2, 4, 6
    assert [s for s in steps if s > agreed_from] == [s for s in range(agreed_from + 1, 27) if s != 20]
