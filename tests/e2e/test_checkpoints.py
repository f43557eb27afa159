"""The supervisor resumes a real run from its newest intact checkpoint and says why it passed newer ones over."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from tests.checkpoint_files import CRAFTED_REFUSAL, load_saved, write_crafted
from tests.e2e.conftest import (
    DEMO_SAVE_EVERY,
    DEMO_STEPS,
    REFERENCE_WORKER,
    checkpoints_of,
    journal,
    run_supervisor,
    write_config,
)

pytestmark = pytest.mark.timeout(240)


def test_corrupted_truncated_and_incomplete_checkpoints_are_passed_over_with_reasons(
        tmp_path: Path, reference_run: Path) -> None:
    """In the checkpoints of a finished run (the reference's, health-tagged), flip a byte in 60, truncate 50, drop a
    completion record of 40: the rerun resumes from 30 and finishes."""
    run_dir = checkpoints_of(reference_run, tmp_path / "run")
    config = write_config(tmp_path / "job.yaml", worker=REFERENCE_WORKER)
    health = json.loads((run_dir / "health_ckpts.json").read_text())
    assert [(h["step"], h["is_health"], h["ckpt_name"]) for h in health] == [
        (s, 0, f"demo_rank_0-{s}.ckpt") for s in range(10, 61, 10)]

    ckpt = run_dir / "checkpoint"
    flipped = bytearray((ckpt / "rank_1" / "demo_rank_1-60.ckpt").read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    (ckpt / "rank_1" / "demo_rank_1-60.ckpt").write_bytes(bytes(flipped))
    truncated = ckpt / "rank_0" / "demo_rank_0-50.ckpt"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    (ckpt / "rank_1" / "demo_rank_1-40.json").unlink()
    (ckpt / "rank_0" / "stray.txt").write_text("junk a person left here")

    second = run_supervisor(config, run_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    status = second.status()
    assert status["resumed_from"] == {"step": 30}
    assert [p["step"] for p in status["passed_over"]] == [60, 50, 40]
    reasons = [p["reason"] for p in status["passed_over"]]
    assert reasons[0] == "corrupted on rank 1: checksum differs from the one written"
    assert reasons[1].startswith("truncated on rank 0: 1000 bytes, ")
    assert reasons[2] == "incomplete: rank 1 has no completion record"
    logged = [(e["step"], e["reason"]) for e in journal(run_dir) if e["event"] == "checkpoint_passed_over"]
    assert logged == [(p["step"], p["reason"]) for p in status["passed_over"]]
    assert status["last_checkpoint"] == {"step": 60}  # rewritten whole by the resumed run
    assert (ckpt / "rank_0" / "stray.txt").exists()  # junk is ignored, never deleted
    reported = [e["paths"] for e in journal(run_dir) if e["event"] == "checkpoint_dir_junk"]
    assert reported == [[str(ckpt / "rank_0" / "stray.txt")]]


def test_keep_checkpoint_max_rotates_old_checkpoints_of_a_real_run(tmp_path: Path) -> None:
    """With keep_checkpoint_max 2 the supervisor deletes older complete checkpoints, records first, as they come."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.yaml", worker={"save_checkpoint_steps": 10, "keep_checkpoint_max": 2})
    done = run_supervisor(config, run_dir)

    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        names = sorted(p.name for p in (run_dir / "checkpoint" / f"rank_{rank}").iterdir() if p.name != "meta.json")
        assert names == sorted(f"demo_rank_{rank}-{s}.{kind}" for s in (50, 60) for kind in ("ckpt", "json"))
    rotated = [e["step"] for e in journal(run_dir) if e["event"] == "checkpoint_rotated"]
    assert sorted(rotated) == [10, 20, 30, 40]
    health = json.loads((run_dir / "health_ckpts.json").read_text())
    assert [h["step"] for h in health] == [50, 60]


def test_a_named_checkpoint_wins_and_an_unusable_one_refuses_to_start(tmp_path: Path, reference_run: Path) -> None:
    """`resume_training: <name>` resumes from that checkpoint although newer ones are fine; a corrupted one
    named, or nothing usable with `no_usable_checkpoint: refuse`, fails the run with the reason and starts nothing."""
    run_dir = checkpoints_of(reference_run, tmp_path / "run")
    worker = {"save_checkpoint_steps": 10}

    by_name = {**worker, "resume_training": "demo_rank_1-30.ckpt"}
    named = run_supervisor(write_config(tmp_path / "b.yaml", worker=by_name), run_dir)
    assert named.returncode == 0, named.stderr[-3000:]
    assert named.status()["resumed_from"] == {"step": 30}

    for path in (run_dir / "checkpoint").glob("rank_1/demo_rank_1-*.ckpt"):
        path.write_bytes(path.read_bytes()[:100])  # every checkpoint of rank 1 truncated
    written = json.loads((run_dir / "checkpoint" / "rank_1" / "demo_rank_1-20.json").read_text())["size"]
    broken = run_supervisor(write_config(tmp_path / "c.yaml", worker={**worker, "resume_training": "20"}), run_dir)
    assert broken.returncode == 1
    assert broken.status()["reason"] == ("could not launch ranks: the checkpoint named by worker.resume_training "
                                         f"(step 20) is not usable: truncated on rank 1: 100 bytes, {written} written")

    refused = run_supervisor(write_config(tmp_path / "d.yaml", worker={**worker, "no_usable_checkpoint": "refuse"}),
                             run_dir)
    assert refused.returncode == 1
    assert refused.status()["reason"].startswith("could not launch ranks: no usable checkpoint (newest, step 60: "
                                                 "truncated on rank 1: 100 bytes")
    assert refused.status()["reason"].endswith("refusing to start from scratch (worker.no_usable_checkpoint: refuse)")


def test_a_peer_crash_does_not_cost_the_save_in_flight(fault_stream_run: Path) -> None:
    """Attempt 1 of FAULT_STREAM: rank 1 dies right after saving step 20 while rank 0 is in its 4 s save of 20, with
    a 1 s kill grace: the supervisor waits for the save (up to the save timeout), rank 0 finishes it and then obeys
    SIGTERM, and the relaunch resumes from 20. Rank 1's save takes 1 s more, so rank 0 is surely inside its save
    when rank 1 dies (on a busy machine rank 0 may otherwise still be in its step: then no save is in flight, and
    the SIGTERM rightly ends it there)."""
    events = journal(fault_stream_run)
    (crash,) = [i for i, e in enumerate(events) if e["event"] == "rank_crashed" and e["attempt"] == 1]
    assert (events[crash]["rank"], events[crash]["step"]) == (1, 20)
    wait = next(e for e in events[crash:] if e["event"] == "stop_waits_for_save")
    assert wait["ranks"] == [0] and 0 < wait["wait_s"] <= 6.0  # what is left of the save timeout
    stopped = [e for e in events if e["event"] == "rank_stopped" and e["attempt"] == 1]
    assert [(e["rank"], e["description"]) for e in stopped] == [(0, "killed by SIGTERM")]
    rank0 = [json.loads(line) for line in (fault_stream_run / "ranks" / "rank_0" / "events.jsonl").open()]
    assert [e["event"] for e in rank0 if e["attempt"] == 1][-2:] == ["checkpoint_saved", "stopped_after_save"]
    assert [e["resume_step"] for e in events if e["event"] == "ranks_launched" and e["attempt"] == 2] == [20]


def test_a_crafted_checkpoint_is_refused_and_the_run_resumes_from_an_older_one(
        tmp_path: Path, reference_run: Path) -> None:
    """Rank 1's newest checkpoint swapped for a crafted pickle with a matching completion record, as an attacker
    would: the rank refuses it without running it (exit 66), and the supervisor resumes from the one before."""
    run_dir = checkpoints_of(reference_run, tmp_path / "run")
    crafted, marker = run_dir / "checkpoint" / "rank_1" / f"demo_rank_1-{DEMO_STEPS}.ckpt", tmp_path / "marker"
    write_crafted(crafted, marker)
    data, record = crafted.read_bytes(), crafted.with_suffix(".json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "size": len(data),
                                  "crc32": f"{zlib.crc32(data):08x}"}))  # what the supervisor checks

    second = run_supervisor(write_config(tmp_path / "job.yaml"), run_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not marker.exists()
    events, newest, before = journal(run_dir), DEMO_STEPS, DEMO_STEPS - DEMO_SAVE_EVERY
    refused = [e for e in events if e["event"] == "checkpoint_refused"]
    assert [(e["level"], e["rank"], e["attempt"], e["step"], e["path"], e["error"]) for e in refused] == [
        ("error", 1, 0, newest, str(crafted), CRAFTED_REFUSAL)]
    assert [e["resume_step"] for e in events if e["event"] == "ranks_launched"] == [newest, before]
    status = second.status()
    assert (status["state"], status["restarts"], status["resumed_from"]) == ("finished", 1, {"step": before})
    assert status["passed_over"] == [{"step": newest, "reason": f"refused by rank 1: {CRAFTED_REFUSAL}"}]
    assert load_saved(crafted)["step"] == newest  # saved again, for real, by the resumed run
