"""examples/slurm/demo.sbatch's own logic, without Slurm: the real script under bash, with stand-ins for
`trainwarden` and `sbatch` on PATH that say what they were asked and exit as each case needs. (On the simulated
cluster, tests/slurm/test_succession.py runs it for real.)"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO

SCRIPT = REPO / "examples" / "slurm" / "demo.sbatch"

# `trainwarden run ...`: the n-th call (1-based) does what $RUNS says in its n-th word: an exit code, or "kill"
# (SIGKILL itself, as the OOM killer would). `trainwarden nodes --sbatch-args`: $NODES_SAYS, or fails if empty.
STUB = """#!/bin/bash
echo "trainwarden $*" >>"$CALLS"
if [ "$1" = nodes ]; then
  [ -n "$NODES_SAYS" ] || { echo "trainwarden: no job to submit: the cluster can never hold the job" >&2; exit 1; }
  echo "$NODES_SAYS"; exit 0
fi
n=$(grep -c '^trainwarden run' "$CALLS")
what=$(echo $RUNS | cut -d' ' -f"$n")
[ "$what" = kill ] && kill -9 $$
exit "$what"
"""


def run_script(tmp_path: Path, runs: str, nodes_says: str = "") -> tuple[int, list[str], str]:
    """(the script's exit code, the commands it ran, its log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("trainwarden", STUB), ("sbatch", '#!/bin/bash\necho "sbatch $*" >>"$CALLS"\n')):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls"
    calls.touch()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "RUNS": runs,
        "NODES_SAYS": nodes_says,
        "SLURM_JOB_ID": "41",
    }
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, timeout=30, capture_output=True, text=True)
    log = (tmp_path / "runs" / "slurm-demo" / "logs" / "slurm_job_41.out").read_text()
    return done.returncode, calls.read_text().splitlines(), log


RUN = "trainwarden run examples/slurm/demo.yaml"


@pytest.mark.parametrize(
    ("runs", "code", "started"),
    [
        ("0", 0, [RUN]),  # finished: nothing more
        ("kill 0", 0, [RUN, f"{RUN} --take-over"]),  # the supervisor SIGKILLed: a fresh one finishes the run
        ("1 1", 1, [RUN, f"{RUN} --take-over"]),  # a failed run (or a Python error): asked once, the run's code
        ("kill kill kill kill", 137, [RUN, *[f"{RUN} --take-over"] * 3]),  # at most three takeovers
        ("78", 78, [RUN]),  # a config error is the run's own verdict
    ],
)
def test_a_supervisor_that_dies_is_replaced_on_the_same_host_and_the_job_ends_with_the_runs_code(
    tmp_path, runs, code, started
):
    got, calls, log = run_script(tmp_path, runs)
    assert (got, calls) == (code, started)
    assert log.endswith(f"trainwarden-demo: the run's exit code: {code}\n")
    if "kill" in runs:
        assert "the supervisor exited 137; if it died before the run ended, a fresh one takes over" in log


@pytest.mark.parametrize("nodes_says", ["--nodes=2-3 --exclude=twnode2", ""], ids=["resubmitted", "nothing fits"])
def test_exit_75_resubmits_with_the_node_range_or_submits_nothing_the_partition_cannot_hold(tmp_path, nodes_says):
    """`trainwarden nodes --sbatch-args` names the range and exclusions to chain the next job with; where the
    partition could never hold it, it fails with one line and no job is left pending for ever."""
    got, calls, log = run_script(tmp_path, "75", nodes_says=nodes_says)
    submitted = [c for c in calls if c.startswith("sbatch")]
    assert got == 75
    if nodes_says:
        assert submitted == [f"sbatch --dependency=afterany:41 {nodes_says} {SCRIPT}"]
    else:
        assert not submitted and "no job to submit: the cluster can never hold the job" in log
        assert "exit 75, no next job" in log
