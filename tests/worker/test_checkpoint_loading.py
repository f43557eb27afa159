"""Checkpoints load with weights_only: the library's payload round-trips bit for bit, every RNG stream continues,
a crafted pickle is refused without running, and `worker.weights_only: false` is the explicit way out."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import worker.warden
from tests.checkpoint_files import CRAFTED_REFUSAL, assert_bitwise_equal, load_saved, write_crafted
from tests.worker.conftest import GUARDED
from tests.worker.test_guard import events
from worker.checkpoint import (
    FORMAT_VERSION,
    CheckpointRefused,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from worker.contract import ENV_RESUME_STEP, EXIT_CHECKPOINT_REFUSED, EXIT_CONFIG, RunLayout
from worker.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
# A NumPy global RNG state as capture_rng stores it, for checkpoints written where NumPy may not be installed.
NUMPY_STATE = {
    "bit_generator": "MT19937",
    "keys": torch.arange(624, dtype=torch.int64),
    "pos": 624,
    "has_gauss": 0,
    "cached_gaussian": 0.0,
}
# The CUDA generator states of two devices, shaped as torch.cuda.get_rng_state_all() returns them.
CUDA_STATES = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]


@dataclass(frozen=True)
class Sampler:
    """A user's own object in `data_state`: full unpickling is needed to load it."""

    position: int


def trained_and_saved(loop: Any, batches: int = 2, **options: Any) -> tuple[Any, Path]:
    """A loop after `batches` applied steps and a save of that step (still open)."""
    run = loop(**options)
    for _ in range(batches):
        run.train_batch()
    return run, run.warden.save(run.warden.step)


def resumed(loop: Any, monkeypatch: pytest.MonkeyPatch, step: int, **options: Any) -> Any:
    """A new loop told to resume from `step`, as the supervisor would tell it (resume() not called yet)."""
    monkeypatch.setenv(ENV_RESUME_STEP, str(step))
    return loop(**options)


def store(tmp_path: Path) -> CheckpointStore:
    return RunLayout(tmp_path).checkpoints


def test_a_saved_checkpoint_loads_back_bitwise_under_weights_only(loop, tmp_path):
    """Model, optimizer, scheduler, RNG states, data position and data state load with weights_only, bit for bit."""
    run = loop(data_state=lambda: {"epoch": 3, "order": torch.tensor([4, 1, 2])}, global_batch_size=8)
    for _ in range(3):
        run.train_batch()
    expected = {
        **run.snapshot(),
        "rng": capture_rng(),
        "data_position": 3,
        "data_state": {"epoch": 3, "order": torch.tensor([4, 1, 2])},
        "world_size": 1,
        "global_batch_size": 8,
    }
    run.warden.save(3)

    loaded = load_checkpoint(store(tmp_path), rank=0, step=3, prefix="ckpt")
    assert (loaded["format_version"], loaded["step"]) == (FORMAT_VERSION, 3)
    assert_bitwise_equal({key: loaded[key] for key in expected}, expected)


def test_a_resumed_rank_continues_every_rng_stream_exactly(loop, tmp_path, monkeypatch):
    """After a resume, Python's and torch's next draws are the ones the saving rank would have made next."""
    run, _ = trained_and_saved(loop)
    run.warden.finish()
    expected = (random.random(), torch.rand(4))
    random.seed(99)
    torch.manual_seed(99)

    again = resumed(loop, monkeypatch, 2)
    assert again.warden.resume() == 2
    assert_bitwise_equal((random.random(), torch.rand(4)), expected)
    assert_bitwise_equal(again.snapshot(), run.snapshot())


def test_a_crafted_checkpoint_is_refused_naming_the_file_and_runs_nothing(loop, tmp_path):
    """A torch.save file whose pickle would call os.system is refused with CheckpointRefused; its code never runs."""
    _, path = trained_and_saved(loop)
    marker = tmp_path / "marker"
    write_crafted(path, marker)

    with pytest.raises(CheckpointRefused) as refused:
        load_checkpoint(store(tmp_path), rank=0, step=2, prefix="ckpt")
    assert (refused.value.path, refused.value.reason) == (path, CRAFTED_REFUSAL)
    assert str(refused.value) == f"checkpoint {path} refused: {CRAFTED_REFUSAL}"
    assert not marker.exists()


def test_a_symlinked_checkpoint_is_refused(loop, tmp_path):
    """A checkpoint file replaced by a symlink (to an intact checkpoint, even) is refused, not followed."""
    _, path = trained_and_saved(loop)
    path.rename(tmp_path / "elsewhere.ckpt")
    path.symlink_to(tmp_path / "elsewhere.ckpt")

    with pytest.raises(CheckpointRefused) as refused:
        load_checkpoint(store(tmp_path), rank=0, step=2, prefix="ckpt")
    assert refused.value.reason == "a symbolic link (not followed)"


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip", b"\x80\x02}q\x00."])
def test_a_checkpoint_torch_cannot_read_is_refused_not_retried(loop, tmp_path, content):
    """An empty file, a broken zip or a bare pickle where the checkpoint goes is refused with torch's reason."""
    _, path = trained_and_saved(loop)
    path.write_bytes(content)

    with pytest.raises(CheckpointRefused) as refused:
        load_checkpoint(store(tmp_path), rank=0, step=2, prefix="ckpt")
    assert refused.value.path == path and refused.value.reason.startswith("cannot be read: ")


def test_a_refused_resume_checkpoint_is_logged_and_exits_66(loop, tmp_path, monkeypatch):
    """A rank told to resume from a crafted checkpoint logs `checkpoint_refused` and exits EXIT_CHECKPOINT_REFUSED."""
    run, path = trained_and_saved(loop)
    run.warden.finish()
    write_crafted(path, tmp_path / "marker")

    again = resumed(loop, monkeypatch, 2)
    with pytest.raises(SystemExit) as exited:
        again.warden.resume()
    assert exited.value.code == EXIT_CHECKPOINT_REFUSED == 66
    assert [{k: v for k, v in e.items() if k != "time"} for e in events(tmp_path, "checkpoint_refused")] == [
        {
            "event": "checkpoint_refused",
            "level": "error",
            "rank": 0,
            "attempt": 0,
            "step": 2,
            "path": str(path),
            "error": CRAFTED_REFUSAL,
            "source": "checkpoint",
        }
    ]
    assert not (tmp_path / "marker").exists()


def test_a_checkpoint_of_another_world_size_ends_the_rank_with_78_restoring_nothing(loop, tmp_path, monkeypatch):
    """Saved by a 1-rank job, resumed by rank 0 of 2: `world_size_changed` naming both sizes, exit EXIT_CONFIG."""
    run, _ = trained_and_saved(loop)
    run.warden.finish()
    monkeypatch.setenv("WORLD_SIZE", "2")

    again = resumed(loop, monkeypatch, 2)
    before = again.snapshot()
    with pytest.raises(SystemExit) as exited:
        again.warden.resume()
    assert exited.value.code == EXIT_CONFIG == 78
    (changed,) = events(tmp_path, "world_size_changed")
    assert (changed["step"], changed["saved_world_size"], changed["world_size"]) == (2, 1, 2)
    assert_bitwise_equal(again.snapshot(), before)  # nothing of the checkpoint was loaded


def test_weights_only_false_loads_the_users_own_objects_with_one_warning(loop, tmp_path, monkeypatch):
    """A `data_state` holding the user's own class is refused by default and loads with `weights_only: false`,
    which logs `unsafe_checkpoint_load` once."""
    run, path = trained_and_saved(loop, data_state=lambda: {"sampler": Sampler(7)})
    run.warden.finish()
    with pytest.raises(CheckpointRefused):
        load_checkpoint(store(tmp_path), rank=0, step=2, prefix="ckpt")

    again = resumed(loop, monkeypatch, 2, config=replace(GUARDED, weights_only=False))
    assert again.warden.resume() == 2
    assert again.warden.data_state == {"sampler": Sampler(7)}
    (warning,) = events(tmp_path, "unsafe_checkpoint_load")
    assert (warning["level"], warning["step"], warning["path"]) == ("warning", 2, str(path))
    assert warning["reason"] == "worker.weights_only is false: a crafted checkpoint file can run any code here"


def test_cuda_rng_states_round_trip_under_weights_only(tmp_path):
    """CUDA generator states (a list of uint8 tensors) save and load with weights_only, bit for bit."""
    rng = {**capture_rng(), "cuda": CUDA_STATES}
    save_checkpoint(store(tmp_path), rank=0, step=1, prefix="ckpt", payload={"rng": rng}, health={})

    loaded = load_checkpoint(store(tmp_path), rank=0, step=1, prefix="ckpt")
    assert_bitwise_equal(loaded["rng"], rng)


def test_cuda_rng_state_without_cuda_is_left_unused_and_said(loop, tmp_path, monkeypatch):
    """A checkpoint with CUDA generator states resumes where CUDA is unavailable, logging `cuda_rng_not_restored`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(worker.warden, "capture_rng", lambda: {**capture_rng(), "cuda": CUDA_STATES})
    trained_and_saved(loop)[0].warden.finish()

    assert resumed(loop, monkeypatch, 2).warden.resume() == 2
    (logged,) = events(tmp_path, "cuda_rng_not_restored")
    assert (logged["level"], logged["step"]) == ("warning", 2)
    assert logged["reason"] == (
        "CUDA is not available in this process, so nothing here draws from a CUDA generator; "
        "the 2 saved CUDA generator state(s) are left unused"
    )


def test_restore_rng_says_nothing_was_left_out_of_a_full_restore():
    """Restoring the states this process captured restores every part (nothing returned)."""
    assert restore_rng(capture_rng()) == {}


def test_numpy_rng_stream_continues_exactly_after_restore(loop, tmp_path, monkeypatch):
    """With NumPy loaded, its global RNG state (cached Gaussian included) is saved as plain data and its next draws
    after a resume are the ones the saving rank would have made next."""
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(7)
    numpy.random.standard_normal()  # leaves the second Gaussian of the pair cached
    run, path = trained_and_saved(loop)
    run.warden.finish()
    expected = numpy.concatenate([numpy.random.standard_normal(3), numpy.random.random_sample(3)])
    numpy.random.seed(99)

    assert resumed(loop, monkeypatch, 2).warden.resume() == 2
    got = numpy.concatenate([numpy.random.standard_normal(3), numpy.random.random_sample(3)])
    assert got.tobytes() == expected.tobytes()
    saved = load_saved(path)["rng"]["numpy"]
    assert {key: type(value) for key, value in saved.items()} == {
        "bit_generator": str,
        "keys": torch.Tensor,
        "pos": int,
        "has_gauss": int,
        "cached_gaussian": float,
    }
    assert (saved["bit_generator"], saved["keys"].dtype, saved["keys"].shape, saved["has_gauss"]) == (
        "MT19937",
        torch.int64,
        (624,),
        1,
    )


# Resumes rank 0 from step 2 in a process where `import numpy` fails, as on a machine without NumPy.
WITHOUT_NUMPY = """
import sys
sys.modules["numpy"] = None  # before torch: every `import numpy` now raises ImportError
import torch
from worker.warden import Warden
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
warden = Warden(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
print(warden.resume(), sys.modules["numpy"])
warden.finish()
"""


def test_numpy_state_is_left_unused_and_said_where_numpy_cannot_be_imported(loop, tmp_path, monkeypatch):
    """A checkpoint holding NumPy's RNG state resumes in a process that cannot import NumPy, logging
    `numpy_rng_not_restored` with the reason."""
    monkeypatch.setattr(worker.warden, "capture_rng", lambda: {"numpy": NUMPY_STATE, **capture_rng()})
    run, path = trained_and_saved(loop)
    run.warden.finish()
    assert "numpy" in load_saved(path)["rng"]

    env = {**os.environ, ENV_RESUME_STEP: "2"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_NUMPY], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, "2 None\n"), done.stderr[-3000:]
    (logged,) = events(tmp_path, "numpy_rng_not_restored")
    assert (logged["level"], logged["step"]) == ("warning", 2)
    assert logged["reason"] == (
        "numpy cannot be imported in this process (import of numpy halted; None in "
        "sys.modules), so nothing here can draw from its RNG; the saved NumPy RNG state is "
        "left unused"
    )
