#!/usr/bin/env bash
# The GPU check: one short, prepared run (under 5 minutes) on a machine with NVIDIA GPUs, of what the CPU suite can
# only cover in logic. The FSDP2 example (examples/fsdp_train.py --device cuda: NCCL, bf16 parameters, sharded
# checkpoints written in the background from pinned staging buffers) under the supervisor, once uninterrupted, once
# with a rank SIGKILLed inside a background write and then a hang, and once through the hang classes on 2 ranks (a
# device stall in a collective, a desync of sizes, a host-side hang); it prints when each was declared, the culprit
# named with its class and evidence, where the run resumed, the stall per save, and whether each final model equals
# the uninterrupted run's bit for bit. 2 ranks where 2 GPUs are there, else 1 for the first two runs; the blame run
# puts 2 ranks on one GPU when there is only one (NCCL may refuse: then it says so).
#
# Run from the repository root:  bench/gpu_check.sh [OUT_DIR]
# Packages the machine lacks (watchdog, structlog) can travel as wheels in .whl/ (installed to /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
work=/tmp/gpu_check_runs
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
py=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
$py -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" || exit 1
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
nproc=$(( gpus >= 2 ? 2 : 1 ))
steps=60
settings=(--set "nproc_per_node=$nproc" --set "args=[\"--steps\", \"$steps\", \"--device\", \"cuda\"]"
          --set worker.save_checkpoint_steps=10 --set standby.enabled=false --set hang.calibration.enabled=false
          --set 'hang.phase_timeouts_s={"startup": 300, "train": 5, "save": 60}')
run() {  # RUN_DIR [ENV=VALUE ...]: the FSDP example under the supervisor, its output kept in OUT_DIR
  local dir=$1; shift
  env "$@" $py -m supervisor run examples/fsdp.yaml --run-dir "$work/$dir" "${settings[@]}" \
    >"$out/$dir.log" 2>&1
  echo "$dir: exit $? ($(tail -n 1 "$out/$dir.log"))"
}
echo "== $nproc rank(s) on $gpus GPU(s), $steps steps, a sharded checkpoint every 10 =="
run reference
run faulted TRAINWARDEN_FAULTS_ONCE=1 "TRAINWARDEN_FAULTS=0:sigkill_in_async_write@30,0:hang@45"
dirs=(reference faulted)
if [ "$nproc" = 1 ]; then  # the blame run needs peers
  settings+=(--set "nproc_per_node=2"); run reference2; dirs+=(reference2)
fi
settings+=(--set "nproc_per_node=2")
run blamed TRAINWARDEN_FAULTS_ONCE=1 "TRAINWARDEN_FAULTS=1:stall_in_collective@15,1:collective_sizes@25,0:hang@35"
dirs+=(blamed)
for dir in "${dirs[@]}"; do
  $py -m supervisor export "$work/$dir" -o "$work/$dir.pt" >>"$out/$dir.log" 2>&1 || echo "$dir: export failed"
done
$py - "$work" <<'EOF'
import json, statistics, sys
from datetime import datetime
from pathlib import Path
import torch

work = Path(sys.argv[1])
def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
def at(event):
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()
journal = events(work / "faulted" / "supervisor" / "events.jsonl")
ranks = events(work / "faulted" / "ranks" / "rank_0" / "events.jsonl")
fired = {e["kind"]: at(e) for e in ranks if e["event"] == "fault_injected"}
launches = [e for e in journal if e["event"] == "ranks_launched"]
for kind, word in (("sigkill_in_async_write", "rank_crashed"), ("hang", "hang_detected")):
    declared = next((at(e) for e in journal if e["event"] == word and kind in fired and at(e) >= fired[kind]), None)
    after = next((e for e in launches if declared and at(e) >= declared), None)
    print(f"{kind}: declared {'never' if declared is None else f'after {declared - fired[kind]:.2f} s'} "
          f"({word}); relaunched from step {after and after['resume_step']}")
reference = events(work / "reference" / "ranks" / "rank_0" / "events.jsonl")
stalls = [e["stall_s"] for e in reference if e["event"] == "checkpoint_staged"]
written = [e["duration_s"] for e in reference if e["event"] == "checkpoint_saved"]
if stalls and written:
    print(f"stall per save: median {statistics.median(stalls):.4f} s, max {max(stalls):.4f} s; written after median "
          f"{statistics.median(written):.4f} s ({len(stalls)} saves)")
blamed = events(work / "blamed" / "supervisor" / "events.jsonl")
fired = {}
for rank in (0, 1):
    for e in events(work / "blamed" / "ranks" / f"rank_{rank}" / "events.jsonl"):
        if e["event"] == "fault_injected":
            fired[e["attempt"]] = (e["kind"], rank, at(e))
for attempt, (kind, rank, when) in sorted(fired.items()):
    mine = [e for e in blamed if e.get("attempt") == attempt]
    declared = next((e for e in mine if e["event"] in ("hang_suspected", "rank_crashed")), None)
    verdict = next((e for e in mine if e["event"] in ("hang_detected", "culprit_named")), None)
    said = "nothing declared" if declared is None else f"declared after {at(declared) - when:.2f} s"
    if verdict is not None:
        said += (f", culprit rank {verdict['rank']} ({'right' if verdict['rank'] == rank else 'WRONG'}), class "
                 f"{verdict.get('class')}, named by {verdict.get('named_by')}: {verdict.get('evidence')}")
    print(f"{kind} on rank {rank}: {said}")
def same_model(ours, reference):
    try:
        a, b = (torch.load(work / f"{d}.pt", weights_only=True) for d in (reference, ours))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"{ours}: final model bitwise equal to the uninterrupted run's: {'yes' if same else 'NO'} "
              f"({len(a)} tensors)")
    except Exception as exc:  # noqa: BLE001 - say it, do not hide the rest of the report
        print(f"{ours}: final model comparison failed: {exc}")
same_model("faulted", "reference")
same_model("blamed", "reference2" if (work / "reference2.pt").exists() else "reference")
EOF
cp "$work"/faulted/supervisor/events.jsonl "$out/faulted_journal.jsonl" 2>/dev/null
cp "$work"/blamed/supervisor/events.jsonl "$out/blamed_journal.jsonl" 2>/dev/null
exit 0
