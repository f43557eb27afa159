"""The supervisor's view of its process tree: every descendant, adopted orphans included, from the kernel's lists."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run in its own process: it makes itself a subreaper, which must not outlast the test.
TREE = textwrap.dedent(
    """
    import json, os, subprocess, time
    import psutil
    from supervisor.launch import trees

    assert trees.become_subreaper()
    # a child with a grandchild, and an orphan: its parent exits, so it is re-parented to this process
    keeper = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    subprocess.run(["sh", "-c", "sleep 30 &"], check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(psutil.Process().children(recursive=True)) < 3:
        time.sleep(0.01)
    ours = sorted(p.pid for p in trees.descendants())
    psutil_view = sorted(p.pid for p in psutil.Process().children(recursive=True))
    orphans = sorted(p.pid for p in psutil.Process().children() if p.pid != keeper.pid)
    trees.sigkill(trees.descendants())
    print(json.dumps({"ours": ours, "psutil": psutil_view, "orphans": orphans}))
    """
)


def test_descendants_are_every_process_below_including_adopted_orphans():
    done = subprocess.run([sys.executable, "-c", TREE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert len(seen["ours"]) == 3 and len(seen["orphans"]) == 1  # sh, its sleep, and the adopted sleep
    assert seen["ours"] == seen["psutil"]
