"""Flight recorder cost: what PyTorch's flight recorder (`TORCH_FR_BUFFER_SIZE`) adds to each collective, and
what one dump costs, measured on gloo in one invocation (recorder off, then on, alternating).

Each measurement starts a fresh process (the buffer size is read once per process) that times N all-reduces of 8
floats in a gloo group of one rank after a warm-up: with no peer to wait for, the time is the collective's own CPU
path, where the recorder's bookkeeping shows (with peers it is the same work, hidden in the network wait). With the
recorder on, it also times `_dump_fr_trace_json` with the buffer full. The per-step cost is the per-collective
difference times the collectives one demo step issues (COLLECTIVES_PER_STEP), and its share of a 50 ms step. Run
from the repository root:
    .venv/bin/python bench/flight_recorder_cost.py [--collectives N] [--repeats R] [--sizes 0,2000,20000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

COLLECTIVES_PER_STEP = 3  # the demo: DDP's bucket all-reduce(s) and the step guard's all-reduce
STEP_S = 0.050


def worker(rank: int, port: int, collectives: int) -> None:
    """One rank: time `collectives` small all-reduces, then (recorder on) one dump; prints JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    tensor = torch.ones(8)
    for _ in range(2500):  # warm-up, and more than the smaller buffer holds: the ring is full while timed
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(collectives):
        dist.all_reduce(tensor)
    per_collective_us = (time.perf_counter() - started) / collectives * 1e6
    dump_ms = None
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0:
        started = time.perf_counter()
        text = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
        dump_ms = (time.perf_counter() - started) * 1e3
        entries = len(json.loads(text)["entries"])
    dist.destroy_process_group()
    if rank == 0:
        print(
            json.dumps(
                {
                    "per_collective_us": per_collective_us,
                    "dump_ms": dump_ms,
                    "entries": entries if dump_ms is not None else 0,
                }
            )
        )


def measure(size: int, collectives: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE=str(size), OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, "--worker"]
    ranks = [
        subprocess.Popen(
            [*argv, "0", str(port), str(collectives)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    ]
    out = [p.communicate(timeout=300)[0] for p in ranks]
    return json.loads(out[0].strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="0,2000,20000")
    parser.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"cores: {os.cpu_count()}; a gloo group of 1 rank, {args.collectives} all-reduces of 8 floats each, "
        f"{args.repeats} repeats per buffer size, interleaved",
        flush=True,
    )
    results: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    for repeat in range(args.repeats):
        for size in sizes:
            got = measure(size, args.collectives)
            results[size].append(got)
            dump = "" if got["dump_ms"] is None else f", dump of {got['entries']} entries {got['dump_ms']:.1f} ms"
            print(
                f"  repeat {repeat + 1} buffer {size}: {got['per_collective_us']:.1f} us per all-reduce{dump}",
                flush=True,
            )
    base = statistics.median(r["per_collective_us"] for r in results[sizes[0]])
    print(
        f"{'buffer':>8} {'us/all-reduce':>14} {'+us vs ' + str(sizes[0]):>12} {'+us/step':>9} "
        f"{'share of 50 ms step':>20} {'dump ms':>8}"
    )
    for size in sizes:
        per = statistics.median(r["per_collective_us"] for r in results[size])
        dumps = [r["dump_ms"] for r in results[size] if r["dump_ms"] is not None]
        extra = per - base
        step = extra * COLLECTIVES_PER_STEP
        dump = f"{statistics.median(dumps):.1f}" if dumps else "-"
        print(f"{size:>8} {per:>14.1f} {extra:>12.1f} {step:>9.1f} {step / (STEP_S * 1e6):>20.3%} {dump:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
