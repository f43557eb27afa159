"""A supervisor that handed a multi-node run over (it found itself cut off) and takes it back, nobody having taken it
over once its link is back, says so in the journal: `supervisor_resumed`."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from types import SimpleNamespace
from typing import Any

from supervisor import cli
from supervisor.rundir.journal import open_journal
from supervisor.rundir.lease import ABDICATED, HELD, Lease
from worker.contract import RunLayout

CUT_OFF = "every other node fell silent, and the Slurm controller is out of reach from here"


class Handing:
    """Stands in for the Supervisor: the first one hands over (run() is None), the one after it ends the run."""

    made = 0

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        Handing.made += 1
        self.first = Handing.made == 1
        self.handed_over = CUT_OFF if self.first else None
        self.state = SimpleNamespace(attempt=3)
        self.status_listeners: list[Any] = []

    def run(self) -> int | None:
        return None if self.first else 0


def test_taking_back_a_run_it_handed_over_is_journaled_as_supervisor_resumed(tmp_path, monkeypatch):
    layout = RunLayout(tmp_path / "run")
    (layout.root / "supervisor").mkdir(parents=True)
    here = socket.gethostname()
    handed = Lease(1, here, os.getpid(), time.time(), 10.0, ABDICATED, "7", True)
    back = Lease(2, here, os.getpid(), time.time(), 10.0, HELD, "7", True)
    monkeypatch.setattr(cli, "Supervisor", Handing)
    monkeypatch.setattr(cli, "wait_after_handover", lambda *_a, **_k: back)
    config = SimpleNamespace(nodes=2, spare_nodes=0, multi_node=True)
    args = SimpleNamespace(argv=["run", "job.yaml"], config="job.yaml", ignore_stop_file=False)
    journal = open_journal(layout.journal, root=layout.root, echo=None)
    dispositions = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # _supervise ignores them
    try:
        last = cli._supervise(config, layout, journal, args, handed, None)  # type: ignore[arg-type]
    finally:
        journal.close()
        for sig, handler in dispositions.items():
            signal.signal(sig, handler)
    assert isinstance(last, Handing) and not last.first
    events = [json.loads(line) for line in layout.journal.read_text().splitlines()]
    (resumed,) = [e for e in events if e["event"] == "supervisor_resumed"]
    assert resumed["level"] == "warning"
    assert {k: resumed[k] for k in ("generation", "previous_generation", "host", "handed_over", "attempt")} == {
        "generation": 2,
        "previous_generation": 1,
        "host": here,
        "handed_over": CUT_OFF,
        "attempt": 3,
    }
