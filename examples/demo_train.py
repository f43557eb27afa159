"""Demo job: a tiny character-level transformer learns Shakespeare's sonnets with DDP over gloo.

Run it under the supervisor (`trainwarden run configs/demo.yaml`) or under torchrun; it is
deterministic given `--seed`, so an interrupted and resumed run ends bitwise equal to an
uninterrupted one. Fault injection: see `worker/faults.py` (`TRAINWARDEN_FAULTS`).
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from worker import Warden, run
from worker.exact import average_gradients_in_rank_order

TEXT = Path(__file__).parent / "data" / "sonnets.txt"


class CharTransformer(nn.Module):
    """A small pre-norm causal transformer over characters."""

    def __init__(self, vocab: int, *, d_model: int, n_head: int, n_layer: int, block: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def batch_for(data: torch.Tensor, *, index: int, rank: int, seed: int, batch: int, block: int):
    """Batch number `index` on `rank`: a pure function of its arguments, so resuming needs only the index."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 1_009 + rank)
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, *, vocab: int, seed: int, block: int) -> float:
    """Mean loss on fixed held-out batches; uses no RNG state and leaves the model in training mode."""
    model.eval()
    x, y = batch_for(data, index=-1, rank=0, seed=seed, batch=32, block=block)
    loss = nn.functional.cross_entropy(model(x).view(-1, vocab), y.view(-1)).item()
    model.train()
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-every", type=int, default=100, help="evaluate on held-out batches every N steps")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank; also keeps CPU kernels deterministic
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    text = TEXT.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = CharTransformer(len(vocab), d_model=64, n_head=4, n_layer=2, block=args.block)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)  # the only buffer is a constant mask
    average_gradients_in_rank_order(ddp)  # bitwise-exact resume with 3+ ranks too (worker/exact.py says why)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    torch.manual_seed(args.seed + 1 + rank)  # distinct dropout masks per rank
    random.seed(args.seed + rank)
    if "numpy" in sys.modules:  # torch loads NumPy where it is installed; its RNG is saved too, so it must be seeded
        sys.modules["numpy"].random.seed(args.seed + rank)

    warden = Warden(ddp, optimizer, scheduler, global_batch_size=args.batch_size * dist.get_world_size())

    def loss_of(owner: int) -> torch.Tensor:
        """The loss of the batch rank `owner` trains at this step: here, and again in a re-run (worker/rerun.py)."""
        index, size = warden.batches, args.batch_size
        x, y = batch_for(data, index=index, rank=owner, seed=args.seed, batch=size, block=args.block)
        return nn.functional.cross_entropy(ddp(x).view(-1, len(vocab)), y.view(-1))

    for _ in warden.steps(args.steps):  # resumes first; ends after args.steps steps, or early on a stop order
        loss = loss_of(rank)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # clips; False: skip this batch on every rank; a step that alarms is re-run to tell a bad GPU from bad data
        if warden.guard_step(loss.item(), max_norm=1.0, recompute=loss_of):
            optimizer.step()
            scheduler.step()
        applied = warden.step_done(loss=loss.item(), lr=scheduler.get_last_lr()[0])
        if applied and args.eval_every and warden.step % args.eval_every == 0:
            with warden.phase("eval"):  # its own, longer hang timeout
                eval_loss = evaluate(model, data, vocab=len(vocab), seed=args.seed, block=args.block)
            warden.log.info("eval", step=warden.step, eval_loss=eval_loss)
            if rank == 0:
                print(f"step {warden.step}/{args.steps} loss {loss.item():.4f} eval {eval_loss:.4f}", flush=True)
    warden.finish()  # saves the final state unless it is saved already
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # recovery in place: after a peer rank fails, main runs again in this process (worker/recovery.py)
