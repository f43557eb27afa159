"""Lightning example: a tiny character-level transformer on the sonnets, trained by PyTorch Lightning with DDP.

Run it under the supervisor (`trainwarden run examples/lightning.yaml`) or under torchrun. trainwarden's part is
two lines: the callback, and `ckpt_path=ckpt_path()` (the checkpoint the supervisor chose). Needs the extra:
`pip install -e '.[lightning]'`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from worker.integrations.lightning import TrainwardenCallback, ckpt_path

TEXT = Path(__file__).parent / "data" / "sonnets.txt"


class Windows(Dataset):
    """Fixed windows of the text: sample i is the same tensor in every run."""

    def __init__(self, data: torch.Tensor, *, block: int, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data, self.block = data, block
        self.starts = torch.randint(0, len(data) - block - 1, (size,), generator=gen)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.data[s : s + self.block], self.data[s + 1 : s + self.block + 1]


class CharModel(L.LightningModule):
    """A small pre-norm causal transformer over characters, built from its config (no downloads)."""

    def __init__(
        self, vocab: int, *, d_model: int = 64, n_head: int = 4, n_layer: int = 2, block: int = 64, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.vocab, self.lr = vocab, lr
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.norm(self.blocks(x, mask=self.mask[:t, :t], is_causal=True)))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).view(-1, self.vocab), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--samples", type=int, default=512, help="training windows per epoch (all ranks)")
    parser.add_argument("--eval-every", type=int, default=50, help="validate every N optimizer steps")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)
    text = TEXT.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train = Windows(data[:split], block=args.block, size=args.samples, seed=args.seed)
    val = Windows(data[split:], block=args.block, size=64, seed=args.seed + 1)
    model = CharModel(len(chars), block=args.block)
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(
        # Launched as torchrun launches (the supervisor, srun): one process per device, Lightning spawns none.
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy="ddp",
        max_steps=args.steps,
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainwardenCallback()],
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
        ckpt_path=ckpt_path(),
        weights_only=True,
    )


if __name__ == "__main__":
    main()
