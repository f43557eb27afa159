"""Weights out of a run: the model's state_dict of a checkpoint, without wrapper prefixes, as a plain file.

The file loads with `model.load_state_dict(torch.load(path, weights_only=True))` in a script that never
imports trainwarden. By default the checkpoint is the newest one a resume would pick (complete on every rank,
size and checksum as recorded, healthy); the choice is the supervisor's own (`supervisor.rundir.checkpoints`), so
export and resume never disagree. Of a per-rank checkpoint only rank 0's part is read (DistributedDataParallel
keeps every rank's model equal); a sharded one is consolidated from every rank's shard, in this one process; a
trainer's (worker.integrations) is read from its model file.
The one command that loads torch (on demand: only when a file is read or written; the import-linter contract that
keeps torch out of the supervisor names this module as its one exception).
"""

from __future__ import annotations

import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.checkpoint import CheckpointRefused, load_checkpoint
from worker.contract import EXIT_CHECKPOINT_REFUSED, EXIT_FAILED, RunLayout
from worker.files import atomic_write, open_regular, read_bytes
from worker.manifest import FRAMEWORK_FORMAT, read_manifest
from worker.store import (
    CheckpointStore,
    choose_explicit,
    choose_resume,
    prefixes,
    rank_0_steps,
    world_sizes,
)

__all__ = ["WRAPPER_PREFIXES", "ExportError", "Exported", "export_weights", "plain_state_dict"]

# What wrappers put before every key: DistributedDataParallel / DataParallel, and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_HF_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$", re.ASCII)  # the Trainer's, sharded or not


class ExportError(Exception):
    """Nothing was exported; the message says why on one line, `exit_code` is the command's exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Exported:
    """What `export_weights` wrote: which checkpoint, where, and what it passed over (newest first, with why)."""

    step: int
    path: Path
    tensors: int
    source: str  # "checkpoint", or "snapshot slot S"
    passed_over: tuple[tuple[int, str], ...] = ()


def plain_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """`state_dict` with wrapper prefixes (`module.`, `_orig_mod.`, nested in any order) removed from the front of
    its keys, one layer at a time while EVERY key carries the same one: a model of your own with a submodule named
    `module` beside other parameters keeps its names. Its `_metadata` (module versions) follows the keys."""
    keys, stripped = list(state_dict), ""
    while keys and (layer := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in keys)), None)):
        keys = [key.removeprefix(layer) for key in keys]
        stripped += layer
    plain = OrderedDict((key.removeprefix(stripped), value) for key, value in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if isinstance(metadata, Mapping):
        plain._metadata = _plain_metadata(metadata, stripped)  # type: ignore[attr-defined]  # torch's own convention
    return plain


def _plain_metadata(metadata: Mapping[str, Any], stripped: str) -> OrderedDict[str, Any]:
    """Module versions keyed like the plain state dict: the wrapped model's own entry becomes the root ('')."""
    if not stripped:
        return OrderedDict(metadata)
    inner = stripped.removesuffix(".")
    plain: OrderedDict[str, Any] = OrderedDict()
    for name, value in metadata.items():
        if name == inner:
            plain[""] = value
        elif name.startswith(stripped):
            plain[name.removeprefix(stripped)] = value
    return plain  # the wrappers' own entries are dropped


def export_weights(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, prefix: str | None = None
) -> Exported:
    """Write rank 0's model weights of checkpoint `step` (default: the newest usable one) of `run_dir` to `out`.

    Loads with weights_only only. `out` is written atomically: a symlink there is replaced by the file, never
    written through. ExportError (exit 1; 66 for a file refused as unsafe or damaged) says why nothing was.
    """
    layout = RunLayout(Path(run_dir))
    stores = layout.checkpoint_stores()
    prefix = prefix if prefix is not None else _discover_prefix(layout, stores)
    store, chosen, passed_over = _choose(layout, stores, prefix, step)
    state = (
        _sharded_model_state(layout, store, chosen, prefix)
        if store.is_sharded(chosen, prefix)
        else _model_state(store, chosen, prefix)
    )
    out = Path(out)
    _write(out, state)
    tensors = sum(1 for value in state.values() if _is_tensor(value))
    return Exported(chosen, out, tensors, store.label, passed_over)


def _discover_prefix(layout: RunLayout, stores: list[CheckpointStore]) -> str:
    """The one prefix rank 0 has complete checkpoints of; ExportError when there is none, or several."""
    found = set().union(*map(prefixes, stores))
    if not found:
        raise ExportError(
            f"no checkpoint in {layout.checkpoint_dir} (no complete rank_0/PREFIX_rank_0-STEP.ckpt "
            f"with its .json record, no PREFIX-STEP.dcp with its manifest)"
        )
    if len(found) > 1:
        raise ExportError(
            f"{layout.checkpoint_dir} holds checkpoints of several prefixes ({', '.join(sorted(found))})"
            f": name one with --prefix"
        )
    return found.pop()


def _choose(
    layout: RunLayout, stores: list[CheckpointStore], prefix: str, step: int | None
) -> tuple[CheckpointStore, int, tuple[tuple[int, str], ...]]:
    """The checkpoint to export, as the supervisor judges them, and the newer ones passed over on the way."""
    if step is not None:
        store = next((s for s in stores if step in rank_0_steps(s, prefix)), None)
        if store is None:
            raise ExportError(
                f"no complete checkpoint of step {step} in {layout.checkpoint_dir} "
                f"(complete: {_steps_named(stores, prefix)})"
            )
        world = _world_size(store, [step], prefix)
        choice = choose_explicit(store, world, prefix, step)  # named: complete and intact, healthy or not
        if choice.step is None:
            _, why = choice.passed_over[0]
            complete = step in store.complete_steps(world, prefix)
            raise ExportError(
                f"step {step} of {layout.root} is not usable: {why}",
                EXIT_CHECKPOINT_REFUSED if complete else EXIT_FAILED,
            )
        return store, step, ()
    newest = sorted({s for store in stores for s in rank_0_steps(store, prefix)}, reverse=True)
    if not newest:
        raise ExportError(f"no complete checkpoint with prefix {prefix!r} in {layout.checkpoint_dir}")
    world = _world_size(next(s for s in stores if newest[0] in rank_0_steps(s, prefix)), newest, prefix)
    choice = choose_resume(stores, world, prefix, require_healthy=True)
    if choice.step is None or choice.store is None:
        newest_step, why = choice.passed_over[0] if choice.passed_over else (newest[0], "not complete")
        raise ExportError(f"no usable checkpoint in {layout.checkpoint_dir} (newest, step {newest_step}: {why})")
    return choice.store, choice.step, choice.passed_over


def _world_size(store: CheckpointStore, steps: list[int], prefix: str) -> int:
    """How many ranks wrote the first of `steps` whose rank-0 record says (or whose rank dirs show); else 1."""
    sizes = world_sizes(store, steps, prefix)
    return next((sizes[step] for step in steps if sizes.get(step) is not None), None) or 1


def _steps_named(stores: list[CheckpointStore], prefix: str) -> str:
    """The newest ten steps rank 0 has complete, for a message."""
    steps = sorted({s for store in stores for s in rank_0_steps(store, prefix)})
    shown = ", ".join(map(str, steps[-10:])) or "none"
    return shown if len(steps) <= 10 else f"..., {shown}"


def _model_state(store: CheckpointStore, step: int, prefix: str) -> OrderedDict[str, Any]:
    """Rank 0's model state_dict of the checkpoint, plain; ExportError (66) for a file refused or without one."""
    try:
        payload = load_checkpoint(store, rank=0, step=step, prefix=prefix, weights_only=True)
    except CheckpointRefused as exc:
        raise ExportError(str(exc), EXIT_CHECKPOINT_REFUSED) from None
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, Mapping) or not all(isinstance(key, str) for key in model):
        path = store.file(0, step, prefix)
        raise ExportError(f"checkpoint {path} holds no model state_dict under 'model'", EXIT_CHECKPOINT_REFUSED)
    return plain_state_dict(model)


def _sharded_model_state(layout: RunLayout, store: CheckpointStore, step: int, prefix: str) -> OrderedDict[str, Any]:
    """Every rank's shards of the model, consolidated (the manifest and each file were checked by `_choose`); a
    trainer's checkpoint, its model file."""
    from worker.sharded import load_sharded_model

    directory = store.sharded_dir(step, prefix)
    if read_manifest(directory, step, format=None)["format"] == FRAMEWORK_FORMAT:
        return plain_state_dict(_framework_model(directory))
    try:
        model = load_sharded_model(directory, layout.root)
    except (OSError, ValueError, pickle.UnpicklingError, RuntimeError) as exc:
        raise ExportError(f"checkpoint {directory} refused: {exc}", EXIT_CHECKPOINT_REFUSED) from None
    if not model:
        raise ExportError(f"checkpoint {directory} holds no model state_dict under 'model'", EXIT_CHECKPOINT_REFUSED)
    return plain_state_dict(model)


def _framework_model(directory: Path) -> Mapping[str, Any]:
    """The model of a trainer's checkpoint (its files checked by `_choose`): Lightning's `model.ckpt` (its
    `state_dict`, loaded with weights_only), or the Hugging Face Trainer's `model*.safetensors` (no pickle at all)."""
    import torch

    manifest = read_manifest(directory, format=FRAMEWORK_FORMAT)
    names = sorted(manifest["files"])
    try:
        if manifest["framework"] == "lightning" and "model.ckpt" in names:
            with os.fdopen(open_regular(directory / "model.ckpt"), "rb") as f:
                saved = torch.load(f, map_location="cpu", weights_only=True)
            model = saved.get("state_dict") if isinstance(saved, dict) else None
        elif manifest["framework"] == "hf" and (weights := [n for n in names if _HF_WEIGHTS.match(n)]):
            from safetensors.torch import load as load_safetensors

            model = {}
            for name in weights:
                model.update(load_safetensors(read_bytes(directory / name, manifest["files"][name]["size"])))
        else:
            raise ExportError(
                f"checkpoint {directory}: {manifest['framework']}'s files {names[:6]} hold no model "
                f"this command reads (a sharded strategy's? consolidate it with the framework's tools)"
            )
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
        raise ExportError(f"checkpoint {directory} refused: {exc}", EXIT_CHECKPOINT_REFUSED) from None
    if not isinstance(model, Mapping) or not model:
        raise ExportError(f"checkpoint {directory} holds no model state_dict", EXIT_CHECKPOINT_REFUSED)
    return model


def _write(out: Path, state: OrderedDict[str, Any]) -> None:
    """torch.save `state` to `out` atomically, in an existing directory; a symlink at `out` is replaced."""
    import torch

    if out.name in ("", ".", "..") or (out.is_dir() and not out.is_symlink()):
        raise ExportError(f"cannot write {out}: a directory (name the output file)")
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: no directory {out.parent}")
    try:
        atomic_write(out, lambda f: torch.save(state, f), root=out.parent)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
