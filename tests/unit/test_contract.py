"""The supervisor/worker contract: run-dir layout, complete checkpoints, atomic files, worker config, faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.contract import ENV_WORKER_CONFIG, RunLayout, WorkerConfig
from worker.faults import ENV_FAULTS, Fault, FaultPlan, flip_bit, parse_faults


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def save(layout: RunLayout, rank: int, *steps: int, prefix: str = "ckpt") -> None:
    """A finished save: the checkpoint file and, written after it, its completion record."""
    for step in steps:
        touch(layout.checkpoints.file(rank, step, prefix))
        touch(layout.checkpoints.record(rank, step, prefix))


def test_a_checkpoint_without_its_completion_record_does_not_count(tmp_path):
    """A rank file whose completion record is missing (killed between the two) leaves the step incomplete."""
    layout = RunLayout(tmp_path)
    save(layout, 0, 10, 20)
    save(layout, 1, 10)
    touch(layout.checkpoints.file(1, 20, "ckpt"))
    assert layout.checkpoints.complete_steps(2, "ckpt") == [10]


# ---- layout -----------------------------------------------------------------------------------


def test_run_layout_paths(tmp_path):
    """Every file of a run lives at its documented place under the run dir."""
    layout = RunLayout(tmp_path)
    assert layout.state_file == tmp_path / "supervisor" / "state.json"
    assert layout.journal == tmp_path / "supervisor" / "events.jsonl"
    assert layout.checkpoint_dir == tmp_path / "checkpoint"
    assert layout.rank_dir(3) == tmp_path / "ranks" / "rank_3"
    assert layout.heartbeat(3) == tmp_path / "ranks" / "rank_3" / "heartbeat.json"
    assert layout.rank_events(3) == tmp_path / "ranks" / "rank_3" / "events.jsonl"
    assert layout.attempt_log(2, 1, "err") == tmp_path / "logs" / "attempt_2" / "rank_1.err"
    assert layout.checkpoints.rank_dir(1) == tmp_path / "checkpoint" / "rank_1"
    assert layout.checkpoints.meta(1) == tmp_path / "checkpoint" / "rank_1" / "meta.json"


def test_checkpoint_file_name_follows_seed_format(tmp_path):
    """A checkpoint file is named PREFIX_rank_RANK-STEP.ckpt in its rank's directory (seed 001)."""
    path = RunLayout(tmp_path).checkpoints.file(1, 25, "demo")
    assert path == tmp_path / "checkpoint" / "rank_1" / "demo_rank_1-25.ckpt"


# ---- complete checkpoints -----------------------------------------------------------------------


def test_complete_checkpoint_steps_only_steps_on_every_rank(tmp_path):
    """Only steps whose checkpoint exists on every rank count."""
    layout = RunLayout(tmp_path)
    save(layout, 0, 25, 50, 75)
    save(layout, 1, 25, 50)
    save(layout, 2, 25, 75)
    assert layout.checkpoints.complete_steps(3, "ckpt") == [25]
    assert layout.checkpoints.complete_steps(2, "ckpt") == [25, 50]


def test_complete_checkpoint_steps_sorted_numerically(tmp_path):
    """Steps come back oldest first in numeric, not lexical, order."""
    layout = RunLayout(tmp_path)
    for rank in (0, 1):
        save(layout, rank, 100, 9, 10, 1000)
    assert layout.checkpoints.complete_steps(2, "ckpt") == [9, 10, 100, 1000]


def test_complete_checkpoint_steps_ignores_junk(tmp_path):
    """Stray files, temporaries, other prefixes, misplaced rank files and non-numeric steps are not checkpoints."""
    layout = RunLayout(tmp_path)
    save(layout, 0, 25)
    save(layout, 1, 25)
    d0, d1 = layout.checkpoints.rank_dir(0), layout.checkpoints.rank_dir(1)
    junk = [
        d0 / "notes.txt",
        d0 / "meta.json",
        d0 / ".ckpt_rank_0-50.ckpt.abc123.tmp",  # a torn save's temporary
        d1 / ".ckpt_rank_1-50.ckpt.def456.tmp",
        d0 / "ckpt_rank_0-50.ckpt.tmp",
        d1 / "ckpt_rank_1-50.ckpt.tmp",
        d0 / "other_rank_0-75.ckpt",  # another prefix
        d1 / "other_rank_1-75.ckpt",
        d0 / "ckpt_rank_0-100.ckpt",  # rank 1's step 100 sits in rank 0's directory
        d0 / "ckpt_rank_1-100.ckpt",
        d0 / "ckpt_rank_0-abc.ckpt",  # non-numeric steps
        d1 / "ckpt_rank_1-abc.ckpt",
        d0 / "ckpt_rank_0-.ckpt",
        d1 / "ckpt_rank_1-.ckpt",
        d0 / "ckpt_rank_0-125.pt",  # wrong extension
        d1 / "ckpt_rank_1-125.pt",
        tmp_path / "checkpoint" / "ckpt_rank_0-150.ckpt",  # outside any rank directory
    ]
    for path in junk:
        touch(path)
    assert layout.checkpoints.complete_steps(2, "ckpt") == [25]


def test_complete_checkpoint_steps_without_checkpoint_dir_is_empty(tmp_path):
    """A run dir with no checkpoint directory has no complete checkpoint."""
    assert RunLayout(tmp_path / "fresh").checkpoints.complete_steps(2, "ckpt") == []


def test_complete_checkpoint_steps_missing_rank_dir_means_none(tmp_path):
    """If one rank has never saved, no step is complete."""
    layout = RunLayout(tmp_path)
    save(layout, 0, 25, 50)
    assert layout.checkpoints.complete_steps(2, "ckpt") == []


def test_complete_checkpoint_steps_matches_prefix_exactly(tmp_path):
    """Only files of the configured prefix count, even when another prefix ends with it."""
    layout = RunLayout(tmp_path)
    for rank in (0, 1):
        save(layout, rank, 10, prefix="demo")
        save(layout, rank, 20, prefix="my_demo")
    assert layout.checkpoints.complete_steps(2, "demo") == [10]
    assert layout.checkpoints.complete_steps(2, "my_demo") == [20]


# ---- worker config ----------------------------------------------------------------------------


def test_worker_config_round_trips_to_env(monkeypatch):
    """A WorkerConfig passed through `to_env` comes back equal from `from_env`."""
    config = WorkerConfig(save_checkpoint_steps=25, prefix="demo", resume_training=False, heartbeat_interval_s=2.0)
    monkeypatch.setenv(ENV_WORKER_CONFIG, config.to_env())
    assert WorkerConfig.from_env() == config


def test_worker_config_from_env_ignores_unknown_keys(monkeypatch):
    """Keys a newer supervisor adds are ignored; known keys are kept."""
    monkeypatch.setenv(ENV_WORKER_CONFIG, json.dumps({"save_checkpoint_steps": 5, "future_knob": True}))
    assert WorkerConfig.from_env() == WorkerConfig(save_checkpoint_steps=5)


@pytest.mark.parametrize("value", [None, ""])
def test_worker_config_from_env_defaults_when_unset(monkeypatch, value):
    """With the variable unset or empty, the worker config is all defaults."""
    if value is None:
        monkeypatch.delenv(ENV_WORKER_CONFIG, raising=False)
    else:
        monkeypatch.setenv(ENV_WORKER_CONFIG, value)
    assert WorkerConfig.from_env() == WorkerConfig()


# ---- faults -----------------------------------------------------------------------------------


def test_parse_faults_valid_spec():
    """A comma-separated spec with spaces and an empty item parses into faults in order."""
    assert parse_faults(" 1:sigkill@25, 0:sigkill_in_save@50,") == [
        Fault(rank=1, kind="sigkill", step=25),
        Fault(rank=0, kind="sigkill_in_save", step=50),
    ]


def test_parse_faults_sdc_with_factor_and_layer():
    """An sdc fault takes an optional factor (nan and inf included) and, after it, the layer to corrupt."""
    spec = "1:sdc@20, 0:sdc@5:1e6:blocks.layers.0.norm1, 1:sdc@7:nan"
    first, second, third = parse_faults(spec)
    assert (first, second) == (
        Fault(rank=1, kind="sdc", step=20),
        Fault(rank=0, kind="sdc", step=5, arg=1e6, target="blocks.layers.0.norm1"),
    )
    assert (third.kind, third.step, third.target) == ("sdc", 7, None) and third.arg != third.arg  # NaN


def test_parse_faults_layer_only_for_sdc_and_bitflips():
    """Only sdc and bitflip faults name a layer; a layer on another kind is refused, naming the item."""
    with pytest.raises(ValueError, match=r"only sdc, bitflip, bitflip_persistent faults name a layer, in '1:spik"):
        parse_faults("1:spike@3:2:norm")


def test_bitflip_faults_take_a_bit_and_a_layer_and_refuse_other_bits():
    """`bitflip@STEP[:BIT[:LAYER]]`: the bit a whole number from 0 to 63."""
    assert parse_faults("1:bitflip@5:30:0.weight, 0:bitflip_persistent@3") == [
        Fault(rank=1, kind="bitflip", step=5, arg=30.0, target="0.weight"),
        Fault(rank=0, kind="bitflip_persistent", step=3),
    ]
    for bad in ("1:bitflip@5:64", "1:bitflip@5:2.5", "1:bitflip_persistent@5:-1"):
        with pytest.raises(ValueError, match="a bitflip fault's bit must be a whole number from 0 to 63"):
            parse_faults(bad)


def test_a_bitflip_strikes_once_and_a_persistent_one_from_its_step_on_in_every_attempt():
    """`bitflip` is due at its step until it struck; `bitflip_persistent` at every step from its own, announced once,
    also in a later attempt (a faulty GPU stays faulty)."""
    fired: list[Fault] = []
    once = FaultPlan(parse_faults("0:bitflip@5"), rank=0, attempt=0, on_fire=fired.append)
    assert once.bitflip(4) is None and once.bitflip(5) is not None
    once.flipped(once.bitflip(5), 5)  # type: ignore[arg-type]
    assert once.bitflip(5) is None and [f.kind for f in fired] == ["bitflip"]
    for attempt in (0, 2):
        fired.clear()
        stays = FaultPlan(parse_faults("0:bitflip_persistent@3"), rank=0, attempt=attempt, on_fire=fired.append)
        assert stays.bitflip(2) is None
        for step in (3, 4, 9):
            fault = stays.bitflip(step)
            assert fault is not None
            stays.flipped(fault, step)
        assert len(fired) == (1 if attempt == 0 else 0)  # announced once, where it is armed
    assert FaultPlan(parse_faults("1:bitflip_persistent@3"), rank=0, attempt=0).bitflip(5) is None  # another rank


def test_a_fault_named_by_host_and_local_rank_follows_that_machine_not_a_global_rank():
    """`node2/0:KIND@STEP` strikes the rank with local rank 0 on node2, whatever its global rank; on another host or
    local rank it is not this rank's, and a bad host part is refused by name."""
    (fault,) = parse_faults("node2/0:bitflip_persistent@3")
    assert (fault.host, fault.rank) == ("node2", 0)
    assert FaultPlan([fault], rank=6, attempt=1, where=("node2", 0)).bitflip(3) is not None
    assert FaultPlan([fault], rank=0, attempt=1, where=("node1", 0)).bitflip(3) is None
    assert FaultPlan([fault], rank=7, attempt=1, where=("node2", 1)).bitflip(3) is None
    assert FaultPlan([fault], rank=0, attempt=0).bitflip(3) is None  # where unknown: no host's fault
    with pytest.raises(ValueError, match=r"\[HOST/\]RANK"):
        parse_faults("node2/x:sigkill@3")


def test_flip_bit_flips_one_bit_of_the_first_element():
    """Bit 30 of a float32 gradient (its highest exponent bit) turns 1e-3 into ~3.4e35; bit 31 its sign; the rest
    of the tensor is untouched; a bit past the dtype's width is refused."""
    import torch

    grad = torch.tensor([1e-3, 2.0, -0.5])
    flip_bit(grad, Fault(0, "bitflip", 1))
    assert 3e35 < grad[0].item() < 4e35 and grad[1:].tolist() == [2.0, -0.5]
    flip_bit(grad, Fault(0, "bitflip", 1, 30.0))
    assert grad[0].item() == torch.tensor(1e-3).item()  # flipped back
    flip_bit(grad, Fault(0, "bitflip", 1, 31.0))
    assert grad[0].item() == -torch.tensor(1e-3).item()
    half = torch.tensor([1.0], dtype=torch.float16)
    with pytest.raises(ValueError, match="bit 16 is past a torch.float16 value's 16 bits"):
        flip_bit(half, Fault(0, "bitflip", 1, 16.0))


def test_fault_plan_strike_once_disarms():
    """`strike_once` returns an armed fault once; the same step attempted again finds nothing."""
    plan = FaultPlan([Fault(rank=0, kind="sdc", step=4)], rank=0, attempt=0)
    assert plan.armed("sdc") == [Fault(rank=0, kind="sdc", step=4)]
    assert plan.strike_once("sdc", 3) is None
    assert plan.strike_once("sdc", 4) == Fault(rank=0, kind="sdc", step=4)
    assert plan.strike_once("sdc", 4) is None and plan.armed("sdc") == []


def test_parse_faults_empty_spec():
    """An empty spec means no faults."""
    assert parse_faults("") == []


@pytest.mark.parametrize(
    ("spec", "bad"),
    [
        ("1sigkill@25", "1sigkill@25"),
        ("1:sigkill", "1:sigkill"),
        ("x:sigkill@3", "x:sigkill@3"),
        ("1:sigkill@ten", "1:sigkill@ten"),
        ("1:sigkill@", "1:sigkill@"),
        ("0:sigkill@5,1:explode@3", "1:explode@3"),
        ("0:sigkill@5, oops", "oops"),
    ],
)
def test_parse_faults_invalid_spec_names_bad_item(spec, bad):
    """An unparsable item or unknown kind raises ValueError naming the variable and the bad item."""
    with pytest.raises(ValueError) as info:
        parse_faults(spec)
    message = str(info.value)
    assert message.startswith(f"{ENV_FAULTS}: ")
    assert repr(bad) in message


def test_fault_plan_due_only_for_its_rank_kind_and_step():
    """A fault is due only on its own rank, for its kind and at its step."""
    faults = [Fault(rank=1, kind="sigkill", step=25)]
    plan = FaultPlan(faults, rank=1, attempt=0)
    assert plan.due("sigkill", 25)
    assert not plan.due("sigkill", 24)
    assert not plan.due("sigkill_in_save", 25)
    assert not FaultPlan(faults, rank=0, attempt=0).due("sigkill", 25)


def test_fault_plan_due_only_on_first_attempt():
    """A relaunched attempt never fires the faults, so it can pass the same step."""
    faults = [Fault(rank=0, kind="sigkill", step=25)]
    assert FaultPlan(faults, rank=0, attempt=0).due("sigkill", 25)
    assert not FaultPlan(faults, rank=0, attempt=1).due("sigkill", 25)


def test_a_slow_fault_stays_in_a_relaunched_attempt(monkeypatch):
    """A straggler's node stays slow after a relaunch: `slow` delays every step from its own on, in any attempt."""
    slept: list[float] = []
    monkeypatch.setattr("worker.faults.time.sleep", slept.append)
    faults = [Fault(rank=0, kind="slow", step=3, arg=0.25), Fault(rank=1, kind="slow", step=1)]
    for attempt in (0, 1):
        plan = FaultPlan(faults, rank=0, attempt=attempt)
        for step in range(1, 6):
            plan.in_compute(step)
    assert slept == [0.25] * 6


def test_fault_plan_from_env(monkeypatch):
    """`FaultPlan.from_env` arms the faults named in the environment."""
    monkeypatch.setenv(ENV_FAULTS, "0:sigkill_in_save@50")
    assert FaultPlan.from_env(rank=0, attempt=0).due("sigkill_in_save", 50)
    monkeypatch.delenv(ENV_FAULTS)
    assert not FaultPlan.from_env(rank=0, attempt=0).due("sigkill_in_save", 50)


def test_parse_faults_with_an_argument():
    """`RANK:KIND@STEP:ARG` carries an argument (seconds, repetitions); without one it is None."""
    assert parse_faults("0:slow_save@20:2.5,1:hang@7") == [
        Fault(rank=0, kind="slow_save", step=20, arg=2.5),
        Fault(rank=1, kind="hang", step=7, arg=None),
    ]


def test_fault_plan_announces_a_fault_before_it_strikes():
    """`due` reports the fault through `on_fire` exactly when it is due, so the rank can log it first."""
    fired: list[Fault] = []
    plan = FaultPlan([Fault(rank=0, kind="hang", step=3)], rank=0, attempt=0, on_fire=fired.append)
    assert plan.due("hang", 2) is None and fired == []
    assert plan.due("hang", 3) == Fault(rank=0, kind="hang", step=3)
    assert fired == [Fault(rank=0, kind="hang", step=3)]


def test_gradient_fault_repeats_as_often_as_asked():
    """`spike@STEP:3` strikes the first three attempts at STEP, then no more."""
    plan = FaultPlan(parse_faults("0:spike@5:3,0:nan@9"), rank=0, attempt=0)
    assert [plan.gradient_fault(5) for _ in range(4)] == ["spike", "spike", "spike", None]
    assert [plan.gradient_fault(9) for _ in range(2)] == ["nan", None]
    assert plan.gradient_fault(6) is None


def test_faults_once_fire_the_first_time_their_step_is_reached_in_any_attempt(tmp_path: Path) -> None:
    """TRAINWARDEN_FAULTS_ONCE: a mark in the rank's folder disarms a fault that fired, in every later attempt."""
    rank_dir = tmp_path / "ranks" / "rank_1"
    faults = [Fault(rank=1, kind="sigkill", step=25), Fault(rank=1, kind="hang", step=40)]
    first = FaultPlan(faults, rank=1, attempt=0, marks=rank_dir)
    assert first.due("sigkill", 25)
    later = FaultPlan(faults, rank=1, attempt=3, marks=rank_dir)  # a relaunch passes step 25, meets step 40
    assert not later.due("sigkill", 25) and later.due("hang", 40)
    assert not FaultPlan(faults, rank=1, attempt=4, marks=rank_dir).armed("hang")
    assert sorted(p.name for p in rank_dir.iterdir()) == ["fault_fired_hang_40", "fault_fired_sigkill_25"]


def test_a_fault_mark_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "ranks" / "rank_0").symlink_to(outside)
    plan = FaultPlan(
        [Fault(rank=0, kind="sigkill", step=5)], rank=0, attempt=0, marks=tmp_path / "run" / "ranks" / "rank_0"
    )
    with pytest.raises(OSError):
        plan.due("sigkill", 5)
    assert list(outside.iterdir()) == []
