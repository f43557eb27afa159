"""Planning a rollback past bad data after an anomaly abort: distances, regions, widening and giving up."""

from __future__ import annotations

from supervisor.core.rollback import MAX_WINDOW_STEPS, AbortInfo, AnomalyPolicy, Rollback, plan_rollback

POLICY = AnomalyPolicy(rollback_steps=100, skip_after_steps=200, max_tries=3, widen_factor=2.0)
FIRST = AbortInfo(first_step=500, abort_step=509, first_batch=520, abort_batch=529)


def test_default_policy_values():
    """The `anomaly:` defaults roll back 100 steps, skip 200 batches, try 3 times and double each time."""
    assert AnomalyPolicy() == POLICY


def test_first_abort_rolls_back_and_skips_past_the_streak():
    """A first abort resumes at most `rollback_steps` before the streak and skips to `skip_after_steps` past it."""
    assert plan_rollback(POLICY, None, FIRST) == Rollback(
        abort=FIRST, tries=1, resume_at_most=400, skip_to_batch=529 + 1 + 200, skip_after=200
    )


def test_first_abort_near_the_start_clamps_resume_at_zero():
    """A streak starting fewer than `rollback_steps` into the run resumes at most from step 0."""
    abort = AbortInfo(first_step=30, abort_step=39, first_batch=30, abort_batch=39)
    assert plan_rollback(POLICY, None, abort) == Rollback(
        abort=abort, tries=1, resume_at_most=0, skip_to_batch=240, skip_after=200
    )


def test_first_abort_with_zero_distances():
    """With both distances 0 the run resumes at most at the streak's first step and skips just past the abort."""
    policy = AnomalyPolicy(rollback_steps=0, skip_after_steps=0)
    assert plan_rollback(policy, None, FIRST) == Rollback(
        abort=FIRST, tries=1, resume_at_most=500, skip_to_batch=530, skip_after=0
    )


def test_same_region_widens_distances_and_counts_second_try():
    """A streak starting before the previous skip target plus its skip window is the same region: try 2, doubled."""
    previous = plan_rollback(POLICY, None, FIRST)
    again = AbortInfo(first_step=450, abort_step=459, first_batch=780, abort_batch=789)
    assert plan_rollback(POLICY, previous, again) == Rollback(
        abort=again, tries=2, resume_at_most=450 - 200, skip_to_batch=789 + 1 + 400, skip_after=400
    )


def test_third_try_in_same_region_widens_again():
    """The third rollback of one region multiplies both distances by widen_factor squared."""
    first = plan_rollback(POLICY, None, FIRST)
    second = plan_rollback(POLICY, first, AbortInfo(450, 459, 780, 789))
    third_abort = AbortInfo(first_step=1000, abort_step=1004, first_batch=1500, abort_batch=1504)
    assert plan_rollback(POLICY, second, third_abort) == Rollback(
        abort=third_abort, tries=3, resume_at_most=600, skip_to_batch=1504 + 1 + 800, skip_after=800
    )


def test_region_boundary_is_skip_target_plus_skip_window():
    """A streak one batch inside the previous skip target + skip window is the same region; at it, a new one."""
    previous = plan_rollback(POLICY, None, FIRST)  # skip_to_batch 730, skip_after 200: the region ends at 930
    inside = plan_rollback(
        POLICY, previous, AbortInfo(first_step=600, abort_step=609, first_batch=929, abort_batch=938)
    )
    outside = plan_rollback(
        POLICY, previous, AbortInfo(first_step=600, abort_step=609, first_batch=930, abort_batch=939)
    )
    assert (inside.tries, inside.skip_after) == (2, 400)
    assert (outside.tries, outside.skip_after) == (1, 200)


def test_later_different_region_resets_tries():
    """A streak past the previous region is rolled back as a first try with the base distances."""
    previous = plan_rollback(POLICY, None, FIRST)
    second = plan_rollback(POLICY, previous, AbortInfo(450, 459, 780, 789))
    later = AbortInfo(first_step=3000, abort_step=3009, first_batch=5000, abort_batch=5009)
    assert plan_rollback(POLICY, second, later) == Rollback(
        abort=later, tries=1, resume_at_most=2900, skip_to_batch=5210, skip_after=200
    )


def test_beyond_max_tries_gives_up():
    """A fourth streak in a region already rolled back `max_tries` (3) times gets no rollback."""
    first = plan_rollback(POLICY, None, FIRST)
    second = plan_rollback(POLICY, first, AbortInfo(450, 459, 780, 789))
    third = plan_rollback(POLICY, second, AbortInfo(1000, 1004, 1500, 1504))
    assert third.tries == 3
    assert (
        plan_rollback(POLICY, third, AbortInfo(first_step=1500, abort_step=1509, first_batch=2400, abort_batch=2409))
        is None
    )


def test_max_tries_one_gives_up_on_the_second_streak_of_a_region():
    """With `max_tries` 1, a second streak in the same region gets no rollback."""
    policy = AnomalyPolicy(max_tries=1)
    previous = plan_rollback(policy, None, FIRST)
    assert previous.tries == 1
    assert plan_rollback(policy, previous, AbortInfo(450, 459, 780, 789)) is None


def test_fractional_widen_factor_rounds_distances():
    """Widened distances are rounded to whole steps and batches."""
    policy = AnomalyPolicy(rollback_steps=15, skip_after_steps=25, widen_factor=1.5)
    previous = plan_rollback(policy, None, FIRST)
    again = plan_rollback(policy, previous, AbortInfo(500, 502, 560, 562))
    assert (again.tries, again.resume_at_most, again.skip_after, again.skip_to_batch) == (2, 500 - 22, 38, 562 + 1 + 38)


def test_huge_widen_factor_caps_distances_instead_of_overflowing():
    """A widen_factor of 1e308 caps both widened distances at MAX_WINDOW_STEPS (2**53) rather than raising."""
    policy = AnomalyPolicy(rollback_steps=100, skip_after_steps=200, max_tries=2**53, widen_factor=1e308)
    second = plan_rollback(policy, plan_rollback(policy, None, FIRST), AbortInfo(450, 459, 780, 789))
    assert second == Rollback(
        abort=AbortInfo(450, 459, 780, 789),
        tries=2,
        resume_at_most=0,
        skip_to_batch=789 + 1 + MAX_WINDOW_STEPS,
        skip_after=MAX_WINDOW_STEPS,
    )


def test_tries_near_max_tries_plan_capped_then_give_up():
    """With max_tries 2**53, the last try is planned with capped distances and the one after gives up."""
    policy = AnomalyPolicy(rollback_steps=2**53, skip_after_steps=2**53, max_tries=2**53, widen_factor=2.0**53)
    previous = Rollback(abort=FIRST, tries=2**53 - 1, resume_at_most=0, skip_to_batch=530, skip_after=2**53)
    last = plan_rollback(policy, previous, FIRST)
    assert (last.tries, last.resume_at_most, last.skip_after) == (2**53, 0, MAX_WINDOW_STEPS)
    assert plan_rollback(policy, last, FIRST) is None


def test_zero_distances_stay_zero_under_a_huge_widen_factor():
    """Zero distances stay zero however far they are widened (0 * inf is never computed)."""
    policy = AnomalyPolicy(rollback_steps=0, skip_after_steps=0, max_tries=10**6, widen_factor=1e308)
    previous = Rollback(abort=FIRST, tries=10**5, resume_at_most=500, skip_to_batch=530, skip_after=0)
    again = AbortInfo(first_step=500, abort_step=509, first_batch=520, abort_batch=529)
    assert plan_rollback(policy, previous, again) == Rollback(
        abort=again, tries=10**5 + 1, resume_at_most=500, skip_to_batch=530, skip_after=0
    )
