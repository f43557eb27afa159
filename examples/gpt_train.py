"""A GPT training loop in nanoGPT's style, written for this project: every worker feature used as taught.

A decoder-only GPT (token and position embeddings, pre-LayerNorm blocks of causal self-attention and a
GELU MLP, dropout, the head tied to the token embedding) learns Shakespeare's sonnets character by
character, with DDP over gloo on CPU ranks. It shows, the way docs/worker-library.md teaches them: gradient
accumulation (`no_sync` on all but the last micro-step), AMP with a GradScaler registered as Warden
`extra_state`, the guard between `unscale_` and the optimizer step, a cosine schedule with warmup whose
state is checkpointed, a prefetch that survives exact resume, eval on rank 0 inside `warden.phase("eval")`,
and a wandb-shaped metrics hook whose `finish()` runs after the loop, also after a stop.

Run it under the supervisor from the repository root:  trainwarden run examples/gpt.yaml
It is deterministic given `--seed`: a run killed, resumed or stopped and rerun ends bitwise equal to an
uninterrupted one. Fault injection: see `worker/faults.py` (`TRAINWARDEN_FAULTS`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from worker import Warden, run
from worker.exact import average_gradients_in_rank_order

TEXT = Path(__file__).parent / "data" / "sonnets.txt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_BATCHES = 4  # fixed held-out batches per eval
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    """The position-wise feed-forward layer: 4x wider, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model whose output head shares the token embedding's weights."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix reads and writes tokens
        self.apply(_init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections scaled down by depth
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def configure_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW decaying only matrices (weights, embeddings), not biases or LayerNorm gains, as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def warmup_cosine(*, warmup: int, total: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """The LR multiplier at step `it`: linear warmup, then cosine decay to `min_ratio` at `total` (nanoGPT's)."""

    def multiplier(it: int) -> float:
        if it < warmup:
            return (it + 1) / (warmup + 1)
        progress = min(1.0, (it - warmup) / max(1, total - warmup))
        return min_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_ratio)

    return multiplier


def seed_of(*parts: object) -> int:
    """A 63-bit seed derived from `parts`: distinct parts never share a stream, as sums of multiples can."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def sample(data: torch.Tensor, gen: torch.Generator, *, batch_size: int, block: int) -> Batch:
    """`batch_size` random windows of `block` characters and, shifted by one, their next characters."""
    starts = torch.randint(0, len(data) - block - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


class MicroBatches:
    """This rank's micro-batch `micro` of batch `index`, with the next one fetched ahead as nanoGPT does.

    The trap: nanoGPT's get_batch draws from the global RNG. A batch prefetched before a checkpoint is
    saved has already advanced the RNG state the checkpoint holds, and the resumed process, which must
    fetch that batch again, draws a different one from there (and every dropout mask after it shifts).
    Here each micro-batch comes from its own generator seeded by (seed, index, micro, rank): the batch
    fetched ahead is the one a restarted process fetches, and the global RNG is left to dropout.
    """

    def __init__(
        self, data: torch.Tensor, *, rank: int, seed: int, batch_size: int, block: int, grad_accum: int
    ) -> None:
        self.data, self.rank, self.seed = data, rank, seed
        self.batch_size, self.block, self.grad_accum = batch_size, block, grad_accum
        self._ahead: tuple[tuple[int, int], Batch] | None = None  # (key, batch) fetched ahead

    def fetch(self, index: int, micro: int) -> Batch:
        gen = torch.Generator().manual_seed(seed_of(self.seed, index, micro, self.rank))
        return sample(self.data, gen, batch_size=self.batch_size, block=self.block)

    def get(self, index: int, micro: int) -> Batch:
        """The batch fetched ahead if it is this one; else (the first step of a process) fetched now."""
        if self._ahead is not None and self._ahead[0] == (index, micro):
            return self._ahead[1]
        return self.fetch(index, micro)

    def prefetch_after(self, index: int, micro: int) -> None:
        """Fetch the micro-batch that follows (index, micro): after the last micro-step, batch index + 1's first."""
        key = (index, micro + 1) if micro + 1 < self.grad_accum else (index + 1, 0)
        self._ahead = (key, self.fetch(*key))


class MetricsLogger:
    """A wandb-shaped logging hook: `log(metrics, step)` and `finish()` write JSON lines (no path: does nothing).

    Where this writes a line, a wandb user calls `wandb.log(metrics, step=step)` and `wandb.finish()`.
    """

    def __init__(self, path: str | None) -> None:
        self._file: TextIO | None = None
        self._step: int | None = None  # the last step logged: the one `finish()` reports
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run; a rerun appends

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._step = step
        self._write({"step": step, **metrics})

    def finish(self) -> None:
        """The last line: the run's code after the training loop ran (also after a stop)."""
        self._write({"event": "finished", "step": self._step})
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a killed rank loses no line it logged


def forward_backward(
    ddp: DistributedDataParallel, batches: MicroBatches, scaler: torch.amp.GradScaler, autocast: Any, *, index: int
) -> float:
    """Gradients of batch `index` accumulated over its micro-batches (scaled by `scaler`); returns its mean loss."""
    total = 0.0
    for micro in range(batches.grad_accum):
        x, y = batches.get(index, micro)
        last = micro == batches.grad_accum - 1
        with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once, after the last micro-step
            with autocast:
                _, loss = ddp(x, y)
                loss = loss / batches.grad_accum  # the accumulated gradient is the mean over micro-batches
            batches.prefetch_after(index, micro)  # nanoGPT fetches the next batch while backward would run
            scaler.scale(loss).backward()
        total += loss.item()
    return total


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, autocast: Any, *, seed: int, batch_size: int, block: int) -> float:
    """Mean loss on fixed held-out batches from their own generator; no dropout, so no global RNG is drawn."""
    model.eval()
    gen = torch.Generator().manual_seed(seed_of(seed, "eval"))
    losses = []
    for _ in range(EVAL_BATCHES):
        x, y = sample(data, gen, batch_size=batch_size, block=block)
        with autocast:
            losses.append(model(x, y)[1].item())
    model.train()
    return sum(losses) / len(losses)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps to train")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--block", type=int, default=64, help="context length in characters")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=20, help="warmup steps of the cosine schedule")
    parser.add_argument(
        "--lr-decay-steps", type=int, help="length of the cosine decay (nanoGPT's lr_decay_iters); default: --steps"
    )
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this (0: off)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",  # bfloat16 is slower on CPU
        help="autocast dtype; float16 adds a GradScaler",
    )
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate on rank 0 every N steps (0: never)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--metrics-file", help="append JSON lines of metrics here (rank 0); default: none")
    return parser.parse_args()


def load_text() -> tuple[torch.Tensor, torch.Tensor, int]:
    """The sonnets as character ids: 90 % to train on, the rest held out; and the vocabulary size."""
    text = TEXT.read_text(encoding="utf-8")
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(stoi)


def seed_rank_rngs(seed: int, rank: int) -> None:
    """The global RNGs (dropout here) differ per rank; Warden saves and restores their states."""
    torch.manual_seed(seed + 1 + rank)
    random.seed(seed + rank)
    if "numpy" in sys.modules:  # torch loads NumPy where it is installed; its RNG is saved too, so it must be seeded
        sys.modules["numpy"].random.seed(seed + rank)


def build_model(args: argparse.Namespace, vocab_size: int) -> tuple[GPT, DistributedDataParallel]:
    """The model, initialised identically on every rank, and its DDP wrapper."""
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(GPTConfig(vocab_size, args.block, args.n_layer, args.n_head, args.n_embd, args.dropout))
    ddp = DistributedDataParallel(model)
    average_gradients_in_rank_order(ddp)  # bitwise-exact resume with 3+ ranks too (worker/exact.py says why)
    return model, ddp


def eval_on_rank_0(
    warden: Warden, model: GPT, data: torch.Tensor, autocast: Any, metrics: MetricsLogger, args: argparse.Namespace
) -> None:
    """Rank 0 evaluates; the other ranks go on and wait for it in the next step's all-reduce."""
    with warden.phase("eval"):  # its own hang timeout
        eval_loss = evaluate(model, data, autocast, seed=args.seed, batch_size=args.batch_size, block=args.block)
    metrics.log({"eval_loss": eval_loss}, step=warden.step)
    print(f"step {warden.step}/{args.steps} eval loss {eval_loss:.4f}", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank; also keeps CPU kernels deterministic
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_data, val_data, vocab_size = load_text()
    model, ddp = build_model(args, vocab_size)
    optimizer = configure_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    decay_steps = args.lr_decay_steps or args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup=args.warmup, total=decay_steps))
    dtype = DTYPES[args.dtype]
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)  # bfloat16 has float32's range: no scaling
    seed_rank_rngs(args.seed, rank)
    batches = MicroBatches(
        train_data, rank=rank, seed=args.seed, batch_size=args.batch_size, block=args.block, grad_accum=args.grad_accum
    )
    warden = Warden(
        ddp,
        optimizer,
        scheduler,
        extra_state={"scaler": scaler},  # the scaler's state is saved too
        global_batch_size=args.batch_size * args.grad_accum * world_size,
    )
    metrics = MetricsLogger(args.metrics_file if rank == 0 else None)

    for _ in warden.steps(args.steps):  # resumes first; ends after args.steps steps, or early on a stop order
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(ddp, batches, scaler, autocast, index=warden.batches)
        scaler.unscale_(optimizer)  # guard_step clips and judges the true gradients, not the scaled ones
        if warden.guard_step(loss, max_norm=args.grad_clip or None):  # False: skip this batch on every rank
            scaler.step(optimizer)
            scheduler.step()
        scaler.update()  # skipped or not: it lowers the scale after an overflow, and the next unscale_ needs it
        lr = scheduler.get_last_lr()[0]
        if not warden.step_done(loss=loss, lr=lr):
            continue  # skipped: nothing to log, and this step number's eval waits until the step is applied
        metrics.log({"loss": loss, "lr": lr, "step_time_s": time.perf_counter() - started}, step=warden.step)
        if rank == 0 and args.eval_every and warden.step % args.eval_every == 0:
            eval_on_rank_0(warden, model, val_data, autocast, metrics, args)
    warden.finish()  # saves the final state unless it is saved already
    metrics.finish()  # the loop also ends on a stop order, and this still runs: wandb.finish() belongs here
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # recovery in place: after a peer rank fails, main runs again in this process (worker/recovery.py)
