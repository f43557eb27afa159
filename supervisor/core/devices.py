"""Bad devices: what re-running a suspect step found about a rank's GPU (worker.rerun, `sdc_verdict`), in words.

A persistent verdict (the fault came back on the suspect and not on a partner) ends the attempt at once: its ranks
leave with EXIT_BAD_DEVICE and the run goes on without that node (Slurm) or, on one machine, ends with EXIT_REQUEUE
naming the GPU, to be resubmitted on other hardware. A transient one (gone on a re-run) is a strike: the node ledger
excludes a node after `slurm.max_sdc_strikes` of them within `slurm.sdc_strike_window_s` (faults that came and went
come back: AEGIS), and the attempt then ends as for a persistent one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PERSISTENT", "TRANSIENT", "VERDICTS", "DeviceVerdict"]

TRANSIENT, PERSISTENT = "transient", "persistent"  # worker.sdc's words; a "data" verdict charges no device
VERDICTS = (TRANSIENT, PERSISTENT)


@dataclass(frozen=True)
class DeviceVerdict:
    """A re-run's verdict on rank `rank`'s device in `attempt`, at `step` (batch `batch`: the samples it trained)."""

    attempt: int
    rank: int
    verdict: str  # transient or persistent
    step: int
    batch: int
    evidence: str
    node: str | None = None  # the host the rank ran on, as the rank said
    gpu: int | None = None  # its GPU's index (None: it ran on a CPU)

    @property
    def device(self) -> str:
        """'GPU 1 of node7', or 'node7' for a rank on a CPU."""
        host = self.node or "its host"
        return host if self.gpu is None else f"GPU {self.gpu} of {host}"

    @property
    def text(self) -> str:
        """The verdict in one short line, as the failure and the ledger's reason say it (the journal's
        `sdc_verdict` has the evidence)."""
        return f"{self.verdict} silent data corruption on rank {self.rank} ({self.device}) at step {self.step}"
