"""The straggler observer: a rank is flagged only when it is slower than its peers for sustain_s, and cleared alike."""

from __future__ import annotations

import dataclasses
from typing import Any

from supervisor.config import StragglersConfig
from supervisor.core import HeartbeatSeen, Policy, State, Tick, initial_state
from supervisor.observe.progress import JournalRecord
from supervisor.observe.stragglers import Stragglers

NOW = 1000.0
SUSTAIN_S = 30.0
FAST, SLOW = 0.030, 0.045  # SLOW is 50 % slower: past the default 20 % margin
STATE = initial_state(
    Policy(nproc=3, max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=60.0, kill_grace_s=10.0)
)


def beat(rank: int, compute_s: float | None, *, attempt: int = 0, seq: int = 1) -> HeartbeatSeen:
    return HeartbeatSeen(attempt=attempt, rank=rank, seq=seq, step=10, phase="train", compute_s=compute_s)


def feed(
    observer: Stragglers, at: float, figures: dict[int, float | None], state: State = STATE, attempt: int = 0
) -> list[JournalRecord]:
    """One beat from each rank at time `at`, with its compute_s; the journal records they produced."""
    records = []
    for rank, compute_s in figures.items():
        records += observer.observe(beat(rank, compute_s, attempt=attempt), state, at)
    return records


def named(records: list[JournalRecord], name: str) -> list[dict[str, Any]]:
    return [fields for _, event, fields in records if event == name]


def run(
    observer: Stragglers, start: float, end: float, figures: dict[int, float | None], every: float = 0.5, **options: Any
) -> list[JournalRecord]:
    """Beats from every rank each `every` seconds in [start, end]."""
    records, at = [], start
    while at <= end + 1e-9:
        records += feed(observer, at, figures, **options)
        at += every
    return records


def test_a_rank_slower_than_its_peers_is_flagged_only_after_sustain_s():
    """Rank 1 50 % slower from NOW: nothing at NOW + 29.5 s, `straggler_flagged` (a warning) at NOW + 30 s."""
    observer = Stragglers(StragglersConfig())
    assert run(observer, NOW, NOW + SUSTAIN_S - 0.5, {0: FAST, 1: SLOW, 2: FAST}) == []
    assert observer.status()["stragglers"] == []
    records = feed(observer, NOW + SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST})
    assert [(level, event) for level, event, _ in records] == [("warning", "straggler_flagged")]
    assert records[0][2] == {"rank": 1, "compute_s": SLOW, "median_s": FAST, "slower_by": 0.5, "sustained_s": SUSTAIN_S}


def test_only_the_slow_rank_is_flagged():
    """Its peers, faster than the median of the others, are never flagged; status lists rank 1 alone."""
    observer = Stragglers(StragglersConfig())
    records = run(observer, NOW, NOW + 3 * SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST})
    assert [fields["rank"] for fields in named(records, "straggler_flagged")] == [1]
    assert observer.status() == {
        "stragglers": [{"rank": 1, "compute_s": SLOW, "median_s": FAST, "slower_by": 0.5}],
        "rank_compute_s": {"0": FAST, "1": SLOW, "2": FAST},
    }


def test_with_two_ranks_the_slow_one_is_compared_with_the_other():
    """Two ranks: the median of rank 1's peers is rank 0's figure, so only rank 1 is flagged."""
    observer = Stragglers(StragglersConfig())
    records = run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW})
    assert [(fields["rank"], fields["median_s"]) for fields in named(records, "straggler_flagged")] == [(1, FAST)]


def test_a_flagged_rank_is_cleared_after_sustain_s_back_in_line():
    """Back within the margin: still flagged at +29.5 s, `straggler_cleared` (info) at +30 s, status empty."""
    observer = Stragglers(StragglersConfig())
    run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST})
    back = NOW + SUSTAIN_S + 10
    assert run(observer, back, back + SUSTAIN_S - 0.5, {0: FAST, 1: FAST * 1.1, 2: FAST}) == []
    assert [s["rank"] for s in observer.status()["stragglers"]] == [1]
    records = feed(observer, back + SUSTAIN_S, {0: FAST, 1: FAST * 1.1, 2: FAST})
    assert [(level, event) for level, event, _ in records] == [("info", "straggler_cleared")]
    assert records[0][2]["rank"] == 1 and records[0][2]["flagged_s"] == 10 + SUSTAIN_S  # flagged at NOW + 30 s
    assert observer.status()["stragglers"] == []


def test_one_slow_step_does_not_flag():
    """Slow at one beat, in line at the next, slow again: each slow stretch starts the clock afresh."""
    observer = Stragglers(StragglersConfig())
    records = []
    for i in range(200):  # 100 s of beats, every other one slow
        records += feed(observer, NOW + i * 0.5, {0: FAST, 1: SLOW if i % 2 else FAST, 2: FAST})
    assert records == []


def test_slower_within_the_margin_is_not_flagged():
    """10 % slower than its peers, under the 20 % margin: never flagged."""
    observer = Stragglers(StragglersConfig())
    assert run(observer, NOW, NOW + 3 * SUSTAIN_S, {0: FAST, 1: FAST * 1.1, 2: FAST}) == []


def test_a_single_rank_never_flags():
    """Alone there is no peer to be slower than: nothing however slow its figure."""
    observer = Stragglers(StragglersConfig(sustain_s=0))
    assert run(observer, NOW, NOW + 3 * SUSTAIN_S, {0: SLOW}) == []
    assert observer.status() == {"stragglers": [], "rank_compute_s": {"0": SLOW}}


def test_ranks_without_compute_s_are_not_counted():
    """A rank not using guard_step reports no compute_s: the other rank has no peer and is not flagged."""
    observer = Stragglers(StragglersConfig(sustain_s=0))
    assert run(observer, NOW, NOW + 3 * SUSTAIN_S, {0: None, 1: SLOW}) == []


def test_ranks_of_an_old_attempt_are_ignored():
    """Beats of attempt 0 arriving once attempt 1 runs neither count as peers nor get flagged."""
    observer = Stragglers(StragglersConfig(sustain_s=0))
    relaunched = dataclasses.replace(STATE, attempt=1)
    records = run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST}, state=relaunched, attempt=0)
    records += run(observer, NOW, NOW + SUSTAIN_S, {0: FAST}, state=relaunched, attempt=1)
    assert records == []
    assert observer.status()["rank_compute_s"] == {"0": FAST}


def test_a_relaunch_clears_the_flags_of_the_old_attempt():
    """The first event of attempt 1 clears rank 1's flag (`reason: relaunched`) and forgets every figure."""
    observer = Stragglers(StragglersConfig())
    run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST})
    records = observer.observe(Tick(), dataclasses.replace(STATE, attempt=1), NOW + 40)
    assert records == [("info", "straggler_cleared", {"rank": 1, "attempt": 0, "reason": "relaunched"})]
    assert observer.status() == {"stragglers": [], "rank_compute_s": {}}


def test_a_flagged_ranks_figures_follow_its_beats():
    """While flagged, status shows the rank's newest figures, not those it was flagged with."""
    observer = Stragglers(StragglersConfig())
    run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW, 2: FAST})
    feed(observer, NOW + SUSTAIN_S + 1, {1: 2 * FAST})
    assert observer.status()["stragglers"] == [{"rank": 1, "compute_s": 2 * FAST, "median_s": FAST, "slower_by": 1.0}]


def test_the_margin_is_configurable():
    """margin 1.0: 50 % slower is not flagged, three times slower is."""
    observer = Stragglers(StragglersConfig(margin=1.0, sustain_s=0))
    assert run(observer, NOW, NOW + 1, {0: FAST, 1: SLOW, 2: FAST}) == []
    flagged = named(run(observer, NOW + 2, NOW + 3, {0: FAST, 1: 3 * FAST, 2: FAST}), "straggler_flagged")
    assert [fields["rank"] for fields in flagged] == [1]


def test_disabled_flags_nothing_but_still_reports_figures():
    """enabled: false: no journal records and no flags, yet each rank's compute_s is in status."""
    observer = Stragglers(StragglersConfig(enabled=False, sustain_s=0))
    assert run(observer, NOW, NOW + SUSTAIN_S, {0: FAST, 1: SLOW}) == []
    assert observer.status() == {"stragglers": [], "rank_compute_s": {"0": FAST, "1": SLOW}}


def test_a_tiny_peer_figure_keeps_slower_by_finite():
    """A crafted heartbeat's 5e-324 s: the ratio is capped, so the state file stays valid JSON."""
    observer = Stragglers(StragglersConfig(sustain_s=0))
    records = run(observer, NOW, NOW, {0: 5e-324, 1: 1e9})
    (flagged,) = named(records, "straggler_flagged")
    assert flagged["rank"] == 1 and flagged["slower_by"] == 2.0**53


def test_the_peers_median_leaves_out_the_ranks_own_figure():
    """Figures 1, 2, 3 and 10: the median of 3's peers is 2 (of 1, 2, 10), of 1's is 3, of 10's is 2."""
    observer = Stragglers(StragglersConfig(enabled=False))
    feed(observer, NOW, {0: 1.0, 1: 2.0, 2: 10.0, 3: 3.0})
    assert [observer._peers_median(own) for own in (3.0, 1.0, 10.0)] == [2.0, 3.0, 2.0]
