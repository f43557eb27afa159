"""Checkpoint saves in a real torch loop: the completion record's checksum, size and seed-000 health tag."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.contract import ENV_RUN_DIR, RunLayout, WorkerConfig
from worker.warden import Warden


class EmbeddingModel(torch.nn.Module):
    """An embedding followed by a linear head, like the start of a language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def save_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: WorkerConfig, spoil: Any = None, **warden_options: Any
) -> dict[str, Any]:
    """Train one step, optionally spoil the model, save step 1; returns rank 0's completion record."""
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_FAULTS", "TRAINWARDEN_ATTEMPT"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model = EmbeddingModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    warden = Warden(model, optimizer, config=config, **warden_options)
    idx = torch.tensor([1, 2, 3])
    torch.nn.functional.cross_entropy(model(idx), idx).backward()
    optimizer.step()
    warden.step_done(loss=1.0)
    if spoil is not None:
        spoil(model)
    warden.save(1)
    warden.finish()
    layout = RunLayout(tmp_path)
    return json.loads(layout.checkpoints.record(0, 1, config.prefix).read_text())


def test_completion_record_checksum_and_size_match_the_file(tmp_path, monkeypatch):
    """The checksum streamed while writing equals the CRC-32 of the file on disk, and so does the size."""
    record = save_once(tmp_path, monkeypatch, WorkerConfig())
    data = RunLayout(tmp_path).checkpoints.file(0, 1, "ckpt").read_bytes()
    assert (record["size"], record["crc32"]) == (len(data), f"{zlib.crc32(data):08x}")
    assert (record["is_health"], record["health_monitored"]) == (0, False)
    assert record["world_size"] == 1  # the supervisor tells checkpoints of another world size apart without torch


def test_embedding_gradient_above_threshold_is_unhealthy(tmp_path, monkeypatch):
    """With the monitor on, an embedding local norm above the threshold tags the part unhealthy (1)."""
    config = WorkerConfig(use_checkpoint_health_monitor=True, embedding_local_norm_threshold=1e-6)
    record = save_once(tmp_path, monkeypatch, config)
    assert record["is_health"] == 1
    assert record["embedding_local_norm"] > 1e-6
    assert record["health_reasons"] == [f"embedding_local_norm {record['embedding_local_norm']:.6g} above 1e-06"]


def test_embedding_gradient_below_threshold_is_healthy(tmp_path, monkeypatch):
    """Below the threshold, and with finite parameters and optimizer state, the part is healthy (0)."""
    config = WorkerConfig(use_checkpoint_health_monitor=True, embedding_local_norm_threshold=1e6)
    record = save_once(tmp_path, monkeypatch, config)
    assert (record["is_health"], record["health_reasons"]) == (0, [])
    events = [json.loads(line) for line in RunLayout(tmp_path).rank_events(0).read_text().splitlines()]
    assert [e["embedding_local_norm"] for e in events if e["event"] == "embedding_local_norm"] == [
        record["embedding_local_norm"]
    ]


def test_non_finite_parameter_is_unhealthy(tmp_path, monkeypatch):
    """A NaN in any parameter tags the part unhealthy, whatever the embedding norm."""
    config = WorkerConfig(use_checkpoint_health_monitor=True, embedding_local_norm_threshold=1e6)

    def poison(model: EmbeddingModel) -> None:
        with torch.no_grad():
            model.head.bias[0] = float("nan")

    record = save_once(tmp_path, monkeypatch, config, spoil=poison)
    assert (record["is_health"], record["health_reasons"]) == (1, ["non-finite parameter"])


def test_named_embedding_parameter_is_the_one_judged(tmp_path, monkeypatch):
    """`embedding_param` picks which parameter's gradient norm is judged; by default the nn.Embedding's."""
    torch.manual_seed(0)
    model = EmbeddingModel()
    idx = torch.tensor([1, 2, 3])
    torch.nn.functional.cross_entropy(model(idx), idx).backward()
    expected = {name: float(p.grad.norm()) for name, p in model.named_parameters()}
    named = save_once(
        tmp_path / "named", monkeypatch, WorkerConfig(use_checkpoint_health_monitor=True, embedding_param="head.weight")
    )
    default = save_once(tmp_path / "default", monkeypatch, WorkerConfig(use_checkpoint_health_monitor=True))
    assert named["embedding_local_norm"] == pytest.approx(expected["head.weight"], rel=1e-6)
    assert default["embedding_local_norm"] == pytest.approx(expected["embed.weight"], rel=1e-6)


@pytest.mark.parametrize(
    ("check", "reasons"),
    [
        (lambda step: None, []),
        (lambda step: f"loss diverged at step {step}", ["health_check: loss diverged at step 1"]),
        (lambda step: 1 / 0, ["health_check: raised ZeroDivisionError('division by zero')"]),
    ],
)
def test_user_health_check_is_part_of_the_tag(tmp_path, monkeypatch, check, reasons):
    """A user's `health_check(step)` returning a reason (or raising) tags the part unhealthy; None passes."""
    config = WorkerConfig(use_checkpoint_health_monitor=True, embedding_local_norm_threshold=1e6)
    record = save_once(tmp_path, monkeypatch, config, health_check=check)
    assert (record["is_health"], record["health_reasons"]) == (int(bool(reasons)), reasons)
