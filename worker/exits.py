"""Ending a rank from inside the training loop with an exit code the supervisor can trust."""

from __future__ import annotations

import contextlib
from typing import NoReturn

__all__ = ["leave"]


def leave(code: int) -> NoReturn:
    """Release the process group, then raise SystemExit(code).

    Exiting with a live gloo or NCCL group can abort the interpreter at shutdown ("terminate called
    without an active exception", SIGABRT), which would turn an anomaly abort or a requested stop into
    a crash. Destroying the group is local: it waits for no peer.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # the exit code matters more than a tidy teardown
            dist.destroy_process_group()
    raise SystemExit(code)
