"""A trainer's own checkpoint directory made one of ours (worker.integrations.records), and the supervisor's choice,
health file, rotation and junk sorting over such directories: plain files standing in for what Lightning or the
Hugging Face Trainer writes (their own tests: tests/e2e/test_lightning_example.py, test_hf_example.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from supervisor.rundir.checkpoints import find_junk
from worker.contract import ENV_RESUME_DIR, ENV_RESUME_STEP, RunLayout, WorkerConfig
from worker.files import read_json
from worker.integrations.records import framework_files, record_completion, resume_directory
from worker.manifest import (
    FRAMEWORK_FORMAT,
    ManifestError,
    framework_name,
    manifest_problem,
    read_manifest,
    remove_sharded,
)
from worker.store import choose_resume, health_entries
from worker.warden import Warden

HEALTHY = {"is_health": 0, "health_reasons": []}
PREFIX = "checkpoint"  # the Trainer's


def trainer_save(layout: RunLayout, step: int, *, health: dict[str, Any] = HEALTHY) -> Path:
    """What a trainer writes (a weights file, a state file, a folder of shards), then the rank's record."""
    directory = layout.checkpoints.framework_dir(step, PREFIX)
    (directory / "shards").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(os.urandom(4096))
    (directory / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    (directory / "shards" / "__0_0.distcp").write_bytes(os.urandom(512))
    record_completion(directory, step=step, rank=0, world_size=1, health=health, framework="hf", root=layout.root)
    return directory


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("model.safetensors", True),
        ("model.ckpt/__0_0.distcp", True),
        ("model.ckpt/.metadata", True),
        ("rng_state_1.pth", True),
        ("../escape", False),
        ("a/b/c", False),
        ("/abs", False),
        ("..", False),
        ("rank_0.json", False),
        ("MANIFEST.json", False),
        ("sp ace", False),
        ("", False),
    ],
)
def test_a_framework_file_is_one_or_two_plain_names_never_ours(name: str, ours: bool) -> None:
    assert framework_name(name) is ours


def test_the_record_lists_every_file_the_trainer_wrote_with_size_and_checksum(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    directory = trainer_save(layout, 10)
    manifest = read_manifest(directory, 10, format=FRAMEWORK_FORMAT)
    assert (manifest["framework"], manifest["world_size"], manifest["is_health"]) == ("hf", 1, 0)
    assert sorted(manifest["files"]) == ["model.safetensors", "shards/__0_0.distcp", "trainer_state.json"]
    assert manifest["files"]["model.safetensors"]["size"] == 4096
    assert read_json(directory / "rank_0.json")["world_size"] == 1
    assert manifest_problem(directory, 10, require_healthy=True) is None
    assert framework_files(directory) == sorted(manifest["files"])  # ours left out


def test_a_symlink_in_the_directory_is_not_listed_and_a_listed_file_replaced_by_one_is_refused(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    directory = trainer_save(layout, 10)
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", directory / "extra.bin")
    assert "extra.bin" not in framework_files(directory)
    (directory / "trainer_state.json").unlink()
    os.symlink(tmp_path / "secret", directory / "trainer_state.json")
    assert "trainer_state.json" in manifest_problem(directory, 10, require_healthy=True)
    (directory / "shards" / "__0_0.distcp").unlink()
    (directory / "shards").rmdir()
    os.symlink(tmp_path, directory / "shards")
    assert manifest_problem(directory, 10, require_healthy=False).startswith("not a plain directory")


def test_a_sharded_checkpoints_reader_refuses_a_framework_manifest(tmp_path: Path) -> None:
    directory = trainer_save(RunLayout(tmp_path), 10)
    with pytest.raises(ManifestError, match="not a trainwarden-dcp manifest"):
        read_manifest(directory, 10)


def test_the_supervisor_resumes_the_newest_intact_healthy_one_and_says_why_it_passed_the_others(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    for step in (10, 20, 30, 40):
        trainer_save(layout, step, health={"is_health": 1, "health_reasons": ["loss spike"]} if step == 30 else HEALTHY)
    weights = layout.checkpoints.framework_dir(40, PREFIX) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (layout.checkpoints.framework_dir(20, PREFIX) / "MANIFEST.json").unlink()
    choice = choose_resume(layout.checkpoint_stores(), 2, PREFIX)  # any world size: the trainer reshards or not
    assert choice.step == 10
    assert choice.passed_over == (
        (40, "truncated: 100 bytes, 4096 written (rank 0's model.safetensors)"),
        (30, "unhealthy on rank 0: loss spike"),
        (20, "incomplete: no manifest (a save in flight, or killed before every rank was done)"),
    )
    health = {e["step"]: e["is_health"] for e in health_entries(layout.checkpoints, 1, PREFIX, [10, 30])}
    assert health == {10: 0, 30: 1}


def test_junk_sorting_leaves_a_complete_one_alone_and_reports_a_torn_ones_files(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    trainer_save(layout, 10)
    torn = trainer_save(layout, 20)
    (torn / "MANIFEST.json").unlink()
    junk = find_junk(layout, 1, PREFIX)
    assert junk.torn == ()
    assert sorted(p.relative_to(torn).as_posix() for p in junk.foreign) == [
        "model.safetensors",
        "shards",
        "trainer_state.json",
    ]


def test_rotation_removes_the_files_its_manifest_lists_and_ours_and_leaves_strangers(tmp_path: Path) -> None:
    directory = trainer_save(RunLayout(tmp_path), 10)
    (directory / "notes.txt").write_text("a person's")
    assert remove_sharded(directory) == ["notes.txt"]
    assert sorted(os.listdir(directory)) == ["notes.txt"]
    (directory / "notes.txt").unlink()
    assert remove_sharded(directory) == [] and not directory.exists()


@pytest.mark.parametrize(
    ("env", "resume_training", "expected"),
    [
        ({ENV_RESUME_STEP: "10"}, True, "checkpoint-10"),  # the supervisor's choice
        ({ENV_RESUME_STEP: ""}, True, None),  # the supervisor said: from scratch
        ({}, True, "checkpoint-20"),  # no supervisor: the newest with a manifest
        ({}, False, None),
    ],
)
def test_the_checkpoint_to_resume_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], resume_training: bool, expected: str | None
) -> None:
    layout = RunLayout(tmp_path)
    for step in (10, 20):
        trainer_save(layout, step)
    (layout.checkpoints.framework_dir(30, PREFIX)).mkdir()  # a save in flight: no manifest
    for name in (ENV_RESUME_STEP, ENV_RESUME_DIR):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = resume_directory(layout, WorkerConfig(prefix=PREFIX, resume_training=resume_training))
    assert (found.name if found else None) == expected


class Trainer:
    """Stands in for a trainer: writes its checkpoint when the Warden asks (synchronously, as Lightning does)."""

    framework = "lightning"

    def __init__(self, layout: RunLayout) -> None:
        self.layout, self.asked = layout, []

    def __call__(self, step: int) -> Path:
        self.asked.append(step)
        directory = self.layout.checkpoints.framework_dir(step, "ckpt")
        directory.mkdir(parents=True)
        (directory / "model.ckpt").write_bytes(b"weights %d" % step)
        return directory


def test_a_warden_over_a_trainer_asks_it_to_save_follows_its_step_count_and_records_each_save(
    loop: Any, tmp_path: Path
) -> None:
    """The trainer's own count of steps (a skipped one included) is the Warden's; every save_checkpoint_steps
    it asks the trainer to save, and records what it wrote."""
    trainer = Trainer(RunLayout(tmp_path))
    warden: Warden = loop(framework_save=trainer, config=WorkerConfig(save_checkpoint_steps=2)).warden
    warden.framework_resumed(0, None)
    for step in range(1, 6):
        warden.step_done(loss=None if step == 3 else 1.0, step=step)
    assert trainer.asked == [2, 4] and warden.step == 5
    for step in (2, 4):
        manifest = read_manifest(trainer.layout.checkpoints.framework_dir(step, "ckpt"), step, format=None)
        assert (manifest["framework"], list(manifest["files"])) == ("lightning", ["model.ckpt"])
    warden.finish()
    assert trainer.asked == [2, 4, 5]  # the final state, as the Warden saves its own


def test_export_reads_the_model_out_of_a_lightning_checkpoint_with_weights_only(tmp_path: Path) -> None:
    import torch

    from supervisor.export import export_weights

    layout = RunLayout(tmp_path / "run")
    directory = layout.checkpoints.framework_dir(10, "ckpt")
    directory.mkdir(parents=True)
    weights = {"layer.weight": torch.arange(6.0).reshape(2, 3)}
    torch.save({"state_dict": weights, "global_step": 10, "loops": {}}, directory / "model.ckpt")
    record_completion(directory, step=10, rank=0, world_size=1, health=HEALTHY, framework="lightning", root=layout.root)
    exported = export_weights(layout.root, tmp_path / "weights.pt")
    assert exported.step == 10
    assert torch.equal(torch.load(tmp_path / "weights.pt", weights_only=True)["layer.weight"], weights["layer.weight"])


def test_export_reads_the_model_out_of_a_trainers_safetensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors.torch", reason="the [hf] extra")
    from supervisor.export import export_weights

    layout = RunLayout(tmp_path / "run")
    directory = layout.checkpoints.framework_dir(20, PREFIX)
    directory.mkdir(parents=True)
    safetensors.save_file({"wte.weight": torch.ones(4, 2)}, directory / "model.safetensors")
    (directory / "optimizer.pt").write_bytes(b"not read")
    record_completion(directory, step=20, rank=0, world_size=1, health=HEALTHY, framework="hf", root=layout.root)
    export_weights(layout.root, tmp_path / "weights.pt")
    assert torch.equal(torch.load(tmp_path / "weights.pt", weights_only=True)["wte.weight"], torch.ones(4, 2))
