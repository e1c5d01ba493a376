#!/bin/bash
# Issue 23's GPU step checks as one device call: the 8B-shaped step in the precision a user's config
# gets (auto: bf16 autocast), the same without the loop checks, then a profile of the latter.
#   bench/offline/gpu_checks.sh [OUT_DIR] [bench.train_gpu options]
# Each check has a time limit of its own so one that hangs leaves the others their time; the blocks the
# benchmark appends to bench/RESULTS.md there, its logs and a summary land in OUT_DIR (default
# $OUT, the device tool's folder that comes back). Before the lease, here: bench/offline/wheels.sh;
# then, as the device call (carry bench/offline/wheels; under 10 minutes on an H100 or H200):
#   bench/offline/gpu_checks.sh
# Extra arguments go to every bench.train_gpu call: `bench/offline/gpu_checks.sh /tmp/g --arch tiny
# --device cpu --steps 2` runs the script through on a CPU.
set -u
out=${OUT:-/tmp/rlfleet-gpu-checks}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out=$1; shift; fi  # a first argument not an option: OUT_DIR
here=$(cd "$(dirname "$0")" && pwd)
results=$here/../RESULTS.md
mkdir -p "$out"
before=$(wc -c < "$results")
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "${PYTHON:-python3}" -c 'import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, transformers.__version__, peft.__version__)' 2>&1
} > "$out/device.txt"

check() {  # check NAME SECONDS MODULE ARGS...: one bench run, its log in OUT_DIR, its outcome in the summary
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 "$secs" "$here/run.sh" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (its ${secs} s ran out)")" | tee -a "$out/summary.txt"
}

check train_gpu 200 bench.train_gpu --steps 4 "$@"
check train_gpu_unlikelihood0 150 bench.train_gpu --unlikelihood 0 --steps 4 "$@"
check train_gpu_profile 150 bench.train_gpu --unlikelihood 0 --steps 2 --profile --no-record "$@"

tail -c +"$((before + 1))" "$results" > "$out/results-appended.md"
echo "appended to bench/RESULTS.md there: $(wc -l < "$out/results-appended.md") lines (results-appended.md)" | tee -a "$out/summary.txt"
