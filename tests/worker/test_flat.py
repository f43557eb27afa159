"""Memory snapshots in worker.flat's layout: what a checkpoint holds comes back bitwise and of the same types, what
the layout cannot hold falls back to torch.save's, and a damaged or crafted file is refused with a reason."""

from __future__ import annotations

import contextlib
import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.checkpoint_files import assert_bitwise_equal
from worker import flat
from worker.checkpoint import CheckpointRefused, capture_rng, read_checkpoint_file, save_checkpoint
from worker.store import CheckpointStore


def checkpoint_content() -> dict:
    """What the Warden saves, from a real model and optimizer that have stepped, with odd corners besides."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model[0](torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    return {
        "format_version": 3,
        "step": 7,
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "optimizer": optimizer.state_dict(),  # int keys, tuples, None, bools
        "rng": capture_rng(),
        "floats": [float("nan"), float("inf"), -float("inf"), 0.1, -0.0, 1e300],
        "dtypes": {str(t.dtype): t for t in (torch.ones(2, dtype=torch.bfloat16), torch.tensor([True, False]),
                                             torch.arange(3, dtype=torch.int16), torch.tensor(5.0),
                                             torch.empty(0, 3), torch.ones(2, 2, dtype=torch.complex64))},
        "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: saved as its values
        "nested": ((1, [2, {"a": None}]), "text", True),
    }  # fmt: skip


def write_snapshot(tmp_path: Path, content: dict) -> Path:
    store = CheckpointStore(tmp_path / "memory")
    return save_checkpoint(store, rank=0, step=7, prefix="ckpt", payload=content, health={}, in_memory=True)


def test_a_snapshot_comes_back_bitwise_with_its_types_and_module_metadata(tmp_path: Path) -> None:
    content = checkpoint_content()
    path = write_snapshot(tmp_path, content)
    assert flat.is_flat(path.read_bytes()[:8])
    loaded = read_checkpoint_file(path)
    assert_bitwise_equal(loaded, {**content, "format_version": 3, "step": 7})
    assert loaded["model"]._metadata == content["model"]._metadata  # what load_state_dict reads versions from
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(3)).load_state_dict(
        loaded["model"]
    )


@pytest.mark.parametrize(
    "unfit",
    [{1: "int", "a": "str"}, object(), torch.ones(2, requires_grad=True), OrderedDict({1: 2}), {1.5: "float key"}],
    ids=["mixed keys", "an object", "a tensor with autograd", "an OrderedDict with int keys", "a float key"],
)
def test_what_the_layout_cannot_hold_is_saved_as_torch_saves_it(tmp_path: Path, unfit: object) -> None:
    assert flat.encode({"x": unfit}) is None
    if isinstance(unfit, torch.Tensor) or type(unfit) is object:
        return  # torch.save of these is not loadable weights-only, which is the library's own refusal elsewhere
    path = write_snapshot(tmp_path, {"x": unfit})
    assert path.read_bytes()[:2] == b"PK"  # torch.save's zip
    assert read_checkpoint_file(path)["x"] == unfit


def flat_file(tmp_path: Path) -> Path:
    return write_snapshot(tmp_path, {"weights": torch.arange(6.0), "step_count": 3})


def rewrite_header(path: Path, change) -> None:  # noqa: ANN001 - a function of the header dict, or the new text
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    body = (
        change.encode() if isinstance(change, str) else json.dumps(change(json.loads(data[16 : 16 + length]))).encode()
    )
    head = flat.MAGIC + len(body).to_bytes(8, "little") + body
    pad = -len(head) % flat.ALIGN
    path.write_bytes(head + bytes(pad) + data[-((len(data) - 16 - length) // flat.ALIGN * flat.ALIGN) :])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:20]), "runs past the file"),
        (lambda p: p.write_bytes(p.read_bytes()[:-64]), "lie past the file"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tensors": [["float32", [6], 0, 999]]}), "do not match"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tensors": [["posix.system", [6], 0, 24]]}), "unknown dtype"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tree": {"__reduce__": "os.system"}}), "unknown node"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tree": {"T": 5}}), "unknown node"),
        (lambda p: rewrite_header(p, lambda h: {"tree": 1}), "not this layout"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tree": {"l": 7}}), "not a list"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tree": [1, 2]}), "unknown node"),
        (lambda p: rewrite_header(p, lambda h: {**h, "tree": {"i": [["1", 2]]}}), r"not a \[int, value\] pair"),
        (lambda p: rewrite_header(p, '{"tree":' + '{"l":[' * 5000 + "1" + "]}" * 5000 + ',"tensors":[]}'),
         "this layout|too deeply"),
    ],
    ids=["torn header", "torn data", "wrong size", "unknown dtype", "unknown node", "no such tensor", "no tree",
         "bad list", "a JSON list", "bad key", "deep nesting"],
)  # fmt: skip
def test_a_damaged_or_crafted_flat_file_is_refused_with_a_reason(tmp_path: Path, damage, reason: str) -> None:  # noqa: ANN001
    path = flat_file(tmp_path)
    damage(path)
    with pytest.raises(CheckpointRefused, match=reason):
        read_checkpoint_file(path)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_change_to_a_flat_file_loads_or_is_refused(tmp_path_factory, data) -> None:  # noqa: ANN001
    path = flat_file(tmp_path_factory.mktemp("fuzz"))
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(16, len(raw)))
    with contextlib.suppress(ValueError):  # refused, in words; any other exception fails the test
        flat.decode(bytearray(raw[:cut]))


def test_a_snapshot_of_random_data_is_a_fast_and_faithful_round_trip() -> None:
    rng = random.Random(3)
    content = {f"layer{i}": torch.randn(rng.randint(0, 40), 3) for i in range(50)}
    assert_bitwise_equal(flat.decode(bytearray(b"".join(flat.encode(content) or []))), content)


def test_a_loaded_rng_state_can_be_set(tmp_path: Path) -> None:
    """Every tensor has a storage of its own: torch.set_rng_state reads a state's storage from its start."""
    torch.manual_seed(5)
    state = torch.get_rng_state()
    path = write_snapshot(tmp_path, {"before": torch.ones(3), "rng": state})
    torch.manual_seed(6)
    torch.set_rng_state(read_checkpoint_file(path)["rng"])
    assert torch.equal(torch.get_rng_state(), state)
