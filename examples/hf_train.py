"""Hugging Face example: a tiny GPT-2 (built from its config, no downloads) learns the sonnets with the `Trainer`.

Run it under the supervisor (`trainwarden run examples/hf.yaml`) or under torchrun: 2 ranks, DDP over gloo, CPU.
trainwarden's part is three things: `output_dir=output_dir()`, the callback, and
`resume_from_checkpoint=resume_from_checkpoint()`. Needs the extra: `pip install -e '.[hf]'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging

from worker.integrations.hf import TrainwardenCallback, output_dir, resume_from_checkpoint

TEXT = Path(__file__).parent / "data" / "sonnets.txt"


class Windows(Dataset):
    """Fixed windows of the text: sample i is the same in every run."""

    def __init__(self, data: torch.Tensor, *, block: int, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data, self.block = data, block
        self.starts = torch.randint(0, len(data) - block, (size,), generator=gen)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[int(self.starts[i]) : int(self.starts[i]) + self.block]
        return {"input_ids": window, "labels": window}  # the model shifts the labels itself


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--samples", type=int, default=512, help="training windows per epoch (all ranks)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.set_verbosity_warning()
    text = TEXT.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    torch.manual_seed(args.seed)  # the model's initial weights
    config = GPT2Config(
        vocab_size=len(chars),
        n_positions=args.block,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    training = TrainingArguments(
        output_dir=output_dir(),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=3e-3,
        weight_decay=0.01,
        seed=args.seed,
        # trainwarden asks the Trainer for a checkpoint every worker.save_checkpoint_steps and at a stop's step
        # (save_strategy="steps" with save_steps works as well: every checkpoint the Trainer writes is recorded).
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        max_grad_norm=0.0,  # the callback judges the gradients, then clips them (max_norm below)
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=Windows(data[:split], block=args.block, size=args.samples, seed=args.seed),
        eval_dataset=Windows(data[split:], block=args.block, size=32, seed=args.seed + 1),
        callbacks=[TrainwardenCallback(max_norm=1.0)],
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint())


if __name__ == "__main__":
    main()
