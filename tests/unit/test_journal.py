"""The journal's rotation: bounded files, no event lost or torn while they are kept, agents' appends included."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.observe.plot import read_timeline
from supervisor.rundir.journal import JOURNALS_KEPT, append_event, journal_files, open_journal
from worker.contract import RunLayout


def _lines(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def test_a_full_journal_is_rotated_keeping_the_newest_files_whole_and_in_order(tmp_path: Path) -> None:
    """At 2 KiB a file, 400 events leave the current file and JOURNALS_KEPT rotated ones, each at most one event
    over the limit; read oldest first they are the newest events in the order written, every line whole."""
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    journal = open_journal(layout.journal, root=layout.root, echo=None, max_bytes=2048)
    for number in range(400):
        journal.log.info("ranks_launched" if number % 50 == 0 else "step_seen", number=number, pad="x" * 40)
        if number == 200:  # a node agent appends between the supervisor's writes
            append_event(layout.journal, root=layout.root, event="agent_fenced", why="test")
    journal.close()

    files = journal_files(layout.journal)
    assert [f.name for f in files] == [f"events.{n}.jsonl" for n in range(JOURNALS_KEPT, 0, -1)] + ["events.jsonl"]
    assert all(f.stat().st_size <= 2048 + 200 for f in files)
    numbers = [e["number"] for e in _lines(files) if "number" in e]
    assert numbers == list(range(numbers[0], 400)) and numbers[0] > 0  # the oldest went, nothing in between did


def test_plot_reads_every_kept_journal_file(tmp_path: Path) -> None:
    """The timeline counts crashes in rotated files too, not only in the current one."""
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    journal = open_journal(layout.journal, root=layout.root, echo=None, max_bytes=1024)
    for attempt in range(4):
        journal.log.info("ranks_launched", attempt=attempt, pids=[1], pad="y" * 300)
        journal.log.error("rank_crashed", attempt=attempt, rank=0, pad="z" * 300)
    journal.close()
    assert len(journal_files(layout.journal)) == 3  # 8 events of ~350 bytes, 3 a file
    assert read_timeline(layout).counts["crash"] == 4
