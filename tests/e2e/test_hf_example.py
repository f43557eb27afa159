"""examples/hf_train.py under the real supervisor: the Hugging Face Trainer's own checkpoints, recorded and chosen by
trainwarden; a kill, a hang in a save, a stop and a damaged checkpoint (the tests: tests/e2e/frameworks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import run_supervisor
from tests.e2e.frameworks import (  # noqa: F401 - the shared tests and their fixtures, run for the Trainer
    HF,
    Framework,
    faulted,
    reference,
    test_a_damaged_checkpoint_is_passed_over_with_its_reason,
    test_a_kill_and_a_hang_in_a_save_resume_from_the_frameworks_checkpoints_and_end_bitwise,
    test_a_stop_ends_every_rank_at_one_step_with_a_checkpoint_and_a_rerun_resumes_there,
)

pytest.importorskip("transformers", reason="the [hf] extra")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def framework() -> Framework:
    return HF


def test_a_trainer_that_saves_where_the_supervisor_does_not_look_is_a_config_error(tmp_path: Path) -> None:
    """worker.prefix other than the Trainer's checkpoint name: every rank exits 78 at once, saying how to fix it;
    the supervisor does not retry (exit 78)."""
    done = run_supervisor(HF.job(tmp_path, prefix="ckpt"), tmp_path / "run", timeout=120)
    assert done.returncode == 78, done.stderr[-3000:]
    errors = (tmp_path / "run" / "logs" / "attempt_0" / "rank_0.err").read_text()
    assert "worker.prefix is 'ckpt': the Trainer names its checkpoints checkpoint-STEP" in errors
