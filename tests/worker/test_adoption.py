"""The traps a real training loop met when it adopted the worker library, each closed: default checkpoints,
spike history across a resume, GradScaler and other extra state, prefetching, clean exits, no clipping."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.test_guard import events
from worker.anomaly import MonitorConfig
from worker.contract import ENV_RESUME_STEP, RunLayout, StopOrder, WorkerConfig
from worker.feature_rule import FeatureValueConfig
from worker.files import atomic_write_json
from worker.warden import UNREGISTERED_SCALER


def saved_steps(tmp_path: Path) -> list[int]:
    return sorted(RunLayout(tmp_path).checkpoints.steps(0, "ckpt"))


def test_a_config_without_a_step_count_saves_by_time(loop, tmp_path):
    """No `save_checkpoint_steps`: a checkpoint once the interval has passed, not never."""
    run = loop(config=WorkerConfig(save_checkpoint_interval_s=0.3))
    for _ in range(8):
        run.train_batch()
        time.sleep(0.1)
    steps = saved_steps(tmp_path)
    assert steps and all(later - earlier >= 2 for earlier, later in zip(steps, steps[1:], strict=False)), steps


def test_the_default_config_saves_every_ten_minutes():
    config = WorkerConfig()
    assert (config.save_checkpoint_steps, config.save_checkpoint_interval_s) == (0, 600.0)
    assert config.adaptive_spike.enabled and not config.use_skip_data_by_global_norm


def test_a_run_without_checkpoints_says_so_loudly_at_start(loop, tmp_path, capsys):
    run = loop(config=WorkerConfig(save_checkpoint_interval_s=0))
    assert "saves no checkpoints" in capsys.readouterr().err
    assert events(tmp_path, "checkpointing_off")
    for _ in range(3):
        run.train_batch()
    run.warden.finish()
    assert saved_steps(tmp_path) == []  # off means off, at the end too


def test_finish_saves_the_final_state_once(loop, tmp_path):
    run = loop(config=WorkerConfig(save_checkpoint_steps=5))
    for _ in range(7):
        run.train_batch()
    run.warden.finish()
    assert saved_steps(tmp_path) == [5, 7]


def test_step_done_says_whether_the_step_was_applied(loop):
    """A skipped batch repeats the step number; the return value tells a loop's own logging apart."""
    run = loop("0:nan@2")
    applied = []
    for _ in range(3):
        loss = run.backward()
        if run.warden.guard_step(loss, max_norm=1.0):
            run.optimizer.step()
        applied.append(run.warden.step_done(loss=loss))
    assert applied == [True, False, True] and run.warden.step == 2


def test_max_norm_none_means_no_clipping(loop):
    run = loop(config=WorkerConfig())
    loss = run.backward()
    before = [p.grad.clone() for p in run.model.parameters()]
    assert run.warden.guard_step(loss, max_norm=None)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, run.model.parameters(), strict=True))


# ---- the adaptive spike rule keeps its history across a resume ----------------------------------------------------


def test_a_spike_right_after_a_resume_is_skipped(loop, tmp_path, monkeypatch):
    """64 healthy steps of history go into the checkpoint, so the first step after the resume is judged too."""
    first = loop(config=WorkerConfig(save_checkpoint_steps=70))
    for _ in range(70):
        first.train_batch()
    first.warden.finish()
    monkeypatch.setenv(ENV_RESUME_STEP, "70")
    again = loop("0:spike@71", config=WorkerConfig(save_checkpoint_steps=70))
    again.warden.resume()
    assert not again.train_batch()
    (skipped,) = events(tmp_path, "step_skipped")
    assert (skipped["step"], skipped["reasons"]) == (71, ["global_norm_spike"])


def test_without_history_the_same_spike_would_be_applied(loop, tmp_path):
    """The control: a fresh detector has no history, and a spike at step 1 is only clipped."""
    run = loop("0:spike@1", config=WorkerConfig())
    assert run.train_batch() and events(tmp_path, "step_skipped") == []


# ---- extra state: GradScaler, EMA, anything with state_dict ----------------------------------------------------------


class Counter:
    """The smallest stateful object: a sampler's position, say."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def test_extra_state_is_saved_and_restored(loop, tmp_path, monkeypatch):
    counter = Counter()
    run = loop(config=WorkerConfig(save_checkpoint_steps=3), extra_state={"sampler": counter})
    for _ in range(3):
        counter.seen += 10
        run.train_batch()
    run.warden.finish()
    monkeypatch.setenv(ENV_RESUME_STEP, "3")
    restored = Counter()
    loop(config=WorkerConfig(), extra_state={"sampler": restored, "ema": Counter()}).warden.resume()
    assert restored.seen == 30
    assert [e["name"] for e in events(tmp_path, "extra_state_missing")] == ["ema"]


def test_extra_state_without_state_dict_is_refused_at_once(loop):
    with pytest.raises(TypeError, match=r"extra_state\['scaler'\]: needs .* state_dict"):
        loop(extra_state={"scaler": object()})


class AmpLoop:
    """One rank training a small MLP under torch.autocast on CPU, with a GradScaler for fp16, as the manual shows."""

    def __init__(
        self,
        loop: Any,
        dtype: torch.dtype,
        *,
        init_scale: float = 2.0**16,
        faults: str = "",
        config: WorkerConfig | None = None,
        registered: bool = True,
    ) -> None:
        torch.manual_seed(0)
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=dtype == torch.float16)
        self.run = loop(
            faults,
            config=config or WorkerConfig(save_checkpoint_steps=4),
            model=lambda: torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2)
            ),
            extra_state={"scaler": self.scaler} if registered else None,
        )

    def train(self, steps: int) -> None:
        run, warden = self.run, self.run.warden
        for _ in warden.steps(steps):
            data = torch.Generator().manual_seed(warden.batches)
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            with torch.autocast("cpu", dtype=self.dtype):
                loss = torch.nn.functional.mse_loss(run.model(x).float(), y)
            run.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(run.optimizer)  # guard_step sees (and clips) the true gradients
            if warden.guard_step(loss.item(), max_norm=1.0):
                self.scaler.step(run.optimizer)
                run.scheduler.step()
            self.scaler.update()  # after every batch, skipped or not: an overflow lowers the scale
            warden.step_done(loss=loss.item())
        warden.finish()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.run.model.state_dict(),
            "optimizer": self.run.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": torch.get_rng_state(),
        }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_amp_training_resumes_bitwise(loop, tmp_path, monkeypatch, dtype):
    """Uninterrupted 10 steps vs 8 steps, then a new process's worth of objects resuming from step 8: equal."""
    whole = AmpLoop(loop, dtype)
    whole.train(10)
    expected = whole.state()
    monkeypatch.setenv("TRAINWARDEN_RUN_DIR", str(tmp_path / "second"))
    first = AmpLoop(loop, dtype)
    first.train(8)
    monkeypatch.setenv(ENV_RESUME_STEP, "8")
    again = AmpLoop(loop, dtype)
    again.train(10)
    assert_same(again.state(), expected)
    if dtype == torch.float16:
        assert again.scaler.state_dict()["scale"] == expected["scaler"]["scale"]


def test_grad_scaler_overflows_are_skipped_without_counting_as_anomalies(loop, tmp_path):
    """A huge initial scale overflows fp16 for many steps in a row: each is skipped by the scaler's rule, none is
    an anomaly, so the 3-skip abort of the guarded config never fires, and training goes on once the scale fits."""
    guarded = WorkerConfig(
        save_checkpoint_steps=0,
        use_skip_data_by_global_norm=True,
        monitor_config=MonitorConfig(global_norm_spike_count_threshold=3),
    )
    amp = AmpLoop(loop, torch.float16, init_scale=2.0**40, config=guarded)
    amp.train(5)
    overflows = events(tmp_path, "amp_overflow")
    assert len(overflows) >= 3 and events(tmp_path, "step_skipped") == []
    assert amp.run.warden.step == 5 and amp.scaler.get_scale() < 2.0**40


# ---- prefetching and clean exits -----------------------------------------------------------------------------------


def prefetching_loop(run: Any, steps: int, *, by_index: bool) -> None:
    """nanoGPT's shape: the next batch is fetched before the current step is done (here, before backward)."""
    warden = run.warden

    def fetch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index) if by_index else None  # None: the global RNG (the trap)
        return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)

    batch = None
    for _ in warden.steps(steps):
        x, y = batch if batch is not None else fetch(warden.batches)
        loss = torch.nn.functional.mse_loss(run.model(x), y)
        batch = fetch(warden.batches + 1)  # prefetch: the index says which batch, whatever happens in between
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if warden.guard_step(loss.item(), max_norm=1.0):
            run.optimizer.step()
        warden.step_done(loss=loss.item())
    warden.finish()


@pytest.mark.parametrize("by_index", [True, False], ids=["by-index", "global-rng"])
def test_prefetch_by_index_resumes_exactly_and_from_the_global_rng_does_not(loop, tmp_path, monkeypatch, by_index):
    """Also the replay check's verdict (worker.verify_resume): the losses of the two batches after step 4, kept
    by the run that saved it, are repeated by the resumed run, or the first that differs is named."""
    config = WorkerConfig(save_checkpoint_steps=4, verify_resume=2)
    whole = loop(config=config)
    prefetching_loop(whole, 8, by_index=by_index)
    second = tmp_path / "second"
    monkeypatch.setenv("TRAINWARDEN_RUN_DIR", str(second))
    prefetching_loop(loop(config=config), 6, by_index=by_index)
    monkeypatch.setenv(ENV_RESUME_STEP, "4")
    again = loop(config=config)
    prefetching_loop(again, 8, by_index=by_index)
    pairs = zip(whole.model.parameters(), again.model.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    assert same == by_index  # the manual's rule, shown both ways
    if by_index:
        assert [(e["step"], e["batches"]) for e in events(second, "resume_verified")] == [(4, 2)]
        assert events(second, "resume_inexact") == []
    else:
        (inexact,) = events(second, "resume_inexact")
        assert inexact["reason"].startswith("the resumed run differs from the run before at batch 1 after step 4")
        assert json.loads(RunLayout(second).heartbeat(0).read_text())["inexact"] == inexact["reason"]


def test_an_unregistered_grad_scaler_is_said_after_the_first_step_and_a_registered_one_is_not(
    loop, tmp_path, monkeypatch
):
    """A GradScaler in use but not in extra_state: `resume_inexact` after the first step (not in the first save's
    stall), in the log and the heartbeat (the supervisor journals it and `status` shows it); registered, nothing is
    said."""
    gc.collect()  # a scaler of an earlier test, unreachable but not yet collected, must not count
    AmpLoop(loop, torch.float16).train(2)
    assert events(tmp_path, "resume_inexact") == []
    monkeypatch.setenv("TRAINWARDEN_RUN_DIR", str(tmp_path / "unregistered"))
    AmpLoop(loop, torch.float16, registered=False).train(2)
    (inexact,) = events(tmp_path / "unregistered", "resume_inexact")
    assert (inexact["step"], inexact["reason"]) == (1, UNREGISTERED_SCALER)
    heartbeat = RunLayout(tmp_path / "unregistered").heartbeat(0)
    assert json.loads(heartbeat.read_text())["inexact"] == UNREGISTERED_SCALER


def test_a_stop_ends_a_loop_that_asks_and_the_code_after_it_runs(loop, tmp_path):
    run = loop(config=WorkerConfig(save_checkpoint_steps=0))
    atomic_write_json(RunLayout(tmp_path).stop_order, asdict(StopOrder(1, 3, True)), root=tmp_path)
    done = []
    for _ in run.warden.steps(20):
        run.train_batch()
    done.append(run.warden.step)  # after the loop: a final export, wandb.finish()...
    run.warden.finish()
    assert done == [3] and saved_steps(tmp_path) == [3]
    (finished,) = events(tmp_path, "rank_finished")
    assert finished["step"] == 3
    records = [json.loads(p.read_text()) for p in (tmp_path / "checkpoint" / "rank_0").glob("ckpt_rank_0-*.json")]
    assert [r["step"] for r in records] == [3]  # finish() did not save the same step twice


def layer_norm_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))


def scaled_steps(run: Any, scaler: Any, steps: int, dtype: torch.dtype | None) -> None:
    for _ in run.warden.steps(steps):
        data = torch.Generator().manual_seed(run.warden.batches)
        x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.mse_loss(run.model(x).float(), y)
        run.optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(run.optimizer)
        if run.warden.guard_step(loss.item(), max_norm=1.0):
            scaler.step(run.optimizer)
        scaler.update()
        run.warden.step_done(loss=loss.item())


def test_an_overflow_is_no_feature_value_fault_and_values_are_judged_unscaled(loop, tmp_path, monkeypatch):
    """Seed 002's check sees the scaled activation gradients: an overflow's inf must not abort (level 2), and a
    healthy value is judged as it would be without the scaler (x 2**16 would cross the thresholds)."""
    checked = WorkerConfig(save_checkpoint_steps=0, feature_value_check=FeatureValueConfig(level=3, min_steps=0))
    overflowing = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    scaled_steps(
        loop(config=checked, model=layer_norm_model, extra_state={"scaler": overflowing}), overflowing, 2, torch.float16
    )
    assert events(tmp_path, "amp_overflow") and events(tmp_path, "feature_value_fault") == []
    values = {}
    for name, scaler in (
        ("plain", torch.amp.GradScaler("cpu", enabled=False)),
        ("scaled", torch.amp.GradScaler("cpu", init_scale=2.0**16)),
    ):
        monkeypatch.setenv("TRAINWARDEN_RUN_DIR", str(tmp_path / name))
        scaled_steps(loop(config=checked, model=layer_norm_model, extra_state={"scaler": scaler}), scaler, 1, None)
        values[name] = [e["val"] for e in events(tmp_path / name, "feature_value_normal")]
    assert values["plain"] and values["scaled"] == values["plain"]  # a power-of-two scale divides out exactly


def test_the_feature_value_history_survives_a_resume(loop, tmp_path, monkeypatch):
    """Seed 002's `min_steps` warm-up and `pre_val`/`min_val`/`max_val` continue after a resume, like the spike
    rule's history: the first value judged after resuming from step 5 has 5 values behind it."""
    checked = WorkerConfig(save_checkpoint_steps=5, feature_value_check=FeatureValueConfig(level=3, min_steps=0))
    first = loop(config=checked, model=layer_norm_model)
    for _ in range(5):
        first.train_batch()
    first.warden.finish()
    before = events(tmp_path, "feature_value_normal")[-1]
    monkeypatch.setenv(ENV_RESUME_STEP, "5")
    again = loop(config=checked, model=layer_norm_model)
    again.warden.resume()
    again.train_batch()
    after = events(tmp_path, "feature_value_normal")[-1]
    assert after["checks"] == 5 and after["pre_val"] == before["val"]


def test_without_guard_step_a_time_based_save_comes_at_a_tenth_step(loop, tmp_path):
    """No guard_step to agree in: the ranks agree every 10th step (one tiny all-reduce), so saves land there."""
    run = loop(config=WorkerConfig(save_checkpoint_interval_s=0.01))
    for _ in range(25):
        loss = run.backward()
        run.optimizer.step()
        time.sleep(0.002)
        run.warden.step_done(loss=loss)
    assert saved_steps(tmp_path) == [10, 20]
