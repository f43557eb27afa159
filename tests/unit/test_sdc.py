"""Naming the ranks whose own values stand out (worker.sdc), with plain values."""

from __future__ import annotations

import math

from worker.sdc import (
    Fingerprint,
    fingerprint_rows,
    fingerprint_values,
    from_rows,
    judge,
    outliers,
    partners,
    reproduced,
)


def prints(*values: tuple[float, float, int]) -> list[Fingerprint]:
    return [Fingerprint(*v) for v in values]


def test_ranks_that_differ_as_data_parallel_ranks_do_are_not_named() -> None:
    """Losses and norms within a factor of two of each other, as different samples give: nobody."""
    assert outliers(prints((1.1, 0.8, 0), (0.9, 1.3, 0), (1.4, 0.7, 0), (1.0, 1.0, 0))) == []
    assert outliers(prints((1.1, 0.8, 0), (0.7, 1.5, 0))) == []


def test_a_gradient_norm_far_above_the_others_names_its_rank_even_among_two() -> None:
    """Among four, the median and spread of the other three; among two, the other one alone: a ratio."""
    (four,) = outliers(prints((1.0, 0.9, 0), (1.1, 1.1, 0), (1.0, 3e35, 0), (0.9, 1.0, 0)))
    assert four.rank == 2 and four.score > 100 and "local gradient norm 3e+35" in four.why
    (two,) = outliers(prints((1.0, 0.9, 0), (1.0, 900.0, 0)))
    assert two.rank == 1 and two.score > 6


def test_only_values_that_stand_out_upwards_are_named() -> None:
    """A norm far below the other's would name the other among two ranks; a shrunk value is not named."""
    assert outliers(prints((1.0, 1e-9, 0), (1.0, 1.0, 0), (1.0, 1.2, 0))) == []
    assert [o.rank for o in outliers(prints((1.0, 1e-9, 0), (1.0, 1.0, 0)))] == [1]  # the limit of two ranks
    assert outliers(prints((1.0, 0.0, 0), (1.0, 0.0, 0), (1.0, 0.0, 0))) == []  # zero norms: finite scores


def test_a_loss_far_above_the_others_names_its_rank() -> None:
    (found,) = outliers(prints((2.0, 1.0, 0), (2.1, 1.0, 0), (1.9, 1.0, 0), (60.0, 1.0, 0)))
    assert found.rank == 3 and "local loss 60" in found.why


def test_non_finite_values_on_some_ranks_name_them_on_all_ranks_name_nobody() -> None:
    found = outliers(prints((1.0, 1.0, 0), (1.0, math.inf, 3), (math.inf, 1.0, 1), (1.0, 1.0, 0)))
    assert [(o.rank, o.score) for o in found] == [(1, math.inf), (2, math.inf)]
    assert "3 non-finite" in found[0].why
    assert outliers(prints((math.inf, math.inf, 2), (1.0, math.inf, 1))) == []


def test_one_rank_has_nobody_to_stand_out_from() -> None:
    assert outliers(prints((1e9, 1e30, 0))) == []
    assert outliers([]) == []


def test_the_threshold_is_a_parameter() -> None:
    close = prints((1.0, 1.0, 0), (1.0, 1.1, 0), (1.0, 0.9, 0), (1.0, 20.0, 0))
    assert [o.rank for o in outliers(close)] == []  # log(20) / log(2) = 4.3 robust sigmas
    assert [o.rank for o in outliers(close, threshold=4.0)] == [3]


# ---- verdicts from re-runs ----------------------------------------------------------------------------------------

CLEAN, FLIPPED = Fingerprint(1.2, 1.5, 0), Fingerprint(1.2, 1.1e38, 0)


def test_not_reproduced_on_its_own_rank_is_transient() -> None:
    (v,) = judge([CLEAN, FLIPPED], [CLEAN, CLEAN], {1: CLEAN}, [1])
    assert (v.rank, v.verdict) == (1, "transient") and "not reproduced on the same rank" in v.evidence


def test_reproduced_on_its_rank_and_on_another_is_the_datas() -> None:
    spiked = Fingerprint(5e4, 4e5, 0)
    (v,) = judge([CLEAN, spiked], [CLEAN, spiked], {1: spiked}, [1])
    assert v.verdict == "data" and "reproduced on both" in v.evidence


def test_reproduced_only_on_its_own_rank_is_persistent() -> None:
    (v,) = judge([CLEAN, FLIPPED, CLEAN], [CLEAN, FLIPPED, CLEAN], {1: CLEAN}, [1])
    assert v.verdict == "persistent" and "reproduced only on rank 1" in v.evidence


def test_without_a_partner_a_reproduced_result_counts_as_the_datas_saying_so() -> None:
    (v,) = judge([CLEAN, FLIPPED], [CLEAN, FLIPPED], {}, [1])
    assert v.verdict == "data" and "no other rank" in v.evidence


def test_reproduced_means_within_the_tolerance_and_non_finite_in_both_or_neither() -> None:
    """Counts may differ: the hook counts buckets, a partner's run counts the whole gradient once."""
    assert reproduced(Fingerprint(1.0, 2.0, 0), Fingerprint(1.0 + 5e-4, 2.0 - 1e-3, 0))
    assert not reproduced(Fingerprint(1.0, 2.0, 0), Fingerprint(1.0, 2.01, 0))
    assert reproduced(Fingerprint(math.inf, math.inf, 4), Fingerprint(math.inf, math.inf, 4))
    assert reproduced(Fingerprint(1.0, math.inf, 2), Fingerprint(1.0, math.inf, 1))
    assert not reproduced(Fingerprint(1.0, math.inf, 1), Fingerprint(1.0, 2.0, 0))


def test_partners_are_other_ranks_no_suspects_first_and_none_runs_two_batches() -> None:
    assert partners([1], 3) == {1: 2}
    assert partners([2], 3) == {2: 0}
    assert partners([0, 1], 4) == {0: 2, 1: 3}  # rank 1, a suspect, does not check rank 0
    assert partners([0, 1, 2], 3) == {0: 1, 1: 2, 2: 0}  # every rank a suspect: each checks its successor
    assert partners([0], 1) == {}


def test_fingerprint_rows_reduced_by_max_give_every_ranks_fingerprint_and_none_for_a_missing_one() -> None:
    """Each rank fills its own row, -inf elsewhere: the element-wise MAX of all ranks' rows holds every one."""
    mine = {0: fingerprint_values(1.5, [4.0, 5.0]), 2: fingerprint_values(math.nan, [math.inf])}
    rows = [fingerprint_rows(3, {rank: values}) for rank, values in mine.items()]
    reduced = [max(column) for column in zip(*rows, strict=True)]
    assert from_rows(reduced) == [Fingerprint(1.5, 3.0, 0), None, Fingerprint(math.inf, math.inf, 2)]
