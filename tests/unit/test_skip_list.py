"""The skip list (worker.skip_list): written atomically, read back; anything hostile in its place reads as empty."""

from __future__ import annotations

import json
import os
from pathlib import Path

from worker.skip_list import MAX_SKIP_LIST_BYTES, SkipList


def test_a_listed_batch_is_written_and_read_back_once(tmp_path: Path) -> None:
    path = tmp_path / "ranks" / "rank_0" / "skip_list.json"
    path.parent.mkdir(parents=True)
    listed = SkipList(path, root=tmp_path)
    assert 4 not in listed
    listed.add(4, step=5, ranks=[1])
    listed.add(4, step=5, ranks=[1])  # once
    listed.add(9, step=9, ranks=[None])
    assert json.loads(path.read_text()) == {
        "batches": [{"batch": 4, "step": 5, "ranks": [1]}, {"batch": 9, "step": 9, "ranks": [None]}]
    }
    again = SkipList(path, root=tmp_path)
    assert 4 in again and 9 in again and 5 not in again


def test_garbage_a_symlink_a_fifo_or_a_huge_file_reads_as_an_empty_list(tmp_path: Path) -> None:
    path = tmp_path / "skip_list.json"
    for content in (b"not json", b"[]", b'{"batches": 3}', b'{"batches": [{"batch": -1}, {"batch": "4"}, 7]}'):
        path.write_bytes(content)
        assert len(SkipList(path, root=tmp_path)) == 0
    path.write_bytes(b'{"batches": [' + b" " * MAX_SKIP_LIST_BYTES + b"]}")
    assert len(SkipList(path, root=tmp_path)) == 0
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text('{"batches": [{"batch": 4}]}')
    path.symlink_to(target)
    assert 4 not in SkipList(path, root=tmp_path)  # never followed
    path.unlink()
    os.mkfifo(path)
    assert len(SkipList(path, root=tmp_path)) == 0  # never blocks on it


def test_a_write_that_fails_is_said_not_raised(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gone" / "skip_list.json"  # its folder cannot be made: a file is in the way
    (tmp_path / "gone").write_text("")
    SkipList(path, root=tmp_path).add(4, step=5, ranks=[1])
    assert "skip_list.json not written" in capsys.readouterr().err
