"""Re-running a step that alarmed (worker.rerun), with real ranks over gloo: a one-off bit flip is transient and the
run goes on as if it never happened, bitwise (a flip that recurs on its rank, persistent: tests/e2e/test_bad_device.py);
a batch that spikes
wherever it is trained is the data's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.launch.ranks import free_port
from tests.e2e.conftest import REPO

RANKS = """
import hashlib, json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from worker import Warden
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 2))
ddp = DistributedDataParallel(model)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
warden = Warden(ddp, optimizer)
torch.manual_seed(1 + rank)  # dropout differs per rank: a partner re-runs a suspect's batch with its random state

def batch(index, owner):
    data = torch.Generator().manual_seed(index * 100 + owner)
    return torch.randn(8, 8, generator=data), torch.randn(8, 2, generator=data)

def loss_of(owner):
    x, y = batch(warden.batches, owner)
    return torch.nn.functional.mse_loss(ddp(x), y)

for _ in warden.steps(8):
    optimizer.zero_grad()
    loss = loss_of(rank)
    loss.backward()
    if warden.guard_step(loss.item(), recompute=loss_of):
        optimizer.step()
    warden.step_done(loss=loss.item())
    if warden.batches == 7:
        break
state = repr([p.detach().flatten().tolist() for p in model.parameters()])  # exact: float32 -> float's repr; no NumPy
print(hashlib.sha256(state.encode()).hexdigest())
dist.destroy_process_group()
"""


def run_ranks(run_dir: Path, faults: str = "", code: int = 0, **more: str) -> str:
    """Two ranks train up to batch 7 (saving every 2 steps); rank 0's final parameters' hash, or "" when they are to
    exit with another `code`. `more`: variables."""
    env = {
        **os.environ,
        **more,
        "TRAINWARDEN_WORKER_CONFIG": json.dumps({"save_checkpoint_steps": 2}),
        "TRAINWARDEN_RUN_DIR": str(run_dir),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_FAULTS": faults,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == code, err[-3000:]
            outs.append(out.split()[-1] if code == 0 else "")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    assert outs[0] == outs[1]  # data parallel: every rank holds the same parameters
    return outs[0]


def events(run_dir: Path, rank: int, name: str, attempt: int = 0) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name and e["attempt"] == attempt]


@pytest.mark.timeout(120)
def test_a_one_off_bit_flip_is_transient_and_the_run_goes_on_bitwise_as_without_it(tmp_path: Path) -> None:
    """Rank 1's gradient gets a bit flipped once, at step 5: the re-run on rank 1 does not reproduce it, so the
    step is applied with the re-run's gradients, and the run ends with the parameters of a run without the fault."""
    clean = run_ranks(tmp_path / "clean")
    flipped = run_ranks(tmp_path / "flipped", faults="1:bitflip@5")
    for rank in range(2):
        (verdict,) = events(tmp_path / "flipped", rank, "sdc_verdict")
        assert (verdict["step"], verdict["suspect"], verdict["verdict"]) == (5, 1, "transient"), verdict
        assert events(tmp_path / "flipped", rank, "step_skipped") == []
    assert events(tmp_path / "clean", 0, "sdc_verdict") == []
    assert flipped == clean


@pytest.mark.timeout(120)
def test_a_poisoned_batch_is_the_datas_skipped_once_and_again_after_a_resume_without_a_re_run(tmp_path: Path) -> None:
    """`1:poison@5`: rank 1's batch 4 spikes the loss on whichever rank computes it; rank 0 re-runs it and gets the
    same: the data's, skipped, and listed. Resumed from step 2, the run meets batch 4 again and skips it from the
    list, with no re-run and no new verdict, and ends with the same parameters as the first run."""
    first = run_ranks(tmp_path, faults="1:poison@5")
    for rank in range(2):
        (verdict,) = events(tmp_path, rank, "sdc_verdict")
        assert (verdict["batch"], verdict["suspect"], verdict["verdict"]) == (4, 1, "data"), verdict
        (skipped,) = events(tmp_path, rank, "step_skipped")
        assert (skipped["batch"], skipped["reasons"]) == (4, ["sdc_data"])
        listed = json.loads((tmp_path / "ranks" / f"rank_{rank}" / "skip_list.json").read_text())
        assert listed == {"batches": [{"batch": 4, "step": 5, "ranks": [1]}]}
    assert [e["kind"] for e in events(tmp_path, 1, "fault_injected")] == ["poison"]

    again = run_ranks(tmp_path, faults="1:poison@5", TRAINWARDEN_ATTEMPT="1", TRAINWARDEN_RESUME_STEP="2")
    for rank in range(2):
        assert events(tmp_path, rank, "resumed", attempt=1)[0]["step"] == 2
        assert events(tmp_path, rank, "sdc_verdict", attempt=1) == []
        (skipped,) = events(tmp_path, rank, "step_skipped", attempt=1)
        assert skipped["batch"] == 4 and skipped["reasons"][-1] == "skip_list"
    assert again == first
