"""The Slurm controller is not the network: the pure rules the Slurm launcher follows when `scontrol` or `srun`
cannot reach it (no process, no clock: `now` is an argument).

- Is this supervisor cut off? Judged by the peers: never while another node's agent is heard, never with no other
  node's agent to judge by; only when every other node fell silent does the controller's answer decide.
- While the controller is out of reach, what needs it (a new step) waits, bounded by `slurm.controller_wait_s`,
  journaled once as `controller_unreachable` and as `controller_back` when it answers again.
- A step Slurm cannot create yet (the last one not cleaned up, its nodes still busy) is tried again with backoff.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

__all__ = [
    "STEP_RETRIES",
    "ControllerWait",
    "cut_off",
    "retry_delay_s",
    "step_not_created_yet",
]

# What srun says when the step cannot be created now but may be soon: the previous step still holds the nodes'
# memory or CPUs, the controller is busy or was just out of reach.
_NOT_YET = (
    "memory required by task is not available",
    "requested nodes are busy",
    "job step creation temporarily disabled",
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted or received",
    "required node not available",  # a node went down since the plan: the next plan leaves it out
)
STEP_RETRIES = 5  # a step that cannot be created yet is tried this many times more within the attempt's launch
RETRY_BASE_S = 1.0
RETRY_MAX_S = 15.0


def step_not_created_yet(said: str) -> bool:
    """Whether srun's last words say the step could not be created *yet* (a retry may succeed); any other refusal
    (an invalid option, a resource the cluster has not) would be the same on every try."""
    lowered = said.lower()
    return any(sign in lowered for sign in _NOT_YET)


def retry_delay_s(tries: int) -> float:
    """Backoff before the try after `tries` failed ones: 1, 2, 4, 8, then 15 s."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2.0 ** max(0, tries - 1))


def cut_off(
    remote: Collection[str], silent: Collection[str], heard_other: bool, controller_reachable: bool | None
) -> bool | None:
    """Is this supervisor the one cut off from the run?

    `remote`: the other nodes' agents of the attempt still expected to speak; `silent`: those silent past the node
    timeout; `heard_other`: a node outside `silent` (one that finished included) was heard within it. Never while
    some other agent is heard, nor with no other agent to judge by: `scontrol` failing alone says only that the
    controller is out of reach. With every other agent silent, None until the controller has been asked, then
    cut off if it cannot be reached either."""
    if not remote or heard_other or not set(remote) <= set(silent):
        return False
    if controller_reachable is None:
        return None
    return not controller_reachable


@dataclass
class ControllerWait:
    """How long the controller has been out of reach; what needs it waits at most `wait_s`."""

    wait_s: float
    since: float | None = None
    tries: int = 0

    def out_of_reach(self, now: float, asked: float | None = None) -> tuple[bool, bool]:
        """The controller did not answer a question asked at `asked` (or `now`), which timed out at `now`: (first
        notice, waited past `wait_s`). The wait counts from the first question it did not answer."""
        first = self.since is None
        if self.since is None:
            self.since = now if asked is None else min(asked, now)
        self.tries += 1
        return first, now - self.since >= self.wait_s

    def next_try(self, now: float) -> float:
        """When to ask the controller again (never past the end of the wait, so that it is judged then)."""
        since = now if self.since is None else self.since
        return min(now + retry_delay_s(self.tries), since + self.wait_s)

    def back(self, now: float) -> float | None:
        """The controller answered: how long it was out of reach, or None if it never was."""
        if self.since is None:
            return None
        waited, self.since, self.tries = now - self.since, None, 0
        return waited
