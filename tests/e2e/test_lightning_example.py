"""examples/lightning_train.py under the real supervisor: Lightning's own checkpoints, recorded and chosen by
trainwarden; a kill, a hang in a save, a stop and a damaged checkpoint (the tests: tests/e2e/frameworks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.frameworks import (  # noqa: F401 - the shared tests and their fixtures, run for Lightning
    LIGHTNING,
    Framework,
    faulted,
    rank_events,
    reference,
    test_a_damaged_checkpoint_is_passed_over_with_its_reason,
    test_a_kill_and_a_hang_in_a_save_resume_from_the_frameworks_checkpoints_and_end_bitwise,
    test_a_stop_ends_every_rank_at_one_step_with_a_checkpoint_and_a_rerun_resumes_there,
)

pytest.importorskip("lightning", reason="the [lightning] extra")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def framework() -> Framework:
    return LIGHTNING


def test_under_the_supervisor_lightning_leaves_slurm_to_trainwarden(faulted: Path) -> None:  # noqa: F811
    """Its ranks in a Slurm allocation's environment, Lightning takes torchrun's variables (TORCHELASTIC_RUN_ID,
    which the supervisor sets as torchrun does), not SLURM_PROCID: its SLURM plugin, which would save its own
    checkpoint and `scontrol requeue` the job on SIGUSR1, is not in charge; trainwarden's stop order is."""
    for rank in (0, 1):
        started = rank_events(faulted, rank, "framework_started")
        assert {(e["cluster_environment"], e["auto_requeue"]) for e in started} == {("TorchElasticEnvironment", False)}
    assert not list(faulted.rglob("hpc_ckpt_*.ckpt"))
