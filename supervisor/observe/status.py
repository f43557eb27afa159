"""The run's state file: written atomically by the supervisor, read and summarised by `trainwarden status`."""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from typing import Any, TypeGuard

from supervisor.core import FAILURES_KEPT, Failure, Hang, History, Phase, State
from supervisor.core.causes import MAX_CAUSE_CHARS, Cause, CauseKind
from supervisor.core.hangs import TRAIN_PHASE, phase_timeout
from supervisor.observe.goodput import describe as describe_goodput
from supervisor.rundir.lease import LOCAL_TTL_S, newest, pid_alive
from worker.contract import EXIT_REQUEUE, RunLayout
from worker.files import atomic_write_json, read_json

__all__ = [
    "FAILURES_SHOWN",
    "INTERRUPTED",
    "StatusError",
    "read_history",
    "read_status",
    "render",
    "shown_state",
    "snapshot",
    "write_status",
]

FAILURES_SHOWN = 5  # the newest failed attempts in `status`: enough to see a crash loop
INTERRUPTED = "interrupted (resubmit)"  # how an end with EXIT_REQUEUE reads for people: the job is fine, run it again
MAX_RANK_LINES = MAX_NODE_LINES = 16  # beyond this many, `status` summarises them (--json has every one)
SHOWN_IN_SUMMARY = 5  # the ranks (nodes) worth a look that a summary names
# A record per rank and node: about 1.5 MB at 1,024 nodes x 8 ranks (bench/fan_in.py), so not the 1 MiB of the
# other JSON files; this bound still keeps a hostile file from filling the reader's memory.
MAX_STATE_BYTES = 64 << 20
STALE_NOTE_S = 2.0  # a live run's status older than this says so (a small run's is rewritten every second)


class StatusError(Exception):
    """No readable state file in the run dir."""


def _resumed_from(state: State) -> dict[str, Any] | None:
    if state.resume_step is None:
        return None
    source = {} if state.resume_source is None else {"source": state.resume_source}
    return {"step": state.resume_step, **source}


def _hang(hang: Hang) -> dict[str, Any]:
    """The hang as the journal's `hang_detected` names it (`class`, not the field's `cls`)."""
    fields = asdict(hang)
    cls = fields.pop("cls")
    return {**fields, "silent_s": round(hang.silent_s, 3), "class": cls}


def _failure(failure: Failure) -> dict[str, Any]:
    node = {} if failure.node is None else {"node": failure.node}
    return {
        "attempt": failure.attempt,
        "rank": failure.rank,
        "step": failure.step,
        "resume_step": failure.resume_step,
        "progressed": failure.progressed,
        "kind": failure.cause.kind.value,
        "cause": failure.cause.text,
        **node,
    }


def snapshot(state: State, *, now: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready status of the run; `now` is monotonic, `extra` carries what the core does not know."""
    ranks = []
    for r in state.ranks:
        age = None if r.heartbeat_monotonic is None else round(now - r.heartbeat_monotonic, 3)
        ranks.append(
            {
                "rank": r.rank,
                "pid": r.pid,
                "step": r.step,
                "heartbeat_age_s": age,
                "heartbeat_phase": r.heartbeat_phase,
                "returncode": r.returncode,
            }
        )
    return {
        "state": state.phase.value,
        "attempt": state.attempt,
        "restarts": state.restarts,
        "max_restarts": state.policy.max_restarts,
        "ranks": ranks,
        "heartbeats": "on" if state.heartbeats_seen else "off",  # some rank of the run beat: not only this attempt's
        "heartbeat_mode": state.policy.hang.heartbeat,
        "resumed_from": _resumed_from(state),
        "passed_over": [{"step": step, "reason": reason} for step, reason in state.resume_passed_over],
        "hang": None if state.hang is None else _hang(state.hang),
        "rollback": None if state.rollback is None else asdict(state.rollback),
        "stop_order": None if state.stop_order is None else {**asdict(state.stop_order), "source": state.stop_source},
        "stopped_at": None if state.stopped_at is None else {"step": state.stopped_at, "source": state.stop_source},
        "calibration": {
            "enabled": state.policy.hang.calibration.enabled,
            "train_timeout_s": phase_timeout(state.policy.hang, TRAIN_PHASE, state.step_gaps),
            "samples": len(state.step_gaps),
            "step_gaps": [round(g, 4) for g in state.step_gaps],
        },
        "last_failure": state.last_failure,
        "cause": state.cause,
        "recovery": state.recovery,
        "history": {
            "attempt": state.attempt,
            "restarts": state.restarts,
            "failures": [{**_failure(f), "key": f.cause.key} for f in state.failures[-FAILURES_KEPT:]],
        },
        "failures": [_failure(f) for f in state.failures[-FAILURES_SHOWN:]],
        "reason": state.reason,
        "exit_code": state.exit_code,
        "time_limit": _time_limit(state),
        "updated_at": time.time(),
        **extra,
    }


def _time_limit(state: State) -> dict[str, Any] | None:
    """The job's end time as last read, the margin before it, and whether the run is ending for it (`status`)."""
    limit = state.time_limit
    if limit is None or not limit.end_time:
        return None
    return {"end_time": limit.end_time, "margin_s": limit.margin_s, "ending": state.time_limit_near}


def read_history(status: dict[str, Any]) -> History | None:
    """The history a supervisor left in its state file, when it died mid-run (not when the run ended: a new
    `trainwarden run` of an ended run starts afresh); None when there is none or it is not sane (the file is
    untrusted: garbage loses the history, never the run)."""
    if status.get("state") in [phase.value for phase in Phase if phase.terminal]:  # not a set: it may be a JSON list
        return None
    history = status.get("history")
    if not isinstance(history, dict):
        return None
    try:
        attempt, restarts, failures = history["attempt"], history["restarts"], history["failures"]
        if not (_count(attempt) and _count(restarts) and isinstance(failures, list)):
            return None
        return History(attempt, restarts, tuple(_read_failure(f) for f in failures[-FAILURES_KEPT:]))
    except (KeyError, TypeError, ValueError):
        return None


def _read_failure(record: dict[str, Any]) -> Failure:
    text, key, node = record["cause"], record.get("key", ""), record.get("node")
    if not (isinstance(text, str) and isinstance(key, str) and len(text) <= MAX_CAUSE_CHARS >= len(key)):
        raise ValueError("not a cause")
    if not (
        _count(record["attempt"])
        and _count(record["rank"])
        and _count_or_none(record["step"])
        and _count_or_none(record["resume_step"])
        and record["progressed"] in (True, False, None)
        and (node is None or (isinstance(node, str) and len(node) <= 255))
    ):
        raise ValueError("not a failure")
    return Failure(
        record["attempt"],
        record["rank"],
        record["step"],
        record["resume_step"],
        Cause(CauseKind(record["kind"]), text, key),
        record["progressed"],
        node,
    )


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**31


def _is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return type(value) in (int, float)


def _count_or_none(value: object) -> bool:
    return value is None or _count(value)


def write_status(layout: RunLayout, status: dict[str, Any], *, durable: bool) -> None:
    atomic_write_json(layout.state_file, status, root=layout.root, durable=durable)


def read_status(layout: RunLayout) -> dict[str, Any]:
    """The last state the supervisor wrote, with heartbeat ages brought up to now and a liveness check."""
    try:
        status = read_json(layout.state_file, limit=MAX_STATE_BYTES)
    except FileNotFoundError:
        raise StatusError(f"{layout.root}: no trainwarden run here (missing {layout.state_file})") from None
    except (OSError, ValueError) as exc:
        raise StatusError(f"{layout.state_file}: unreadable: {exc}") from None
    if not isinstance(status, dict) or not isinstance(status.get("ranks"), list):
        raise StatusError(f"{layout.state_file}: not a trainwarden state file")
    status["supervisor"] = _supervisor(layout, status)
    status["supervisor_alive"] = status["supervisor"]["alive"]
    try:
        # Ages were true when written; a beat only gets older, whether the supervisor lives to rewrite them or not.
        since = max(0.0, time.time() - status.get("updated_at", time.time()))
        status["written_s_ago"] = round(since, 1)
        for entry in status["ranks"] + (status.get("nodes") or []):
            if entry.get("heartbeat_age_s") is not None:
                entry["heartbeat_age_s"] = round(entry["heartbeat_age_s"] + since, 3)
        render(status)  # a state file we cannot summarise is not one we wrote
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise StatusError(f"{layout.state_file}: not a trainwarden state file ({type(exc).__name__}: {exc})") from None
    return status


def _supervisor(layout: RunLayout, status: dict[str, Any]) -> dict[str, Any]:
    """Whether the supervisor lives, judged from here: by its pid on its own host, elsewhere by the age of its
    lease (renewed every fifth of its ttl); with where it runs and when it was last heard."""
    now, here = time.time(), socket.gethostname()
    lease = newest(layout)
    if lease is None:  # a run of a version without a lease: its state file's host and stamp
        host, pid = status.get("supervisor_host"), status.get("supervisor_pid")
        at, ttl, state = status.get("updated_at"), LOCAL_TTL_S, "held"
    else:
        host, pid, at, ttl, state = lease.host, lease.pid, lease.renewed_at, lease.ttl_s, lease.state
    heard = round(now - at, 1) if _is_number(at) else None
    if state != "held":
        alive = False
    elif host in (None, here):
        alive = type(pid) is int and pid_alive(pid)
    else:
        alive = heard is not None and heard <= ttl
    return {
        "alive": alive,
        "host": host,
        "pid": pid,
        "heard_s_ago": heard,
        "lease": state,
        "generation": None if lease is None else lease.generation,
    }


def _sane_reason(said: Any, key: str = "reason") -> bool:
    """A reason as the supervisor wrote it: one printable line (the state file may have been tampered with)."""
    reason = said.get(key) if isinstance(said, dict) else None
    return isinstance(reason, str) and reason.isprintable() and len(reason) <= 400


def _inexact_lines(inexact: Any) -> list[str]:
    """'resume not exact (ranks 0, 1): <why>', a line for each reason the ranks of this attempt gave."""
    said = [i for i in inexact if _sane_reason(i)] if isinstance(inexact, list) else []
    lines = []
    for each in said[:SHOWN_IN_SUMMARY]:
        ranks = [r for r in each["ranks"] if type(r) is int][:8] if isinstance(each.get("ranks"), list) else []
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)) if ranks else "a rank"
        lines.append(f"  resume not exact ({who}): {each['reason']}")
    if len(said) > SHOWN_IN_SUMMARY:
        lines.append(f"  ... and {len(said) - SHOWN_IN_SUMMARY} more reasons (status --json lists them)")
    return lines


def _slow_save_lines(said: Any) -> list[str]:
    """'saves wait for the previous write (2 ranks): rank 0's took 3.1 s, ...; set ...', for the slowest rank."""
    slowest = said.get("slowest") if isinstance(said, dict) else None
    first = slowest[0] if isinstance(slowest, list) and slowest and isinstance(slowest[0], dict) else {}
    rank, write_s, interval_s = first.get("rank"), first.get("write_s"), first.get("interval_s")
    if not (type(rank) is int and _is_number(write_s) and _is_number(interval_s) and _sane_reason(first, "setting")):
        return []  # none, or a tampered state file
    ranks = said.get("ranks")
    who = f"{ranks} ranks" if type(ranks) is int and ranks > 1 else f"rank {rank}"
    return [
        f"  saves wait for the previous write ({who}): rank {rank}'s took {write_s:.3g} s, with {interval_s:.3g} s "
        f"of training between saves; set {first['setting']}"
    ]


def shown_state(state: Any, exit_code: Any) -> str:
    """The run's state as people read it: an end with exit 75 ("requeue me": a time limit with the save done, too
    few healthy nodes) is `interrupted (resubmit)`, neither `failed` nor `stopped` (the state file keeps the phase)."""
    if state in ("stopped", "failed") and exit_code == EXIT_REQUEUE and type(exit_code) is int:
        return INTERRUPTED
    return str(state)


SDC_KINDS = ("sdc_data", "sdc_transient", "sdc_persistent")  # the re-runs' verdicts as the ranks count them


def render(status: dict[str, Any]) -> str:
    """A short human summary of a status dict."""
    lines = [
        f"run {status.get('run_dir')}: {shown_state(status['state'], status.get('exit_code'))}, "
        f"attempt {status['attempt']}, "
        f"restarts {status['restarts']}/{status.get('max_restarts')}"
    ]
    lines += _supervisor_lines(status)
    ckpt = status.get("last_checkpoint")
    lines.append(
        f"  last checkpoint: {'step ' + str(ckpt['step']) if ckpt else 'none'}"
        + (f"; resumed from step {status['resumed_from']['step']}" if status.get("resumed_from") else "")
        + _resume_source(status.get("resumed_from"))
    )
    if memory := _memory_line(status.get("memory")):
        lines.append(f"  {memory}")
    for skipped in status.get("passed_over") or []:
        lines.append(f"  passed over step {skipped['step']}: {skipped['reason']}")
    if goodput := describe_goodput(status.get("goodput")):  # None for a missing or tampered block
        lines.append(f"  {goodput}")
    lines += _inexact_lines(status.get("resume_inexact"))
    lines += _slow_save_lines(status.get("save_slower_than_interval"))
    lines += _heartbeat_lines(status)
    lines += _node_lines(status)
    lines += _rank_lines(status["ranks"], status.get("rank_compute_s"))
    slow = status.get("stragglers") or []
    lines += [
        f"  slow rank {r['rank']}: {r['compute_s']:.3g} s of compute per step, {r['slower_by']:.0%} "
        f"above the other ranks' median ({r['median_s']:.3g} s)"
        for r in slow[:SHOWN_IN_SUMMARY]
    ]
    if len(slow) > SHOWN_IN_SUMMARY:
        lines.append(f"  ... and {len(slow) - SHOWN_IN_SUMMARY} more slow ranks (status --json lists them)")
    if hang := status.get("hang"):
        stacks = ", ".join(hang["stacks"]) or "none collected"
        on = f" on {hang['node']}" if hang.get("node") else ""
        lines.append(
            f"  hang in attempt {hang['attempt']}: rank {hang['rank']}{on} in phase {hang['phase']} "
            f"after step {hang['step']}; the job was silent {hang['silent_s']:.1f} s "
            f"(timeout {hang['timeout_s']:g} s)"
        )
        if hang.get("class"):
            lines.append(f"  culprit: {hang['class']}, named by {hang.get('named_by')}: {hang.get('evidence')}")
        lines.append(f"  stacks: {stacks}")
    if rollback := status.get("rollback"):
        abort = rollback["abort"]
        lines.append(
            f"  rollback {rollback['tries']} of this region: anomalies in steps {abort['first_step']}-"
            f"{abort['abort_step']}; resumed at or before step {rollback['resume_at_most']}, "
            f"skipping data up to batch {rollback['skip_to_batch']}"
        )
    if order := status.get("stop_order"):
        then = "exit" if order["exit"] else "continue"
        lines.append(f"  stop order ({order['source']}): checkpoint at step {order['step']}, then {then}")
    lines += _verdict_lines(status)
    if status.get("last_failure"):
        lines.append(f"  last failure: {status['last_failure']}")
    if status.get("cause"):
        lines.append(f"  cause: {status['cause']}")
    lines += _failure_lines(status.get("failures") or [])
    if isinstance(status.get("recovery"), str):
        lines.append(f"  recovered: {status['recovery']}")
    if status.get("reason"):
        lines.append(f"  reason: {status['reason']}")
    return "\n".join(lines)


def _resume_source(resumed: Any) -> str:
    """` (memory)`, ` (snapshot slot 1)`: where the resume came from, when not the regular checkpoints."""
    source = resumed.get("source") if isinstance(resumed, dict) else None
    return f" ({source[:80]})" if isinstance(source, str) and source.isprintable() else ""


def _memory_line(memory: Any) -> str | None:
    """`memory: snapshot step 231 (0.4 s old), 48.2 MB in /dev/shm/...`; None without a (readable) memory block."""
    if not isinstance(memory, dict) or not isinstance(memory.get("dir"), str) or not memory["dir"].isprintable():
        return None
    held = memory.get("bytes")
    if type(held) is not int or held < 0:  # may pass 2**31: gigabytes
        return None
    step, age = memory.get("snapshot_step"), memory.get("snapshot_age_s")
    newest = f"snapshot step {step}" if _count(step) else "no complete snapshot"
    if _count(step) and _is_number(age):
        newest += f" ({age:.1f} s old)"
    pins = memory.get("pins_waiting")
    waiting = f", {pins} waiting to be persisted" if _count(pins) and pins else ""
    return f"memory: {newest}, {held / 1e6:.1f} MB in {memory['dir'][:200]}{waiting}"


def _rank_lines(ranks: list[dict[str, Any]], compute: Any) -> list[str]:
    """One line per rank; beyond MAX_RANK_LINES ranks, a summary and the ranks worth a look."""
    if len(ranks) <= MAX_RANK_LINES:
        return [_rank_line(rank) for rank in ranks]
    running = [r for r in ranks if r.get("pid") is not None and r.get("returncode") is None]
    failed = [r for r in ranks if r.get("returncode") not in (None, 0)]
    steps = [r["step"] for r in running if type(r.get("step")) is int]
    ages = sorted(r["heartbeat_age_s"] for r in running if isinstance(r.get("heartbeat_age_s"), (int, float)))
    lines = [
        f"  ranks: {len(ranks)}, {len(running)} running, {len(failed)} failed"
        + (f"; steps {min(steps)}-{max(steps)}" if steps else "")
        + (f"; heartbeat ages: median {ages[len(ages) // 2]:.1f} s, oldest {ages[-1]:.1f} s" if ages else "")
    ]
    worst = failed + sorted((r for r in running if r not in failed), key=_quietness)
    lines += [_rank_line(rank) for rank in worst[:SHOWN_IN_SUMMARY]]
    figures = (
        [(value, rank) for rank, value in compute.items() if isinstance(value, (int, float))]
        if isinstance(compute, dict)
        else []
    )
    if figures:
        slowest = sorted(figures, reverse=True)[:SHOWN_IN_SUMMARY]
        lines.append("  most compute per step: " + ", ".join(f"rank {rank} {value:.3g} s" for value, rank in slowest))
    return lines


def _quietness(rank: dict[str, Any]) -> tuple[float, int]:
    """The quietest first (the oldest heartbeat, none at all before any), then the furthest behind."""
    age = rank.get("heartbeat_age_s")
    step = rank.get("step")
    return (-(age if isinstance(age, (int, float)) else float("inf")), step if type(step) is int else -1)


def _rank_line(rank: dict[str, Any]) -> str:
    age = rank["heartbeat_age_s"]
    beat = "no heartbeat" if age is None else f"heartbeat {age:.1f} s ago ({rank.get('heartbeat_phase')})"
    code = "" if rank.get("returncode") is None else f", exit {rank['returncode']}"
    return f"  rank {rank['rank']}: pid {rank['pid']}, step {rank['step']}, {beat}{code}"


def _supervisor_lines(status: dict[str, Any]) -> list[str]:
    """Where the supervisor runs, said plainly when it is gone (a state nobody updates is stale)."""
    ended = status["state"] in ("finished", "stopped", "failed")
    found = status.get("supervisor")
    sup: dict[str, Any] = found if isinstance(found, dict) else {}
    where = f"pid {sup.get('pid', status.get('supervisor_pid'))}" + (f" on {sup['host']}" if sup.get("host") else "")
    heard = sup.get("heard_s_ago")
    if status.get("supervisor_alive") or ended:
        if not status.get("nodes") or ended or heard is None:
            return []
        written = status.get("written_s_ago")
        # The file of a large run is rewritten every few seconds (its CPU share is bounded): ages include that.
        as_of = f"; this status is {written:.0f} s old" if _is_number(written) and written >= STALE_NOTE_S else ""
        return [f"  supervisor: {where}, heard {heard:.1f} s ago{as_of}"]
    if sup.get("lease") == "abdicated":
        return [
            f"  supervisor ({where}) lost its link and handed over; no successor has taken the run yet; "
            "this state is stale"
        ]
    ago = "" if heard is None else f", last heard {heard:.0f} s ago"
    return [f"  supervisor ({where}) is gone{ago}; this state is stale"]


def _time_limit_line(limit: Any) -> str | None:
    """'  time limit: the job ends 2026-11-28T14:00:00+0000; the run saves and exits 75 300 s before'."""
    if not isinstance(limit, dict) or not isinstance(end := limit.get("end_time"), str):
        return None
    if not _is_number(margin := limit.get("margin_s")):
        return None
    doing = "is saving to exit 75 (resubmit)" if limit.get("ending") is True else "saves and exits 75"
    return f"  time limit: the job ends {end[:40]}; the run {doing} {margin:.0f} s before"


def _node_lines(status: dict[str, Any]) -> list[str]:
    """Multi-node runs: one line per node of the allocation, and where the last failure was."""
    lines = []
    if status.get("slurm_job"):
        failed = f"; last failure on {status['failed_on']}" if status.get("failed_on") else ""
        lines.append(f"  slurm job {status['slurm_job']}{failed}")
        if (limit := _time_limit_line(status.get("time_limit"))) is not None:
            lines.append(limit)
    world, full = status.get("world_size"), status.get("full_world_size")
    if type(world) is int and type(full) is int and world < full:
        lines.append(f"  shrunk: {world} of {full} ranks (slurm.min_nodes; a job with every node grows back)")
    stale = not status.get("supervisor_alive") and status["state"] not in ("finished", "stopped", "failed")
    nodes = status.get("nodes") or []
    if len(nodes) > MAX_NODE_LINES:  # a summary, and the nodes that are not simply running
        states: dict[str, int] = {}
        for node in nodes:
            states[node["state"]] = states.get(node["state"], 0) + 1
        lines.append("  nodes: " + ", ".join(f"{count} {state}" for state, count in sorted(states.items())))
        odd = [node for node in nodes if node["state"] not in ("running", "spare")]
        nodes = odd[:SHOWN_IN_SUMMARY]
        if len(odd) > SHOWN_IN_SUMMARY:
            lines.append(f"  ... {len(odd) - SHOWN_IN_SUMMARY} more not running (status --json lists every node)")
    for node in nodes:
        ranks = f", ranks {node['ranks'][0]}-{node['ranks'][-1]}" if node.get("ranks") else ""
        age = node.get("heartbeat_age_s")
        heard = "" if age is None or stale or node["state"] == "ended" else f", agent heard {age:.1f} s ago"
        why = f" ({node['why']})" if node.get("why") else ""
        state = f"{node['state']} when the supervisor was last heard" if stale else node["state"]
        held = node.get("memory_bytes")
        memory = f", {held / 1e6:.1f} MB of snapshots in memory" if type(held) is int and held > 0 else ""
        lines.append(f"  node {node['node']}: {state}{why}{ranks}{heard}{memory}")
    return lines


def _heartbeat_lines(status: dict[str, Any]) -> list[str]:
    """Whether hangs can be detected, said only where it is news: not while ranks are being (re)launched, nor once
    any rank of the run has beaten (a relaunch's new ranks have not yet)."""
    mode = status.get("heartbeat_mode")
    if mode == "off":
        return ["  hang detection is off (hang.heartbeat: off)"]
    if status.get("heartbeats") != "off" or not any(rank.get("pid") for rank in status["ranks"]):
        return []
    if mode == "required":
        return ["  heartbeats: none seen yet (hang.heartbeat: required: a rank silent past first_heartbeat_s hangs)"]
    return ["  heartbeats: none seen (script does not use the worker library?): hang detection is off"]


def _verdict_lines(status: dict[str, Any]) -> list[str]:
    """What re-running suspect steps found: the count of each verdict this supervisor saw, then the verdicts on
    devices the node ledger holds (every job of the run dir's), newest last."""
    anomalies = status.get("anomalies")
    anomalies = anomalies if isinstance(anomalies, dict) else {}
    counts = [f"{n} {kind[4:]}" for kind in SDC_KINDS if type(n := anomalies.get(kind)) is int and n > 0]
    lines = [f"  re-run verdicts: {', '.join(counts)}"] if counts else []
    for verdict in (status.get("device_verdicts") or [])[-SHOWN_IN_SUMMARY:]:
        if _sane_reason(verdict) and _is_number(verdict.get("at")):
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(verdict["at"]))
            lines.append(f"  device verdict on {verdict['node']} at {at}: {verdict['reason']}")
    return lines


def _failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    """The newest failed attempts, one line each, where each stopped and why; one failure is the cause line alone."""
    if len(failures) < 2:
        return []
    lines = ["  failed attempts:"]
    for failure in failures:
        at = "" if failure.get("step") is None else f" at step {failure['step']}"
        resumed = "" if failure.get("resume_step") is None else f" (resumed from {failure['resume_step']})"
        on = f" on {failure['node']}" if failure.get("node") else ""
        lines.append(f"    attempt {failure['attempt']}: rank {failure['rank']}{on}{at}{resumed}: {failure['cause']}")
    return lines
