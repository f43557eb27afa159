#!/usr/bin/env bash
# The GPU benchmark: one prepared run (under 5 minutes) on a machine with an NVIDIA GPU, of what the CPU suite can
# only cover in logic, as a table for docs/benchmarks.md ("On a GPU"). bench/gpu_check.py says what it measures:
# crash -> first step for trainwarden warm, trainwarden cold and torchrun on the FSDP example (~150M parameters, its
# parts, the final model against an uninterrupted run's), the stall per save synchronous and in the background
# (~330M parameters: first save, steady, a save due while the previous one is written), and what the preflight says
# for 2 ranks on one GPU.
#
# Run from the repository root:  bench/gpu_check.sh [OUT_DIR]     (the table: stdout and OUT_DIR/table.md)
# Packages the machine lacks (watchdog, structlog, ...) can travel as wheels in .whl/ (installed to /tmp/site first).
# On a machine without a GPU, `bench/gpu_check.sh OUT --cpu` is a dry run with a tiny model (the script, not figures).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
shift $(( $# > 0 ? 1 : 0 ))
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi -L
exec $py bench/gpu_check.py --out "$out" "$@"
