"""The supervisor's lease in the run dir: one claimant per generation, when a lease may be claimed, renewal and
deposition, and what the batch process passes on while it waits as the job's keeper."""

from __future__ import annotations

import json
import os
import signal

import pytest

from supervisor.rundir.lease import (
    ABDICATED,
    HELD,
    RELEASED,
    Lease,
    LeaseHolder,
    LeaseLost,
    claim,
    claimable,
    newest,
    read_keeper,
    read_relayed_signal,
    relay_signal,
    write_keeper,
)
from worker.contract import RunLayout

NOW = 1000.0


def lease(generation: int = 1, **changes: object) -> Lease:
    fields = {"host": "n1", "pid": 42, "renewed_at": NOW, "ttl_s": 10.0, "state": HELD, "job": "7"}
    return Lease(generation, **{**fields, **changes})


def may_claim(
    held: Lease | None,
    now: float = NOW + 1,
    *,
    here: str = "n2",
    alive: bool = True,
    running: bool = True,
    job: str | None = "7",
) -> str | None:
    return claimable(held, now, here=here, pid_alive=lambda _pid: alive, job_running=lambda _job: running, job=job)


def test_a_live_holder_keeps_its_lease():
    """Renewed within its ttl, by a live holder, in a running job: nobody may claim it."""
    assert may_claim(lease()) is None


@pytest.mark.parametrize(
    ("held", "kwargs", "why"),
    [
        (None, {}, "no lease yet"),
        (lease(state=RELEASED), {}, "released by n1"),
        (lease(state=ABDICATED), {}, "abdicated by n1"),
        (lease(), {"now": NOW + 10.5}, "expired 0.5 s ago"),
        (lease(), {"here": "n1", "alive": False}, "pid 42 on this host, is gone"),
        (lease(job="6"), {"running": False}, "job 6 has ended"),
    ],
)
def test_a_lease_may_be_claimed_once_its_holder_is_surely_gone(held, kwargs, why):
    """Released, abdicated, expired, a dead pid on this host, or the lease of a job that ended."""
    assert why in may_claim(held, **kwargs)


def test_a_holder_on_another_host_is_judged_by_age_not_by_a_pid():
    """A pid from another host means nothing here: a fresh lease of another host holds whatever the pid."""
    assert may_claim(lease(), here="n2", alive=False) is None


def test_exactly_one_claimant_wins_a_generation(tmp_path):
    """Two claims of the same generation: the first links its file into place, the second finds it there."""
    layout = RunLayout(tmp_path)
    assert claim(layout, lease(1)) == lease(1)
    assert claim(layout, lease(1, host="n2")) is None
    assert newest(layout) == lease(1)
    assert sorted(os.listdir(tmp_path / "supervisor" / "lease")) == ["1.json"]  # no temporary left


def test_the_newest_generation_is_the_lease_and_old_ones_are_pruned(tmp_path):
    """The highest generation counts; a new holder removes generations long past."""
    layout = RunLayout(tmp_path)
    for generation in range(1, 12):
        claim(layout, lease(generation))
    assert newest(layout).generation == 11
    assert sorted(int(name.split(".")[0]) for name in os.listdir(tmp_path / "supervisor" / "lease")) == list(
        range(4, 12)
    )


@pytest.mark.parametrize(
    "content", [b"{", b"[]", b'{"generation": 3}', b'{"generation": 2, "host": "n1"}', b"\xff" * 10]
)
def test_an_unreadable_newest_lease_counts_as_abdicated(tmp_path, content):
    """A torn or forged newest file is never trusted: it is an abdicated lease of its generation, claimable."""
    layout = RunLayout(tmp_path)
    claim(layout, lease(1))
    (tmp_path / "supervisor" / "lease" / "2.json").write_bytes(content)
    top = newest(layout)
    assert (top.generation, top.state) == (2, ABDICATED)
    assert "abdicated" in may_claim(top)


def test_a_symlink_in_place_of_the_lease_dir_is_refused(tmp_path):
    """Claiming never writes through a symlink out of the run dir."""
    (tmp_path / "supervisor").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "supervisor" / "lease").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        claim(RunLayout(tmp_path), lease(1))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_holder_renews_its_lease_and_releases_it_with_the_exit_code(tmp_path):
    """A renewal advances renewed_at by the holder's monotonic clock; the end writes released with the exit code."""
    layout = RunLayout(tmp_path)
    taken = claim(layout, lease(1))
    holder = LeaseHolder(layout, taken)
    holder.renew()
    assert newest(layout).renewed_at > taken.renewed_at and holder.valid()
    holder.end(RELEASED, 75)
    assert (newest(layout).state, newest(layout).exit_code) == (RELEASED, 75)


def test_a_newer_generation_deposes_the_holder(tmp_path):
    """A successor's generation appears: the holder posts LeaseLost once, stops acting, and leaves it alone."""
    layout = RunLayout(tmp_path)
    lost: list[object] = []
    holder = LeaseHolder(layout, claim(layout, lease(1)), lost.append)
    claim(layout, lease(2, host="n2"))
    holder.renew()
    holder.renew()
    assert lost == [LeaseLost("generation 2 took over", lease(2, host="n2"))] and not holder.valid()
    holder.end(ABDICATED)
    assert newest(layout) == lease(2, host="n2")
    assert json.loads((tmp_path / "supervisor" / "lease" / "1.json").read_text())["state"] == HELD


def test_the_keeper_says_it_waits_and_relays_signals_to_the_holder_of_one_generation(tmp_path):
    """The batch process's keeper stamp reads back; a relayed signal reaches only the generation it was meant for."""
    layout = RunLayout(tmp_path)
    write_keeper(layout, 2, NOW)
    assert read_keeper(layout) == NOW
    relay_signal(layout, 2, signal.SIGUSR1)
    relayed = read_relayed_signal(layout, 2)
    assert relayed is not None and relayed[1] == signal.SIGUSR1
    assert read_relayed_signal(layout, 3) is None
    relay_signal(layout, 2, signal.SIGKILL)  # not a signal a supervisor is asked to act on
    assert read_relayed_signal(layout, 2) is None
