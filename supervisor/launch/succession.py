"""A multi-node run outlives its supervisor's node: the lease's life cycle around the supervisor.

The supervisor of a Slurm run normally lives in the job's batch script, on the batch host. If that host dies or is
cut off, the agents on the other nodes stop hearing it: each fences its ranks, and the first of them in the order
the supervisor handed out (`Succession.order`, group-rank order without the supervisor's own host) that can reach
the Slurm controller claims the next generation of the lease once the old one expired or was abdicated, and turns
itself into a new supervisor inside the same allocation (`exec`, with the command line, working directory and
environment the old supervisor gave it: nothing read from the run dir is ever run). The new supervisor resumes
the run from the newest complete checkpoint on the nodes left.

The batch script's own supervisor, if it lives on (a partition, not a crash), hands over: it fenced its node's
ranks and abdicated when it found itself cut off; once its link is back it waits as the job's keeper while the
successor supervises, and exits with the successor's exit code, so that the job ends as the batch script says
(its resubmission logic included). With no keeper (the batch host died), the successor ends the job itself:
`scancel`, for "requeue me" (75) after submitting the next job for a node range away from the excluded nodes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from supervisor.launch import slurmctl
from supervisor.rundir.lease import (
    ABDICATED,
    HELD,
    RELAYED_SIGNALS,
    RELEASED,
    Lease,
    claim,
    claimable,
    newest,
    pid_alive,
    read_keeper,
    relay_signal,
    write_keeper,
)
from worker.contract import EXIT_REQUEUE, RunLayout
from worker.files import open_append

__all__ = ["Succession", "end_job", "stand_for_successor", "take_lease", "take_over", "wait_after_handover"]

STAGGER_S = 1.0  # the n-th candidate in the order waits n times this long: the first one normally wins
POLL_S = 0.25
KEEPER_GRACE_S = 10.0  # how long a successor leaves the end of the job to a live keeper (it polls every second)


@dataclass(frozen=True)
class Succession:
    """What a supervisor tells its agents, so that one of them can take its place."""

    generation: int  # the lease generation the agents serve
    ttl_s: float
    order: tuple[str, ...]  # the candidates, in the order they may claim
    args: tuple[str, ...]  # `trainwarden` arguments (run CONFIG ...)
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    controller_wait_s: float = 0.0  # slurm.controller_wait_s: how long a candidate waits for the controller

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "ttl_s": self.ttl_s,
            "order": list(self.order),
            "args": list(self.args),
            "cwd": self.cwd,
            "env": self.env,
            "controller_wait_s": self.controller_wait_s,
        }

    @classmethod
    def from_json(cls, raw: Any) -> Succession:
        """KeyError, TypeError or ValueError for anything but a whole succession message."""
        env = {str(k): str(v) for k, v in dict(raw["env"]).items()}
        return cls(
            int(raw["generation"]),
            float(raw["ttl_s"]),
            tuple(map(str, raw["order"])),
            tuple(map(str, raw["args"])),
            str(raw["cwd"]),
            env,
            float(raw.get("controller_wait_s", 0.0)),
        )

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "supervisor", *self.args, "--successor"]

    def wait_s(self) -> float:
        """How long a candidate that fenced waits for the lease to come free: a dead supervisor's lapses within two
        ttls; a live one cut off from us abdicates after its node timeout (the ttl) and a link check, which may take
        the ping's timeout twice on a loaded host; then every candidate's turn."""
        return 2 * self.ttl_s + 2 * slurmctl.PING_TIMEOUT_S + STAGGER_S * len(self.order)


# ---- a supervisor taking the lease ----


def take_lease(layout: RunLayout, *, ttl_s: float, batch: bool, locked_here: bool = False) -> Lease | str:
    """Claim the next generation, or say why not (another supervisor of the run is alive). A successor finds the
    generation its agent claimed for it (same host, same pid: the agent became it). `locked_here`: we hold the run
    dir's lock on this host, so no other holder here is alive, whatever its pid now belongs to."""
    here, job = socket.gethostname(), slurmctl.job_id()
    top = newest(layout)
    if top is not None and top.state == HELD and top.host == here and top.pid == os.getpid():
        return top
    alive = (lambda _pid: False) if locked_here else pid_alive
    why = claimable(top, time.time(), here=here, pid_alive=alive, job_running=slurmctl.job_running, job=job)
    if why is None:
        assert top is not None
        return (
            f"{layout.root} is already supervised by pid {top.pid} on {top.host} (lease generation "
            f"{top.generation}, renewed {top.age(time.time()):.1f} s ago)"
        )
    lease = Lease((top.generation if top else 0) + 1, here, os.getpid(), time.time(), ttl_s, HELD, job, batch)
    taken = claim(layout, lease)
    return taken if taken is not None else f"{layout.root}: another supervisor claimed it at the same moment"


def take_over(
    layout: RunLayout, *, ttl_s: float, say: Callable[[str], None], locked_here: bool = False
) -> Lease | int | str:
    """`trainwarden run --take-over`: a fresh supervisor started by the batch script after its own supervisor
    died on this live host without ending the run (SIGKILL, the OOM killer, a Python error). The predecessor is
    surely gone (the script waited for it: its pid is dead here), and its agents fenced their ranks when its streams
    ended, so the run is ours at once: a new lease. If a successor on another node of this job claimed the run
    first, the run's exit code once that successor ended it (we wait as the job's keeper meanwhile, passing Slurm's
    signals on), or a lease if it is ours again. The run's exit code at once if this job's run already ended (its
    lease released with one); why not (one line) if another job's supervisor holds the run."""
    job = slurmctl.job_id()
    top = newest(layout)
    if top is not None and top.state == RELEASED and top.exit_code is not None and top.job == job:
        say(f"the run already ended with exit {top.exit_code}: nothing to take over")
        return top.exit_code
    taken = take_lease(layout, ttl_s=ttl_s, batch=True, locked_here=locked_here)
    if isinstance(taken, Lease):
        return taken
    holder = newest(layout)
    if holder is None or job is None or holder.job != job or holder.batch or holder.state == ABDICATED:
        return taken  # another job's supervisor (or another batch process of ours) holds the run: not ours to keep
    if holder.state == RELEASED:
        return holder.exit_code if holder.exit_code is not None else taken
    # A successor on another node of this job claimed the run first (the lease lapsed before we started).
    watching = Lease(holder.generation - 1, socket.gethostname(), os.getpid(), time.time(), ttl_s, ABDICATED, job, True)
    return wait_after_handover(layout, watching, say=say)


def wait_after_handover(
    layout: RunLayout,
    lease: Lease,
    *,
    say: Callable[[str], None],
    reachable: Callable[[], bool] = slurmctl.controller_reachable,
) -> Lease | int:
    """After this supervisor handed over: a new lease when the run is ours again (nobody took over and our link is
    back), or the exit code to end with: the successor's, once it released the lease (the batch process, which
    waits as the job's keeper meanwhile and passes Slurm's signals on to the successor), or 0 at once for a
    successor (another one carries on)."""
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: caught.append(s)) for sig in RELAYED_SIGNALS}
    try:
        return _wait(layout, lease, say, reachable, caught)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(
    layout: RunLayout, lease: Lease, say: Callable[[str], None], reachable: Callable[[], bool], caught: list[int]
) -> Lease | int:
    announced = False
    while True:
        top = newest(layout)
        if top is not None and top.generation > lease.generation and top.state == RELEASED:
            code = top.exit_code if lease.batch and top.exit_code is not None else 0
            if lease.batch:  # the job's keeper: its exit code ends the job, as the batch script says
                said = "no exit code" if top.exit_code is None else f"exit code {top.exit_code}"
                say(
                    f"the supervisor on {top.host} (lease generation {top.generation}) ended the run with {said}; "
                    f"the job's keeper exits with {code}"
                )
            return code
        now = time.time()
        free = (
            top is None
            or top.generation == lease.generation
            or claimable(
                top, now, here=lease.host, pid_alive=pid_alive, job_running=slurmctl.job_running, job=lease.job
            )
        )
        if free and caught:  # asked to stop while nobody supervises the run: nothing to save, stop now
            code = EXIT_REQUEUE if caught[0] == signal.SIGUSR1 else 0
            say(f"{signal.Signals(caught[0]).name} while no supervisor holds the run: stopping with exit code {code}")
            return code
        if free and reachable():
            taken = take_lease(layout, ttl_s=lease.ttl_s, batch=lease.batch)
            if isinstance(taken, Lease):
                return taken
        elif not free and top is not None:
            if not lease.batch:
                return 0
            if not announced:
                say(
                    f"supervision handed over to {top.host} (lease generation {top.generation}); "
                    "waiting for it to end the run"
                )
                announced = True
            with contextlib.suppress(OSError, ValueError):
                write_keeper(layout, top.generation, now)
                while caught:
                    signum = caught.pop(0)
                    relay_signal(layout, top.generation, signum)
                    say(f"passed {signal.Signals(signum).name} on to the supervisor on {top.host}")
        time.sleep(1.0)


def end_job(
    layout: RunLayout,
    code: int,
    *,
    exclude: Iterable[str],
    nodes: tuple[int, int],
    say: Callable[[str], None],
    controller_wait_s: float = 0.0,
    reachable: Callable[[], bool] = slurmctl.controller_reachable,
) -> None:
    """A successor's last act, where no batch script is left to end the job: `scancel` it; for 75, first submit the
    job's batch script again, for `nodes` (min, max) away from `exclude`, to start once this job ended (a requeue
    could not change its node count), unless the partition could never hold that (`sinfo`): then one line says what
    is missing. A live keeper (the batch process) is given KEEPER_GRACE_S to end it as its script says; a controller
    out of reach (its outage may be why the run ended with 75) is waited for, up to `controller_wait_s`."""
    job = slurmctl.job_id()
    if job is None:
        return
    deadline = time.monotonic() + KEEPER_GRACE_S
    while (at := read_keeper(layout)) is not None and time.time() - at < KEEPER_GRACE_S / 2:
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)  # Slurm ends this process with the job when the batch script exits
    _await_controller(controller_wait_s, reachable, say)
    try:
        if code == EXIT_REQUEUE and (missing := _shortfall(exclude, nodes[0])):
            # Submitted, it would stay pending for ever ("Requested node configuration is not available").
            say(f"not resubmitting job {job}: {missing}; ending it (exit 75: resubmit when nodes are back)")
        elif code == EXIT_REQUEUE:
            new = slurmctl.resubmit_job(job, exclude=exclude, nodes=nodes)
            say(f"exit 75, requeue me: job {new} carries on once job {job} ended (the batch script is gone)")
        else:
            say(f"ending job {job} (the batch script is gone): the run ended with exit {code}")
        slurmctl.cancel_job(job)
    except slurmctl.SlurmError as exc:
        say(f"could not end job {job}: {exc}; end it with `scancel {job}`")


def _await_controller(wait_s: float, reachable: Callable[[], bool], say: Callable[[str], None]) -> None:
    """Return once the Slurm controller answers, or `wait_s` later (what follows then says it could not be asked)."""
    deadline = time.monotonic() + wait_s
    if wait_s <= 0 or reachable():
        return
    say(f"the Slurm controller does not answer: waiting up to {wait_s:.0f} s (slurm.controller_wait_s) to end the job")
    while time.monotonic() < deadline and not reachable():
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _shortfall(exclude: Iterable[str], minimum: int) -> str | None:
    """What the partition lacks for a job of `minimum` nodes away from `exclude`; None if it can hold one or Slurm
    cannot say (the job is submitted: Slurm's own verdict is the last word)."""
    try:
        return slurmctl.shortfall(exclude, minimum)
    except slurmctl.SlurmError:
        return None


# ---- an agent standing for successor ----


def stand_for_successor(
    layout: RunLayout,
    succession: Succession,
    *,
    here: str,
    deadline: float,
    reachable: Callable[[], bool] = slurmctl.controller_reachable,
    say: Callable[[str], None] = lambda _line: None,
) -> tuple[Lease | None, str]:
    """Wait (until `deadline`, monotonic) for the supervisor's lease to lapse, then claim the next generation if
    it is our turn and we can reach the controller: (the lease claimed, or None; why, in a few words). A successor
    needs the controller for its first step, so a candidate that cannot reach it waits for it (up to
    `controller_wait_s` past the lapse, said once): an outage of the controller is not a reason to leave the run
    without a supervisor, and a candidate cut off itself loses the race to one that can reach it."""
    if here not in succession.order:
        return None, "not a candidate (the supervisor's own host, or not in the attempt)"
    turn = succession.order.index(here) * STAGGER_S
    unreachable = False
    while time.monotonic() < deadline:
        top = newest(layout)
        if top is None or top.generation != succession.generation or top.state == RELEASED:
            return None, "the run ended" if top is not None and top.state == RELEASED else "another took over"
        lapsed_at = _lapsed_at(top, time.time())
        if lapsed_at is not None and time.time() >= lapsed_at + turn:
            if reachable():
                lease = Lease(
                    top.generation + 1,
                    here,
                    os.getpid(),
                    time.time(),
                    succession.ttl_s,
                    HELD,
                    slurmctl.job_id(),
                    batch=False,
                )
                claimed = claim(layout, lease)
                return claimed, "claimed" if claimed else "another claimed it first"
            if not unreachable and succession.controller_wait_s > 0:
                deadline = max(deadline, time.monotonic() + succession.controller_wait_s)
                say(
                    f"the supervisor's lease lapsed and the Slurm controller does not answer: waiting up to "
                    f"{succession.controller_wait_s:.0f} s (slurm.controller_wait_s) for it before taking over"
                )
            unreachable = True  # cut off ourselves, maybe: ask again while there is time, others may win
        time.sleep(POLL_S)
    return None, "the Slurm controller did not answer" if unreachable else "the supervisor's lease did not lapse"


def _lapsed_at(lease: Lease, now: float) -> float | None:
    """When the lease became claimable (wall clock), or None while its holder may still act."""
    if lease.state != HELD:
        return lease.renewed_at
    expiry = lease.renewed_at + lease.ttl_s
    return expiry if now > expiry else None


def become_successor(layout: RunLayout, succession: Succession, lease: Lease) -> None:
    """Replace this process by the new supervisor (never returns): the old one's command line, directory and
    environment; stdout and stderr to a log in the run dir (the srun that carried ours may be gone with its host)."""
    log = open_append(layout.root / "supervisor" / f"successor_{lease.generation}.log", root=layout.root)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(succession.cwd)
    argv = succession.argv()
    os.execve(argv[0], argv, succession.env)
