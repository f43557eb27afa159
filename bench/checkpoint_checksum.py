"""Checkpoint save time with and without the streamed checksum, on a checkpoint of a few hundred MB.

Both variants write the same state dict with `torch.save` into a file and fsync it; the checksummed one
goes through `worker.checkpoint.HashingWriter` (CRC-32 over the bytes as they are written), which is how
the worker library saves. Runs alternate so drift on the machine hits both alike; prints the medians and
the ratio. Run: .venv/bin/python bench/checkpoint_checksum.py [--mb 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.checkpoint import HashingWriter


def save(state: dict[str, Any], path: Path, *, checksum: bool) -> float:
    started = time.perf_counter()
    with open(path, "wb") as f:
        target = HashingWriter(f) if checksum else f
        torch.save(state, target)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="checkpoint size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tensors = args.mb * 2**20 // (4 * 2**20)  # 4 MB float32 tensors, like the layers of a small model
    state = {f"layer{i}.weight": torch.randn(2**20) for i in range(tensors)}
    plain, hashed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            plain.append(save(state, Path(tmp) / "plain.ckpt", checksum=False))
            hashed.append(save(state, Path(tmp) / "hashed.ckpt", checksum=True))
    p, h = statistics.median(plain), statistics.median(hashed)
    print(f"checkpoint: {tensors * 4} MB in {tensors} tensors; {args.repeats} saves each, alternating, with fsync")
    print(
        f"torch.save:                   {p:.2f} s median ({min(plain):.2f}-{max(plain):.2f}), "
        f"{tensors * 4 / p:.0f} MB/s"
    )
    print(
        f"torch.save + streamed CRC-32: {h:.2f} s median ({min(hashed):.2f}-{max(hashed):.2f}), "
        f"{tensors * 4 / h:.0f} MB/s"
    )
    print(f"ratio checksummed/plain: {h / p:.2f}")


if __name__ == "__main__":
    main()
