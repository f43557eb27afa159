"""trainwarden's worker library: heartbeats, step events, atomic checkpoints and exact resume.

Import cost stays small: torch is imported only when a checkpoint is saved or loaded.
"""

from worker.contract import WorkerConfig
from worker.fingerprint import fingerprinted
from worker.recovery import run
from worker.warden import Warden

__all__ = ["Warden", "WorkerConfig", "fingerprinted", "run"]
