"""Per-rank fingerprints from before DDP's reduction, or FSDP2's (worker.fingerprint), exchanged in the step guard's
all-reduce: real ranks over gloo name the rank whose own gradient stood out, and only it."""

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
from worker.sharded import numpy_missing

RANKS = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from worker import Warden
mode = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
if mode == "fsdp":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0])
    ddp = fully_shard(model)
else:
    ddp = DistributedDataParallel(model)
if mode == "own hook":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp.register_comm_hook(None, allreduce_hook)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
warden = Warden(ddp, optimizer)
local = {}
for step in warden.steps(8):
    data = torch.Generator().manual_seed(warden.batches * 100 + rank)
    x, y = torch.randn(8, 8, generator=data), torch.randn(8, 2, generator=data)
    if mode == "data" and rank == 1 and step == 4:
        x = x * 1000  # a batch unlike the others: this rank's own gradient stands out, no fault
    if mode != "fsdp":
        with ddp.no_sync():  # this rank's own gradient, for the test to compare with
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            local[step] = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    recompute = (lambda owner: torch.nn.functional.mse_loss(ddp(x), y)) if mode == "fsdp" else None
    if warden.guard_step(loss.item(), recompute=recompute):
        optimizer.step()
    warden.step_done(loss=loss.item())
warden.finish()
print(json.dumps(local))
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, mode: str, ranks: int, faults: str = "") -> list[dict[str, float]]:
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "WORLD_SIZE": str(ranks),
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_FAULTS": faults,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS, mode],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    local = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            local.append(json.loads(out.splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    return local


def events(run_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "ranks" / f"rank_{rank}" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


@pytest.mark.timeout(120)
def test_a_bit_flipped_before_the_reduction_names_its_rank_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's gradient gets bit 30 flipped at step 5, before DDP averages it into every rank's: each of the three
    ranks names rank 1, at step 5 only, and skips the step (the average overflowed)."""
    run_ranks(tmp_path, "bitflip", 3, faults="1:bitflip@5")
    assert [e["kind"] for e in events(tmp_path, 1, "fault_injected")] == ["bitflip"]
    for rank in range(3):
        (named,) = events(tmp_path, rank, "ranks_stood_out")
        assert (named["step"], named["ranks"], named["anomaly"]) == (5, [1], True), named
        assert "local gradient norm" in named["why"][0]
        assert [e["step"] for e in events(tmp_path, rank, "step_skipped")] == [5]


@pytest.mark.timeout(120)
@pytest.mark.skipif(numpy_missing(), reason="an FSDP2 model's checkpoints are DCP's, whose collectives need NumPy")
def test_fsdp2_fingerprints_its_reduce_scatter_input_and_names_the_flipped_rank_without_a_re_run(
    tmp_path: Path,
) -> None:
    """FSDP2 (`fully_shard`): the reduce-scatter's input, each rank's whole gradient from its own batch, is
    fingerprinted before the reduction; rank 1's flipped bit at step 5 is named by all three ranks. A partner cannot
    compute another rank's batch alone (the forward gathers parameters from every rank): no re-run, said once."""
    run_ranks(tmp_path, "fsdp", 3, faults="1:bitflip@5")
    for rank in range(3):
        assert events(tmp_path, rank, "fingerprints_off") == []
        (named,) = events(tmp_path, rank, "ranks_stood_out")
        assert (named["step"], named["ranks"]) == (5, [1]), named
        (off,) = events(tmp_path, rank, "reruns_off")
        assert "FSDP2" in off["why"]
        assert events(tmp_path, rank, "sdc_verdict") == []


@pytest.mark.timeout(120)
def test_the_fingerprint_is_the_ranks_own_gradient_from_before_the_reduction(tmp_path: Path) -> None:
    """No fault: rank 1 trains a batch unlike its peer's at step 4. It is named with its own gradient's norm, as
    the rank computed it alone, not the average every rank holds after the reduction."""
    local = run_ranks(tmp_path, "data", 2)
    for rank in range(2):
        (named,) = events(tmp_path, rank, "ranks_stood_out")
        assert (named["step"], named["ranks"]) == (4, [1])
        assert f"local gradient norm {local[1]['4']:.6g} stands out" in named["why"][0]


@pytest.mark.timeout(120)
def test_a_ddp_hook_of_the_scripts_own_is_left_alone_and_said(tmp_path: Path) -> None:
    """A script that registered its own communication hook keeps it; the Warden says fingerprints are off and why;
    a bit flip then goes unfingerprinted (bitflip faults strike in the fingerprinting hook)."""
    run_ranks(tmp_path, "own hook", 2, faults="1:bitflip@3")
    for rank in range(2):
        (off,) = events(tmp_path, rank, "fingerprints_off")
        assert "wrap it in worker.fingerprinted()" in off["why"]
        assert events(tmp_path, rank, "ranks_stood_out") == []
