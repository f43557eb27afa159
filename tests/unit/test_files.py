"""Run-dir file access against hostile files: symlinks, FIFOs, devices, directories, huge and odd JSON."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.hostile import KINDS, bounded, plant
from worker.files import (
    MAX_INT,
    Refused,
    atomic_write_bytes,
    atomic_write_json,
    ensure_dir,
    open_append,
    parse_json,
    read_bytes,
    read_json,
    unlink_quietly,
)


def test_atomic_write_json_replaces_content_and_leaves_no_temp(tmp_path: Path) -> None:
    """Writing twice leaves exactly the target file holding the second value, readable by its owner only."""
    path = tmp_path / "state.json"
    atomic_write_json(path, {"step": 1}, root=tmp_path)
    atomic_write_json(path, {"step": 2, "ranks": [0, 1]}, root=tmp_path)
    assert os.listdir(tmp_path) == ["state.json"]
    assert read_json(path) == {"step": 2, "ranks": [0, 1]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_atomic_write_json_creates_parent_dirs_owner_only(tmp_path: Path) -> None:
    """The parent directories of the target are created as needed, mode 0700."""
    path = tmp_path / "a" / "b" / "meta.json"
    atomic_write_json(path, [1, 2], root=tmp_path, durable=False)
    assert json.loads(path.read_text()) == [1, 2]
    assert os.listdir(path.parent) == ["meta.json"]
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700


def test_atomic_write_failure_keeps_old_content_and_no_temp(tmp_path: Path) -> None:
    """A write that fails midway leaves the old content in place and no temporary file."""
    path = tmp_path / "state.json"
    atomic_write_json(path, {"step": 1}, root=tmp_path)
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes", root=tmp_path)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == ["state.json"]
    assert read_json(path) == {"step": 1}


def test_atomic_write_json_refuses_nan(tmp_path: Path) -> None:
    """NaN is never written, so no reader of ours meets it in a file we made."""
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"v": float("nan")}, root=tmp_path)


def test_atomic_write_does_not_follow_a_symlinked_directory(tmp_path: Path) -> None:
    """A directory inside the run dir replaced by a symlink to elsewhere is refused; nothing lands outside."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / "supervisor").symlink_to(outside)
    with pytest.raises(Refused):
        atomic_write_json(run / "supervisor" / "state.json", {}, root=run)
    assert os.listdir(outside) == []


def test_atomic_write_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    """A symlink at the target name is replaced by our file; its target is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "state.json").symlink_to(victim)
    atomic_write_json(run / "state.json", {"ok": 1}, root=run)
    assert victim.read_text() == "precious"
    assert not (run / "state.json").is_symlink() and read_json(run / "state.json") == {"ok": 1}


def test_writes_outside_the_root_are_refused(tmp_path: Path) -> None:
    """A path outside the run dir, or one climbing out with '..', is refused."""
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "elsewhere.json", {}, root=run)
    with pytest.raises(ValueError):
        ensure_dir(run, run / ".." / "escape")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "elsewhere.json").exists()


def test_open_append_refuses_a_symlink_and_a_fifo(tmp_path: Path) -> None:
    """Appending to a log never writes through a symlink and never blocks on a FIFO."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "log").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Refused):
        open_append(tmp_path / "log", root=tmp_path)
    with pytest.raises(Refused):
        open_append(tmp_path / "fifo", root=tmp_path)
    assert victim.read_text() == "precious"


def test_open_append_creates_an_owner_only_file(tmp_path: Path) -> None:
    """A new log file is created 0600 and appended to."""
    fd = open_append(tmp_path / "d" / "events.jsonl", root=tmp_path)
    os.write(fd, b"one\n")
    os.close(fd)
    path = tmp_path / "d" / "events.jsonl"
    assert path.read_bytes() == b"one\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("kind", KINDS)
def test_read_bytes_refuses_what_is_not_a_regular_file_within_its_cap(tmp_path: Path, kind: str) -> None:
    """A FIFO, a directory, a device, any symlink and a file over the cap are refused at once, without blocking."""
    (tmp_path / "outside").mkdir()
    plant(tmp_path / "heartbeat.json", kind, tmp_path / "outside")
    how, what = bounded(lambda: read_bytes(tmp_path / "heartbeat.json", 4096))
    assert how == "raised" and isinstance(what, Refused), what


def test_read_bytes_follows_symlinks_only_when_asked(tmp_path: Path) -> None:
    """A user's config may be a symlink: read_bytes follows it when told to."""
    (tmp_path / "real.yaml").write_text("a: 1")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    assert read_bytes(tmp_path / "link.yaml", 100, follow_symlinks=True) == b"a: 1"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"step": ', "Expecting value"),
        ('{"step": NaN}', "NaN is not a number"),
        ('{"step": Infinity}', "Infinity is not a number"),
        ('{"step": -Infinity}', "-Infinity is not a number"),
        ('{"step": 1e999}', "1e999 is out of range"),
        ('{"step": ' + "1" * 400 + "}", "integer of 400 digits is out of range"),
        ('{"step": 9223372036854775808}', "is out of range"),
        ('{"step": 1, "step": 2}', "duplicate key 'step'"),
        ("[" * 100000, "nested too deeply"),
        (b"\xff\xfe{}", "can't decode"),
    ],
)
def test_parse_json_refuses_what_is_not_strict_json(text: str | bytes, why: str) -> None:
    """Each kind of odd JSON gives a ValueError saying what is wrong."""
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        parse_json(text.encode() if isinstance(text, str) else text)


def test_parse_json_accepts_what_we_write() -> None:
    """Ordinary records, the largest 64-bit integer and floats in range parse as json would."""
    record = {"seq": MAX_INT, "step_time_s": 0.0123, "phase": "train", "ranks": [0, 1], "x": None, "b": True}
    assert parse_json(json.dumps(record).encode()) == record


def test_unlink_quietly_leaves_a_directory_alone(tmp_path: Path) -> None:
    """Removing 'a file' that turns out to be a directory neither raises nor removes it."""
    (tmp_path / "d").mkdir()
    unlink_quietly(tmp_path / "d")
    unlink_quietly(tmp_path / "missing")
    assert (tmp_path / "d").is_dir()
