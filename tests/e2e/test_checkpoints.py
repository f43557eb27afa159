"""The supervisor resumes a real run from its newest intact checkpoint and says why it passed newer ones over."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from tests.checkpoint_files import CRAFTED_REFUSAL, load_saved, write_crafted
from tests.e2e.conftest import (
    REFERENCE_WORKER,
    checkpoints_of,
    journal,
    run_supervisor,
    write_config,
)

pytestmark = pytest.mark.timeout(240)


def test_damaged_and_crafted_checkpoints_are_passed_over_with_reasons(tmp_path: Path, reference_run: Path) -> None:
    """In the checkpoints of a finished run (the reference's, health-tagged): a byte flipped in 60, 50 truncated, a
    completion record of 40 dropped, and rank 1's 30 swapped for a crafted pickle with a matching record, as an
    attacker would. The supervisor's own checks pass over 60, 50 and 40; rank 1 refuses 30 without running it
    (exit 66); the relaunch resumes from 20 and finishes, junk in the folder left alone."""
    run_dir = checkpoints_of(reference_run, tmp_path / "run")
    config = write_config(tmp_path / "job.yaml", worker=REFERENCE_WORKER)
    health = json.loads((run_dir / "health_ckpts.json").read_text())
    assert [(h["step"], h["is_health"], h["ckpt_name"]) for h in health] == [
        (s, 0, f"demo_rank_0-{s}.ckpt") for s in range(10, 61, 10)
    ]

    ckpt = run_dir / "checkpoint"
    flipped = bytearray((ckpt / "rank_1" / "demo_rank_1-60.ckpt").read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    (ckpt / "rank_1" / "demo_rank_1-60.ckpt").write_bytes(bytes(flipped))
    truncated = ckpt / "rank_0" / "demo_rank_0-50.ckpt"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    (ckpt / "rank_1" / "demo_rank_1-40.json").unlink()
    crafted, marker = ckpt / "rank_1" / "demo_rank_1-30.ckpt", tmp_path / "marker"
    write_crafted(crafted, marker)
    data, record = crafted.read_bytes(), crafted.with_suffix(".json")
    record.write_text(
        json.dumps({**json.loads(record.read_text()), "size": len(data), "crc32": f"{zlib.crc32(data):08x}"})
    )  # what the supervisor checks
    (ckpt / "rank_0" / "stray.txt").write_text("junk a person left here")

    done = run_supervisor(config, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    events, status = journal(run_dir), done.status()
    refused = [e for e in events if e["event"] == "checkpoint_refused"]
    assert [(e["level"], e["rank"], e["attempt"], e["step"], e["path"], e["error"]) for e in refused] == [
        ("error", 1, 0, 30, str(crafted), CRAFTED_REFUSAL)
    ]
    assert [e["resume_step"] for e in events if e["event"] == "ranks_launched"] == [30, 20]
    assert (status["state"], status["restarts"], status["resumed_from"]) == ("finished", 1, {"step": 20})
    logged = [(e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_passed_over"]
    assert [step for step, _ in logged] == [60, 50, 40, 60, 50, 40, 30]  # again at the relaunch, and 30 with them
    reasons = dict(logged)
    assert reasons[60] == "corrupted on rank 1: checksum differs from the one written"
    assert reasons[50].startswith("truncated on rank 0: 1000 bytes, ")
    assert reasons[40] == "incomplete: rank 1 has no completion record"
    assert reasons[30] == f"refused by rank 1: {CRAFTED_REFUSAL}"
    assert status["passed_over"] == [{"step": step, "reason": reason} for step, reason in logged[3:]]
    assert status["last_checkpoint"] == {"step": 60}  # rewritten whole by the resumed run
    assert load_saved(crafted)["step"] == 30  # saved again, for real
    assert (ckpt / "rank_0" / "stray.txt").exists()  # junk is ignored, never deleted
    reported = [e["paths"] for e in events if e["event"] == "checkpoint_dir_junk"]
    assert reported[0] == [str(ckpt / "rank_0" / "stray.txt")]


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
    assert broken.status()["reason"] == (
        "could not launch ranks: the checkpoint named by worker.resume_training "
        f"(step 20) is not usable: truncated on rank 1: 100 bytes, {written} written"
    )

    refused = run_supervisor(
        write_config(tmp_path / "d.yaml", worker={**worker, "no_usable_checkpoint": "refuse"}), run_dir
    )
    assert refused.returncode == 1
    assert refused.status()["reason"].startswith(
        "could not launch ranks: no usable checkpoint (newest, step 60: truncated on rank 1: 100 bytes"
    )
    assert refused.status()["reason"].endswith("refusing to start from scratch (worker.no_usable_checkpoint: refuse)")
