"""Rotation (`keep_checkpoint_max`): oldest complete checkpoints go, the newest healthy one never does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from supervisor.rundir.checkpoints import rotation


def test_keeps_the_newest_keep_max():
    """With everything healthy, only the newest `keep_max` remain."""
    assert rotation([10, 20, 30, 40], {10, 20, 30, 40}, keep_max=2, protected=set()) == [10, 20]


def test_keeps_the_newest_healthy_even_when_older_than_keep_max():
    """If the newest checkpoints are unhealthy, the newest healthy one stays beyond `keep_max`."""
    assert rotation([10, 20, 30, 40], {20}, keep_max=2, protected=set()) == [10]


def test_keeps_the_checkpoint_being_resumed_from():
    """A protected (resumed-from) checkpoint is never deleted."""
    assert rotation([10, 20, 30, 40], {10, 20, 30, 40}, keep_max=1, protected={10}) == [20, 30]


def test_zero_keeps_everything():
    """`keep_checkpoint_max` 0 (the default) disables rotation."""
    assert rotation([10, 20, 30], set(), keep_max=0, protected=set()) == []


steps = st.lists(st.integers(min_value=1, max_value=10_000), unique=True, max_size=30)


@given(complete=steps, data=st.data(), keep_max=st.integers(min_value=1, max_value=8))
def test_rotation_never_deletes_what_must_stay(complete, data, keep_max):
    """For any history: the newest healthy, the protected and the newest keep_max survive; only complete ones go."""
    healthy = set(data.draw(st.lists(st.sampled_from(complete), unique=True) if complete else st.just([])))
    protected = set(
        data.draw(st.lists(st.sampled_from(complete), unique=True, max_size=2) if complete else st.just([]))
    )
    deleted = set(rotation(complete, healthy, keep_max=keep_max, protected=protected))
    assert deleted <= set(complete)
    assert not deleted & protected
    assert not deleted & set(sorted(complete)[-keep_max:])
    if healthy:
        assert max(healthy) not in deleted
    assert len(set(complete) - deleted) <= keep_max + len(protected) + 1
