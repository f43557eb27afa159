"""`trainwarden export`: a checkpoint's model weights as a plain state_dict that loads without trainwarden, bit for
bit; wrapper prefixes stripped only when every key has them; unusable, missing and symlinked files refused."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from supervisor.cli import main
from supervisor.export import plain_state_dict
from tests.checkpoint_files import assert_bitwise_equal
from worker.contract import EXIT_CHECKPOINT_REFUSED, RunLayout, WorkerConfig

REPO = Path(__file__).resolve().parents[2]
# The user's model, defined the same way here and in the plain script that loads the export: a submodule named
# `module` beside others (which must keep its name) and a BatchNorm (buffers, and a version in `_metadata`).
NET_SOURCE = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.module = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.norm(self.module(x)))
"""
# A script that never imports trainwarden: loads the export strictly into a fresh Net and saves what it got.
PLAIN_LOAD = (
    NET_SOURCE
    + """
import sys
net = Net()
net.load_state_dict(torch.load(sys.argv[1], weights_only=True))
assert not {"worker", "supervisor"} & set(sys.modules), "trainwarden was imported"
torch.save(net.state_dict(), sys.argv[2])
"""
)
_namespace: dict[str, Any] = {}
exec(NET_SOURCE, _namespace)
Net = _namespace["Net"]
NET_TENSORS = 9  # module.{weight,bias}, norm.{weight,bias,running_mean,running_var,num_batches_tracked}, head.*


class Wrapper(torch.nn.Module):
    """Holds its model at attribute `name`, as DistributedDataParallel (`module`) and torch.compile (`_orig_mod`) do."""

    def __init__(self, name: str, inner: torch.nn.Module) -> None:
        super().__init__()
        self.name = name
        setattr(self, name, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(x)


def trained(loop: Any, wrap: Callable[[torch.nn.Module], torch.nn.Module], saves: tuple[int, ...]) -> dict[int, Any]:
    """Train a wrapped Net under a Warden, saving at each of `saves`; the unwrapped Net's state_dict at each."""
    net = Net()
    run = loop(config=WorkerConfig(), model=lambda: wrap(net))
    expected = {}
    for step in saves:
        for _ in range(20):  # bounded: a skipped batch does not advance the step
            if run.warden.step >= step:
                break
            run.train_batch()
        assert run.warden.step == step
        run.warden.save(step)
        expected[step] = copy.deepcopy(net.state_dict())
    run.warden.finish()
    return expected


def ddp_of_compiled(net: torch.nn.Module) -> torch.nn.Module:
    return Wrapper("module", Wrapper("_orig_mod", net))


def compiled_ddp(net: torch.nn.Module) -> torch.nn.Module:
    return Wrapper("_orig_mod", Wrapper("module", net))


def export_command(run_dir: Path, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`trainwarden export`, the command."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "export", str(run_dir), "-o", str(out), *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def export(run_dir: Path, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """The command's code and output, run in this process: each start of the command imports torch (1 s of CPU)."""
    argv = ["export", str(run_dir), "-o", str(out), *options]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def said(done: subprocess.CompletedProcess[str]) -> str:
    """The command's own stderr lines (torch may warn on import where NumPy is not installed)."""
    return "".join(line for line in done.stderr.splitlines(keepends=True) if line.startswith("trainwarden: "))


def loaded_without_trainwarden(path: Path, tmp_path: Path) -> Any:
    """The state_dict a fresh Net has after loading `path` strictly, in a process that never imports trainwarden."""
    again = tmp_path / "reloaded.pt"
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(path), str(again)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(again, weights_only=True)


def test_export_writes_the_newest_checkpoints_weights_loadable_without_trainwarden(loop, tmp_path):
    """By default the newest usable checkpoint is exported; a plain script loads it strictly, equal bit for bit."""
    expected = trained(loop, ddp_of_compiled, saves=(2, 3))
    out = tmp_path / "model.pt"

    done = export_command(tmp_path, out)

    assert (done.returncode, said(done)) == (0, "")
    assert done.stdout == f"exported step 3 of {tmp_path} ({NET_TENSORS} tensors) to {out}\n"
    assert_bitwise_equal(loaded_without_trainwarden(out, tmp_path), expected[3])
    assert_bitwise_equal(dict(torch.load(out, weights_only=True)), dict(expected[3]))  # the weights and nothing else


def test_export_step_picks_an_older_checkpoint(loop, tmp_path):
    """`--step 2` exports step 2's weights although step 3 is newer (wrappers nested the other way round)."""
    expected = trained(loop, compiled_ddp, saves=(2, 3))
    out = tmp_path / "model.pt"

    done = export(tmp_path, out, "--step", "2")

    assert (done.returncode, done.stdout) == (0, f"exported step 2 of {tmp_path} ({NET_TENSORS} tensors) to {out}\n")
    assert_bitwise_equal(loaded_without_trainwarden(out, tmp_path), expected[2])


def test_no_checkpoint_is_one_line_and_exit_1(tmp_path):
    """A run dir without checkpoints: exit 1, one line naming the checkpoint dir, nothing written."""
    out = tmp_path / "model.pt"
    done = export(tmp_path, out)
    assert (done.returncode, done.stdout) == (1, "")
    assert said(done) == (
        f"trainwarden: no checkpoint in {tmp_path / 'checkpoint'} (no complete "
        f"rank_0/PREFIX_rank_0-STEP.ckpt with its .json record, no PREFIX-STEP.dcp with its "
        f"manifest)\n"
    )
    assert not out.exists()


def test_a_step_without_a_checkpoint_is_refused_naming_the_ones_there(loop, tmp_path):
    """`--step 7` where only steps 2 and 3 were saved: exit 1, listing the complete steps."""
    trained(loop, ddp_of_compiled, saves=(2, 3))
    done = export(tmp_path, tmp_path / "model.pt", "--step", "7")
    assert (done.returncode, done.stdout) == (1, "")
    assert said(done) == (
        f"trainwarden: no complete checkpoint of step 7 in {tmp_path / 'checkpoint'} (complete: 2, 3)\n"
    )


def symlinked(tmp_path: Path, step: int) -> Path:
    """Replace rank 0's checkpoint file of `step` by a symlink to an identical copy (its record still matches)."""
    path = RunLayout(tmp_path).checkpoints.file(0, step, "ckpt")
    copied = tmp_path / "elsewhere.ckpt"
    path.rename(copied)
    path.symlink_to(copied)
    return path


def test_a_symlinked_checkpoint_named_by_step_is_refused_with_exit_66(loop, tmp_path):
    """A symlink in place of the checkpoint file is never followed: `--step` of it exits 66 naming it."""
    trained(loop, ddp_of_compiled, saves=(2, 3))
    path = symlinked(tmp_path, 3)
    out = tmp_path / "model.pt"

    done = export(tmp_path, out, "--step", "3")

    assert (done.returncode, done.stdout) == (EXIT_CHECKPOINT_REFUSED, "")
    assert said(done) == (
        f"trainwarden: step 3 of {tmp_path} is not usable: unreadable checkpoint file on rank 0: "
        f"[Errno 40] a symbolic link (not followed): '{path}'\n"
    )
    assert not out.exists()


def test_the_default_passes_over_a_symlinked_checkpoint_saying_so(loop, tmp_path):
    """Without `--step`, a symlinked newest checkpoint is passed over (as a resume would) and the older one exported."""
    expected = trained(loop, ddp_of_compiled, saves=(2, 3))
    path = symlinked(tmp_path, 3)
    out = tmp_path / "model.pt"

    done = export(tmp_path, out)

    assert done.returncode == 0, done.stderr
    assert said(done) == (
        f"trainwarden: passed over step 3: unreadable checkpoint file on rank 0: [Errno 40] "
        f"a symbolic link (not followed): '{path}'\n"
    )
    assert done.stdout == f"exported step 2 of {tmp_path} ({NET_TENSORS} tensors) to {out}\n"
    assert_bitwise_equal(loaded_without_trainwarden(out, tmp_path), expected[2])


def test_a_corrupted_checkpoint_named_by_step_is_refused_with_exit_66(loop, tmp_path):
    """A checkpoint whose bytes differ from its record's checksum is refused (exit 66), never loaded."""
    trained(loop, ddp_of_compiled, saves=(2,))
    path = RunLayout(tmp_path).checkpoints.file(0, 2, "ckpt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    done = export(tmp_path, tmp_path / "model.pt", "--step", "2")

    assert (done.returncode, said(done)) == (
        EXIT_CHECKPOINT_REFUSED,
        f"trainwarden: step 2 of {tmp_path} is not "
        "usable: corrupted on rank 0: checksum differs from the one written\n",
    )


def test_several_prefixes_need_prefix(loop, tmp_path):
    """Checkpoints of two prefixes: exit 1 asking for `--prefix`; with it, that prefix's checkpoint is exported."""
    expected = trained(loop, ddp_of_compiled, saves=(2,))
    store = RunLayout(tmp_path).checkpoints
    for source, target in (
        (store.file(0, 2, "ckpt"), store.file(0, 2, "old")),
        (store.record(0, 2, "ckpt"), store.record(0, 2, "old")),
    ):
        target.write_bytes(source.read_bytes())
    out = tmp_path / "model.pt"

    ambiguous = export(tmp_path, out)
    chosen = export(tmp_path, out, "--prefix", "old")

    assert (ambiguous.returncode, said(ambiguous)) == (
        1,
        f"trainwarden: {tmp_path / 'checkpoint'} holds "
        "checkpoints of several prefixes (ckpt, old): name one with "
        "--prefix\n",
    )
    assert chosen.returncode == 0, chosen.stderr
    assert_bitwise_equal(loaded_without_trainwarden(out, tmp_path), expected[2])


def test_a_symlink_at_the_output_path_is_replaced_not_written_through(loop, tmp_path):
    """`-o link` where `link` points at another file: the link becomes the export, the file it pointed at stays."""
    trained(loop, ddp_of_compiled, saves=(2,))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "model.pt"
    link.symlink_to(victim)

    done = export(tmp_path, link)

    assert done.returncode == 0, done.stderr
    assert (link.is_symlink(), victim.read_text()) == (False, "keep me\n")
    assert os.stat(link).st_size > 0


# ---- plain_state_dict, pure ----------------------------------------------------------------------------------------


def keys(state: dict[str, Any]) -> list[str]:
    return list(plain_state_dict(state))


@pytest.mark.parametrize(
    "wrapped",
    [
        ["module._orig_mod.a.w", "module._orig_mod.b"],
        ["_orig_mod.module.a.w", "_orig_mod.module.b"],
        ["module.module._orig_mod.a.w", "module.module._orig_mod.b"],
    ],
)
def test_wrapper_prefixes_nested_in_any_order_are_stripped(wrapped):
    """`module.` and `_orig_mod.` layers every key carries are stripped, however they nest."""
    assert keys(dict.fromkeys(wrapped, 0)) == ["a.w", "b"]


def test_a_submodule_named_module_beside_others_keeps_its_name():
    """A model's own `module` submodule is not a wrapper when other keys lack the prefix: nothing is stripped."""
    assert keys(dict.fromkeys(["module.weight", "head.weight"], 0)) == ["module.weight", "head.weight"]


def test_a_wrapped_model_with_a_submodule_named_module_loses_only_the_wrapper():
    """DDP around such a model: the one layer every key carries goes, the model's own `module.` stays."""
    wrapped = ["module.module.weight", "module.head.weight"]
    assert keys(dict.fromkeys(wrapped, 0)) == ["module.weight", "head.weight"]


def test_a_prefix_only_some_keys_carry_inside_a_name_is_left():
    """Only leading wrapper layers go; `module` or `_orig_mod` further inside a key is the model's own name."""
    assert keys(dict.fromkeys(["_orig_mod.enc._orig_mod.w", "_orig_mod.head.w"], 0)) == ["enc._orig_mod.w", "head.w"]


def test_an_empty_state_dict_stays_empty():
    """A model without parameters or buffers exports an empty mapping (and does not loop)."""
    assert plain_state_dict({}) == OrderedDict()


def test_module_versions_follow_the_keys():
    """`_metadata` is re-keyed like the state dict: the wrapped model's entry becomes the root, wrappers' go."""
    state = Wrapper("module", Wrapper("_orig_mod", Net())).state_dict()
    plain = plain_state_dict(state)
    assert plain._metadata == Net().state_dict()._metadata
    assert list(plain) == list(Net().state_dict())
