"""What a checkpoint save costs the training loop: sharded (DCP) saves, synchronous against asynchronous.

FSDP2 models of about 64 MB and 512 MB of float32 parameters (a stack of square Linear layers, `fully_shard` per
layer; AdamW adds twice that in state) train on 2 and 4 gloo ranks of this machine under the worker library
(`worker.checkpoint_format: dcp`, durable writes: every file and directory fsynced). For each size and world size:
- sync: the training thread's stall per save with `async_save: false` (the whole write): the baseline;
- async: the stall per save with `async_save: true` (the staging copy), median and max;
- steps/s while a background write runs, against steps/s with none;
- resume time from the last checkpoint at the same world size and at half of it (resharded).
Then, for the smallest model on 2 ranks, DCP's own `async_save` with its two executors (thread and process, the
choice the worker made for the thread), called directly: the stall per save, first and median; and saves due faster
than they are written (each background write stretched OVERLAP_WRITE_S by the `slow_async_write` fault, one step
between saves): the stall per save and the part of it spent waiting for the previous write (`waited_s`), against
the async stall without overlap.
The last line is `training-thread stall per save, async / sync: R`, the median over the configurations of
median async stall / median sync stall (the target is R <= 0.25).

Run from the repository root (NumPy needed: `pip install -e '.[dcp]'`):
    .venv/bin/python bench/checkpoint_stall.py [--quick]      # --quick: 64 MB only, under 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SIZES_MB = (64, 512)
WORLDS = (2, 4)
SAVES = 3
WIDTH = {64: 2048, 512: 4096}  # a square Linear of WIDTH^2 float32 weights: 16 MB at 2048, 64 MB at 4096
BATCH = 4
OVERLAP_SAVES = 4  # the first does not wait; the others wait for the write before them
OVERLAP_WRITE_S = 2.0  # longer than a write and a step on 2 busy cores: every save after the first waits


def layers_for(size_mb: int) -> int:
    return max(1, size_mb * 2**20 // (4 * WIDTH[size_mb] ** 2))


def rank_main(size_mb: int, mode: str, out: Path) -> None:
    """One rank: train, save SAVES times (timing the loop's stall and the steps around each write), or resume."""
    import torch
    import torch.distributed as dist

    from worker import Warden
    from worker.contract import WorkerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode.startswith("dcp-"):
        dcp_executor(size_mb, mode.removeprefix("dcp-"), out)
        return
    model, optimizer = build(size_mb)
    config = WorkerConfig(
        checkpoint_format="dcp", async_save=mode in ("async", "overlap"), save_checkpoint_steps=10**9, prefix="bench"
    )  # saves only where the benchmark calls warden.save
    warden = Warden(model, optimizer, config=config)
    started = time.perf_counter()
    warden.resume()
    result: dict[str, Any] = {"resume_s": time.perf_counter() - started}
    if mode == "overlap":
        result.update(overlap_saves(warden, model, optimizer, WIDTH[size_mb]))
    elif mode != "resume":
        result.update(train_and_save(warden, model, optimizer, WIDTH[size_mb]))
    warden.finish(save=False)
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def build(size_mb: int) -> tuple[Any, Any]:
    """The FSDP2 model of `size_mb` (every rank initialised alike) and its AdamW."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(WIDTH[size_mb], WIDTH[size_mb], bias=False) for _ in range(layers_for(size_mb)))
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def dcp_executor(size_mb: int, kind: str, out: Path) -> None:
    """DCP's async_save with its `kind` executor, as a script of its own would call it: the stall per save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, optimizer = build(size_mb)
    model(torch.randn(BATCH, WIDTH[size_mb])).square().mean().backward()
    optimizer.step()  # the optimizer's state exists from here on
    executor = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    stalls, written = [], []
    for i in range(SAVES):
        begun = time.perf_counter()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        future = dcp.async_save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=out.parent / f"dcp-{kind}-{i}",
            async_checkpointer_type=executor,
        )
        stalls.append(time.perf_counter() - begun)
        future.result(timeout=600)
        written.append(time.perf_counter() - begun)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"stalls": stalls, "written": written}))
    dist.destroy_process_group()


def train_step(warden: Any, model: Any, optimizer: Any, width: int) -> float:
    """One training step under the warden; its seconds."""
    import torch

    begun = time.perf_counter()
    optimizer.zero_grad()
    loss = model(torch.randn(BATCH, width)).square().mean()
    loss.backward()
    warden.guard_step(loss.detach())
    optimizer.step()
    warden.step_done(loss=loss.item())
    return time.perf_counter() - begun


def overlap_saves(warden: Any, model: Any, optimizer: Any, width: int) -> dict[str, Any]:
    """Save, train one step, save again, OVERLAP_SAVES times, each write stretched (the launch's faults): the stall
    per save, and `waited_s` of each from the rank's `checkpoint_staged` events."""
    for _ in range(2):  # warm-up: the optimizer's state exists from here on
        train_step(warden, model, optimizer, width)
    stalls = []
    for _ in range(OVERLAP_SAVES):
        begun = time.perf_counter()
        warden.save(warden.step)
        stalls.append(time.perf_counter() - begun)
        train_step(warden, model, optimizer, width)
    warden._note_background_save(wait=True)
    lines = warden.layout.rank_events(warden.rank).read_text().splitlines()
    waited = [e["waited_s"] for e in map(json.loads, lines) if e["event"] == "checkpoint_staged"]
    return {"stalls": stalls, "waited": waited}


def train_and_save(warden: Any, model: Any, optimizer: Any, width: int) -> dict[str, Any]:
    def step() -> float:
        return train_step(warden, model, optimizer, width)

    for _ in range(2):  # warm-up: the optimizer's state exists from here on
        step()
    quiet = [step() for _ in range(4)]
    stalls, busy = [], []
    for _ in range(SAVES):
        begun = time.perf_counter()
        warden.save(warden.step)
        stalls.append(time.perf_counter() - begun)
        while warden._sharded.in_flight is not None:  # steps while the background write runs
            busy.append(step())
        warden._note_background_save(wait=True)
        step()
    return {"stalls": stalls, "quiet_steps_s": quiet, "busy_steps_s": busy}


def launch(world: int, size_mb: int, mode: str, run_dir: Path) -> dict[str, Any]:
    """`world` ranks of this script on this machine in `run_dir`; rank 0's result."""
    out = run_dir / f"result-{mode}-{world}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "TRAINWARDEN_RUN_DIR": str(run_dir),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    if mode == "overlap":  # the write of every save (at steps 2, 3, ...) takes OVERLAP_WRITE_S longer on every rank
        faults = (
            f"{r}:slow_async_write@{2 + i}:{OVERLAP_WRITE_S:g}" for r in range(world) for i in range(OVERLAP_SAVES)
        )
        env["TRAINWARDEN_FAULTS"] = ",".join(faults)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(size_mb), mode, str(out)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world)
    ]
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"a rank of {mode} at {world} ranks, {size_mb} MB exited {proc.returncode}")
    return json.loads(out.read_text())


def measure(size_mb: int, world: int, scratch: Path) -> dict[str, float]:
    sync_dir, async_dir = scratch / f"sync-{size_mb}-{world}", scratch / f"async-{size_mb}-{world}"
    sync = launch(world, size_mb, "sync", sync_dir)
    asynchronous = launch(world, size_mb, "async", async_dir)
    same = launch(world, size_mb, "resume", async_dir)
    half = launch(world // 2, size_mb, "resume", async_dir)
    quiet, busy = asynchronous["quiet_steps_s"], asynchronous["busy_steps_s"] or [float("nan")]
    return {
        "sync_s": statistics.median(sync["stalls"]),
        "async_s": statistics.median(asynchronous["stalls"]),
        "async_max_s": max(asynchronous["stalls"]),
        "quiet_steps_per_s": 1 / statistics.median(quiet),
        "busy_steps_per_s": 1 / statistics.median(busy),
        "resume_same_s": same["resume_s"],
        "resume_half_s": half["resume_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MB models only (under 5 minutes on 2 cores)")
    args = parser.parse_args()
    sizes = SIZES_MB[:1] if args.quick else SIZES_MB
    print(
        f"sharded checkpoints (DCP, fsynced), FSDP2 over gloo, {os.cpu_count()} cores; model size = float32 "
        f"parameters (AdamW state is twice that); {SAVES} saves each",
        flush=True,
    )
    print(
        f"{'model':>6} {'ranks':>5} {'sync save':>10} {'async stall':>12} {'async max':>10} {'R':>6} "
        f"{'steps/s idle':>12} {'while writing':>13} {'resume same':>12} {'resume half':>12}",
        flush=True,
    )
    ratios, first = [], None
    with tempfile.TemporaryDirectory(prefix="checkpoint_stall-") as scratch:
        for size_mb in sizes:
            for world in WORLDS:
                m = measure(size_mb, world, Path(scratch))
                first = first or m
                ratios.append(m["async_s"] / m["sync_s"])
                print(
                    f"{size_mb:>4}MB {world:>5} {m['sync_s']:>9.3f}s {m['async_s']:>11.3f}s "
                    f"{m['async_max_s']:>9.3f}s {ratios[-1]:>6.3f} {m['quiet_steps_per_s']:>12.2f} "
                    f"{m['busy_steps_per_s']:>13.2f} {m['resume_same_s']:>11.3f}s {m['resume_half_s']:>11.3f}s",
                    flush=True,
                )
        executors = {
            kind: launch(2, sizes[0], f"dcp-{kind}", Path(scratch) / f"dcp-{kind}") for kind in ("thread", "process")
        }
        overlap = launch(2, sizes[0], "overlap", Path(scratch) / "overlap")
    for kind, got in executors.items():
        stalls, written = got["stalls"], got["written"]
        print(
            f"DCP's own async_save, {kind} executor ({sizes[0]} MB, 2 ranks): stall per save first "
            f"{stalls[0]:.3f} s, median {statistics.median(stalls):.3f} s; written after first {written[0]:.3f} s, "
            f"median {statistics.median(written):.3f} s",
            flush=True,
        )
    assert first is not None
    waiting = overlap["stalls"][1:]  # the first save has nothing in flight before it
    print(
        f"saves due faster than written ({sizes[0]} MB, 2 ranks, each write {OVERLAP_WRITE_S:g} s longer "
        f"(slow_async_write), one step between saves): stall per save median {statistics.median(waiting):.3f} s, "
        f"of which waited for the previous write {statistics.median(overlap['waited'][1:]):.3f} s; without overlap "
        f"{first['async_s']:.3f} s, sync save {first['sync_s']:.3f} s",
        flush=True,
    )
    print(f"training-thread stall per save, async / sync: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        main()
