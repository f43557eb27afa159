"""Recovery in place in the decision core: one test per edge of the UNWIND stage, with a fake clock."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core import (
    LOST_NODE_UNWIND_S,
    RECOVERING_GRACE_S,
    ChildExited,
    Heartbeats,
    HeartbeatSeen,
    KillLeftovers,
    LaunchFailed,
    LaunchRanks,
    Phase,
    PublishUnwind,
    RanksLaunched,
    SignalRanks,
    SignalReceived,
    StacksCollected,
    State,
    StopStage,
    Then,
    Tick,
    decide,
    recovering_deadline,
)
from supervisor.core.blame import Verdict
from supervisor.core.causes import Cause, CauseKind
from tests.unit.test_core import NOW, POLICY, record, running, shape
from worker.contract import RECOVERING_PHASE

IN_PLACE = replace(POLICY, nproc=3, in_place=True, in_place_timeout_s=30.0)
PIDS = (100, 101, 102)


def beat(rank: int, phase: str = "train", *, seq: int = 1, attempt: int = 0, in_place: bool = True) -> HeartbeatSeen:
    return HeartbeatSeen(attempt, rank, seq, step=7, phase=phase, in_place=in_place)


def training(policy=IN_PLACE, *, in_place: bool = True, restarts: int = 0) -> State:
    """Three ranks training; each has said whether it runs through worker.run."""
    state = running(policy, restarts=restarts)
    beats = tuple(beat(r, attempt=restarts, in_place=in_place) for r in range(3))
    state, _ = decide(state, Heartbeats(beats), NOW)
    return state


def unwinding(**kwargs) -> State:
    """Rank 1 was SIGKILLed; ranks 0 and 2 unwind."""
    state, _ = decide(training(**kwargs), ChildExited(0, 1, -9), NOW)
    assert state.stop_stage is StopStage.UNWIND
    return state


def recovering(*ranks: int, seq: int = 2, attempt: int = 0) -> Heartbeats:
    return Heartbeats(tuple(beat(r, RECOVERING_PHASE, seq=seq, attempt=attempt) for r in ranks))


def test_a_crash_whose_survivors_run_through_worker_run_unwinds_them_and_signals_none():
    state, actions = decide(training(), ChildExited(0, 1, -9), NOW)
    assert (state.phase, state.stop_stage, state.then) == (Phase.STOPPING, StopStage.UNWIND, Then.RELAUNCH)
    assert state.deadline == NOW + 30.0
    assert not any(isinstance(a, SignalRanks) for a in actions)
    assert PublishUnwind(0) in actions
    assert dict(record(actions, "unwinding").fields)["ranks"] == [0, 2]
    assert state.failures[-1].rank == 1  # a failed attempt like any other: the crash-loop breaker counts it


def test_once_every_survivor_recovers_the_next_attempt_keeps_them():
    state, _ = decide(unwinding(), recovering(0), NOW)
    assert state.stop_stage is StopStage.UNWIND  # rank 2 has not unwound yet
    state, actions = decide(state, recovering(2), NOW + 0.1)
    assert state.phase is Phase.STARTING and state.attempt == 1  # the first restart has no backoff
    assert state.recovering_in_place  # the supervisor writes its state file without an fsync meanwhile
    assert KillLeftovers(0, keep=(0, 2)) in actions  # the dead rank's children go; the survivors stay
    assert LaunchRanks(1, keep=(0, 2)) in actions
    assert not any(isinstance(a, SignalRanks) for a in actions)


def test_survivors_that_unwound_before_the_crash_was_seen_are_kept_at_once():
    """gloo raises in the survivors within tens of milliseconds: their beats may come before the exit."""
    state, _ = decide(training(), recovering(0, 2), NOW)
    assert state.phase is Phase.RUNNING
    state, actions = decide(state, ChildExited(0, 1, -9), NOW)
    assert LaunchRanks(1, keep=(0, 2)) in actions


def test_the_launch_of_a_recovery_in_place_is_journalled_with_who_stayed():
    state, actions = decide(unwinding(), recovering(0, 2), NOW)
    state, actions = decide(state, RanksLaunched(1, (100, 301, 102), 7), NOW)
    assert shape(actions) == ["recovered_in_place", "ranks_launched"]
    fields = dict(actions[0].fields)
    assert (fields["kept"], fields["replaced"], fields["resume_step"]) == ([0, 2], [1], 7)
    assert "SIGKILL" in fields["after"]
    assert state.keep == () and state.phase is Phase.RUNNING and not state.recovering_in_place
    assert state.recovery == "in place: ranks [0, 2] kept, [1] replaced"  # what `status` shows


def test_a_recovery_whose_launch_fails_for_good_is_no_longer_under_way():
    """The supervisor writes its state file without an fsync while a recovery in place is under way: a run that
    ends because the next attempt cannot be launched (too few nodes left) has its end written durably."""
    state, _ = decide(unwinding(), recovering(0, 2), NOW)
    assert state.keep == (0, 2) and state.recovering_in_place
    state, _ = decide(state, LaunchFailed(1, "not launched: needs 2 nodes, 1 usable left", retryable=False), NOW)
    assert state.phase.terminal and not state.recovering_in_place


def test_a_launcher_that_kept_fewer_ranks_than_asked_journals_the_ranks_it_kept_or_why_none():
    """On Slurm a kept rank's node may be excluded before the launch, or no spare take a lost node's place."""
    state, _ = decide(unwinding(), recovering(0, 2), NOW)
    fewer, _ = decide(state, RanksLaunched(1, (100, 301, 302), 7, kept=(0,)), NOW)
    assert fewer.recovery == "in place: ranks [0] kept, [1, 2] replaced"
    state, actions = decide(state, RanksLaunched(1, (300, 301, 302), 7, kept=(), not_kept="no spare node"), NOW)
    assert shape(actions) == ["relaunched", "ranks_launched"]
    assert dict(actions[0].fields)["reason"] == "no spare node"


def test_the_peers_of_a_lost_node_have_a_few_seconds_to_unwind_as_a_cut_off_node_never_lets_them():
    lost = Cause(CauseKind.NODE_LOST, "node b lost: no word from its agent for 10.0 s")
    state, actions = decide(training(), ChildExited(0, 1, -9, cause=lost, node="b", lost_with=(1,)), NOW)
    assert state.stop_stage is StopStage.UNWIND and state.deadline == NOW + LOST_NODE_UNWIND_S
    assert dict(record(actions, "unwinding").fields)["timeout_s"] == LOST_NODE_UNWIND_S
    state, actions = decide(state, Tick(), NOW + LOST_NODE_UNWIND_S)
    assert state.stop_stage is StopStage.TERM
    state, _ = decide(state, ChildExited(0, 0, -9), NOW + 6)
    state, _ = decide(state, ChildExited(0, 2, -9), NOW + 6)
    state, actions = decide(state, RanksLaunched(1, (300, 301, 302), 7), NOW + 7)
    reason = dict(record(actions, "relaunched").fields)["reason"]
    assert reason == f"ranks [0, 2] did not unwind within the wait for a lost node's peers ({LOST_NODE_UNWIND_S:g} s)"


def test_survivors_not_unwound_in_time_fall_back_to_a_full_relaunch():
    state, _ = decide(unwinding(), recovering(0), NOW)
    state, actions = decide(state, Tick(), NOW + 30.0)
    assert state.stop_stage is StopStage.TERM and state.then is Then.RELAUNCH
    assert SignalRanks(0, signal.SIGTERM, None) in actions
    assert dict(record(actions, "unwind_timed_out").fields)["ranks"] == [2]
    state, _ = decide(state, ChildExited(0, 0, -15), NOW + 31)
    state, actions = decide(state, ChildExited(0, 2, -15), NOW + 31)
    assert LaunchRanks(1) in actions  # nobody kept
    state, actions = decide(state, RanksLaunched(1, (300, 301, 302), 7), NOW + 32)
    assert (
        "did not unwind within restart.in_place_timeout_s (30 s)"
        in dict(record(actions, "relaunched").fields)["reason"]
    )


def test_a_survivor_that_dies_while_unwinding_is_replaced_too():
    state, _ = decide(unwinding(), recovering(0), NOW)
    state, actions = decide(state, ChildExited(0, 2, 1), NOW + 0.2)
    assert LaunchRanks(1, keep=(0,)) in actions


def test_no_survivor_left_while_unwinding_is_a_full_relaunch():
    state, _ = decide(unwinding(), ChildExited(0, 0, 1), NOW)
    state, actions = decide(state, ChildExited(0, 2, 1), NOW)
    assert LaunchRanks(1) in actions
    state, actions = decide(state, RanksLaunched(1, (300, 301, 302), 7), NOW)
    assert dict(record(actions, "relaunched").fields)["reason"] == "no rank survived the failure"


def test_a_script_without_worker_run_is_relaunched_and_the_journal_says_why():
    state, actions = decide(training(in_place=False), ChildExited(0, 1, -9), NOW)
    assert state.stop_stage is StopStage.TERM
    state, _ = decide(state, ChildExited(0, 0, -15), NOW)
    state, _ = decide(state, ChildExited(0, 2, -15), NOW)
    state, actions = decide(state, RanksLaunched(1, (300, 301, 302), 7), NOW)
    assert (
        "does not run its training function through worker.run" in dict(record(actions, "relaunched").fields)["reason"]
    )


def test_in_place_off_is_a_full_relaunch():
    state, _ = decide(
        training(replace(IN_PLACE, in_place=False, in_place_off="restart.in_place is false")),
        ChildExited(0, 1, -9),
        NOW,
    )
    assert state.stop_stage is StopStage.TERM
    assert state.full_relaunch == "restart.in_place is false"
    assert not state.recovering_in_place  # a full relaunch's changes of phase are fsynced as ever


def test_a_cuda_error_never_restarts_in_place():
    cuda = Cause(CauseKind.EXCEPTION, "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
    state, _ = decide(training(), ChildExited(0, 1, 1, cause=cuda), NOW)
    assert state.stop_stage is StopStage.TERM
    assert state.full_relaunch == "a CUDA error: a poisoned context never restarts in place"


def test_a_stop_while_unwinding_ends_the_survivors_instead():
    state, actions = decide(unwinding(), SignalReceived(signal.SIGTERM), NOW)
    assert state.then is Then.STOP and state.stop_stage is StopStage.TERM
    assert SignalRanks(0, signal.SIGTERM, None) in actions
    state, _ = decide(state, ChildExited(0, 0, -15), NOW)
    state, _ = decide(state, ChildExited(0, 2, -15), NOW)
    assert state.phase is Phase.STOPPED


def test_exhausted_restarts_fail_without_unwinding():
    state, actions = decide(training(replace(IN_PLACE, max_restarts=0)), ChildExited(0, 1, -9), NOW)
    assert state.then is Then.FAIL and state.stop_stage is StopStage.TERM


def test_beats_of_the_failed_attempt_after_the_relaunch_are_ignored():
    state, _ = decide(unwinding(), recovering(0, 2), NOW)
    state, _ = decide(state, RanksLaunched(1, (100, 301, 102), 7), NOW)
    state, actions = decide(state, recovering(0, seq=9), NOW)
    assert state.phase is Phase.RUNNING and actions == []


def test_a_second_recovery_backs_off_as_relaunches_do():
    state, _ = decide(training(restarts=1), ChildExited(1, 1, -9), NOW)
    state, actions = decide(state, recovering(0, 2, attempt=1), NOW)
    assert state.phase is Phase.BACKOFF and state.keep == (0, 2)
    state, actions = decide(state, Tick(), NOW + POLICY.backoff_s(1))
    assert LaunchRanks(2, keep=(0, 2)) in actions


def test_a_rank_unwound_with_every_rank_alive_fails_the_attempt_after_a_grace_and_keeps_every_rank():
    """A lost connection (the network) with no rank dead: after RECOVERING_GRACE_S without an exit, its collective is
    the attempt's failure; every rank recovers in place, none is replaced."""
    state, _ = decide(training(), recovering(1), NOW)
    assert recovering_deadline(state) == NOW + RECOVERING_GRACE_S
    state, actions = decide(state, Tick(), NOW + RECOVERING_GRACE_S / 2)
    assert state.phase is Phase.RUNNING and actions == []
    state, actions = decide(state, Tick(), NOW + RECOVERING_GRACE_S)
    assert dict(record(actions, "collective_lost").fields)["rank"] == 1
    assert state.stop_stage is StopStage.UNWIND and state.failures[-1].cause.kind is CauseKind.COLLECTIVE
    state, actions = decide(state, recovering(0, 2, seq=3), NOW + 1)
    assert LaunchRanks(1, keep=(0, 1, 2)) in actions


def test_the_collective_lost_is_charged_to_the_rank_whose_collective_failed_first_not_to_the_first_heard():
    """Rank 0's collective failed; rank 1's failed when rank 0 let go of its group, and rank 1 said so first."""
    late = HeartbeatSeen(0, 0, 2, step=7, phase=RECOVERING_PHASE, in_place=True, failed_s=0.05)
    state, _ = decide(training(), Heartbeats((replace(late, rank=1, failed_s=0.001),)), NOW)
    state, _ = decide(state, Heartbeats((late,)), NOW + 0.03)  # failed at NOW - 0.02, before rank 1 did
    state, actions = decide(state, Tick(), NOW + RECOVERING_GRACE_S)
    assert dict(record(actions, "collective_lost").fields)["rank"] == 0
    # Without a failure time (an older worker), the first heard is the rank charged.
    state, _ = decide(training(), recovering(1), NOW)
    state, _ = decide(state, recovering(0, seq=3), NOW + 0.03)
    state, actions = decide(state, Tick(), NOW + RECOVERING_GRACE_S)
    assert dict(record(actions, "collective_lost").fields)["rank"] == 1


def test_a_rank_unwound_with_every_rank_alive_relaunches_all_where_in_place_is_off():
    policy = replace(IN_PLACE, in_place=False, in_place_off="restart.in_place is false")
    state, _ = decide(training(policy), recovering(1), NOW)
    state, actions = decide(state, Tick(), NOW + RECOVERING_GRACE_S)
    assert state.stop_stage is StopStage.TERM and SignalRanks(0, signal.SIGTERM, None) in actions


def hung() -> State:
    """Every rank silent past its train timeout: the hang is suspected, stacks are being collected."""
    state, _ = decide(training(), Tick(), NOW + 10_000)
    assert state.stop_stage is StopStage.STACKS
    return state


def test_a_hang_whose_culprit_the_evidence_names_kills_it_alone_and_its_peers_recover_in_place():
    named = Verdict(1, "host-side", "flight_recorder", "process group 0: rank 1 issued no more collectives")
    state, actions = decide(hung(), StacksCollected(0, ("a",), culprit=1, verdict=named), NOW + 10_001)
    assert SignalRanks(0, signal.SIGKILL, (1,)) in actions and PublishUnwind(0) in actions
    assert not any(isinstance(a, SignalRanks) and a.signum == signal.SIGTERM for a in actions)
    assert shape(actions)[:3] == ["stacks_collected", "hang_detected", "hang_culprit_killed"]
    assert state.stop_stage is StopStage.UNWIND
    state, _ = decide(state, recovering(0, 2, seq=5), NOW + 10_001.1)
    state, actions = decide(state, ChildExited(0, 1, -9), NOW + 10_001.2)
    assert LaunchRanks(1, keep=(0, 2)) in actions


def test_a_hang_named_by_heartbeats_alone_relaunches_every_rank():
    state, actions = decide(hung(), StacksCollected(0, ("a",)), NOW + 10_001)
    assert state.stop_stage is StopStage.TERM
    assert state.full_relaunch == "a hang: the ranks blocked behind it go down with it"
