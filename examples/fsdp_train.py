"""The GPT example sharded with FSDP2: `fully_shard` per block, a mixed-precision policy, AdamW, and sharded
(torch.distributed.checkpoint) saves written in the background while training goes on.

The checkpoints are resumable at another world size: the data is addressed by a global sample count
(`warden.samples`), so a run that goes on with fewer or more ranks neither skips a sample nor sees one twice.
Each rank takes `--batch-size` samples per step: sample ids `samples + rank`, `samples + rank + world`, ...

Run it under the supervisor from the repository root (NumPy needed: `pip install -e '.[dcp]'`):
    trainwarden run examples/fsdp.yaml
    trainwarden run examples/fsdp.yaml --set nproc_per_node=2     # the same run dir goes on with 2 ranks
Deterministic given `--seed` at a fixed world size: a run killed, hung or stopped and resumed ends bitwise equal to
an uninterrupted one (compare `trainwarden export` files). After a change of world size it is not bitwise: the
gradient reductions add in another order and every rank's RNG stream is derived anew (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys

import torch
import torch.distributed as dist
from gpt_train import GPT, GPTConfig, configure_optimizer, load_text, seed_of, warmup_cosine
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from worker import Warden, run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--block", type=int, default=64, help="context length in characters")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--lr-decay-steps", type=int, help="length of the cosine decay; default: --steps")
    parser.add_argument(
        "--param-dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="FSDP2's compute dtype for parameters (gradients are reduced in float32)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: NCCL, one GPU per rank (LOCAL_RANK), deterministic kernels for exact resume",
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--samples-file", help="rank 0 appends each applied step's sample ids here (JSON lines)")
    return parser.parse_args()


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> GPT:
    """The GPT example's model, initialised alike on every rank, sharded block by block, then as a whole."""
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size, args.block, args.n_layer, 4, args.n_embd, dropout=0.1)).to(device)
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype], reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # embeddings, the final norm and the tied head
    return model


def batch_of(data: torch.Tensor, ids: list[int], *, seed: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of sample `ids`: sample i always starts at the same place, whichever rank reads it."""
    starts = [
        int(
            torch.randint(
                0, len(data) - block - 1, (1,), generator=torch.Generator().manual_seed(seed_of(seed, "sample", i))
            )
        )
        for i in ids
    ]
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


def use_device(name: str) -> torch.device:
    """The rank's device and process group: gloo on CPU; NCCL on its GPU, with deterministic kernels (cuBLAS's
    fixed workspace, the math attention kernel) so that a resumed run stays bitwise equal to an uninterrupted one."""
    if name == "cpu":
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=device)
    return device


def main() -> None:
    args = parse_args()
    device = use_device(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_data, _, vocab_size = load_text()
    model = build_model(args, vocab_size, device)
    optimizer = configure_optimizer(model, lr=args.lr, weight_decay=0.1)
    schedule = warmup_cosine(warmup=20, total=args.lr_decay_steps or args.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    torch.manual_seed(args.seed + 1 + rank)  # dropout differs per rank; Warden saves every rank's RNG state
    random.seed(args.seed + rank)
    global_batch = args.batch_size * world
    warden = Warden(model, optimizer, scheduler, global_batch_size=global_batch)  # DTensors: sharded checkpoints
    log = open(args.samples_file, "a") if args.samples_file and rank == 0 else None  # noqa: SIM115

    for _ in warden.steps(args.steps):
        ids = list(range(warden.samples, warden.samples + global_batch))
        x, y = (t.to(device) for t in batch_of(train_data, ids[rank::world], seed=args.seed, block=args.block))
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if warden.guard_step(loss.detach(), max_norm=1.0):
            optimizer.step()
            scheduler.step()
        if warden.step_done(loss=loss.item(), lr=scheduler.get_last_lr()[0]) and log is not None:
            log.write(json.dumps({"step": warden.step, "ids": ids}) + "\n")
            log.flush()
        if rank == 0 and warden.step % 50 == 0:
            print(f"step {warden.step}/{args.steps} loss {loss.item():.4f} ranks {world}", flush=True)
    warden.finish()  # waits for a save in flight: the final checkpoint is complete when the rank exits
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    run(main)  # recovery in place: after a peer rank fails, main runs again in this process (worker/recovery.py)
