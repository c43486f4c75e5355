#!/usr/bin/env bash
# The GPU check: one prepared command for one H100/H200 lent without network. Its parts run in
# order of importance, each under its own timeout and all within BUDGET (470 s: under 8 device
# minutes, so that a lease of ~15 minutes holds a start, the check and a rerun of what failed);
# each prints its figures as it ends, so a part cut short leaves the ones before it. A session runs it, after
# `bash benchmarks/gpu_site.sh` here (benchmarks/README.md), as
#   run(command="mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site &&
#       PYTHONPATH=/tmp/site PYTHON=python3 bash benchmarks/gpu_check.sh",
#       carry=[".gpu"], timeout_s=520)
# A rerun of some parts only: GPU_CHECK_PARTS="exact chaos" (names as below; env always runs).
#
#   env       the device, the versions, every package and ftjob module imported; ftjob's conf/
#             made the package ftjob.conf by an editable install where it is not (gpu_env.py)
#   input     ResNet-50 224 px bf16 channels_last (gpu_input.py): plain torch on batches already
#             on the GPU against ftjob decode_in=device from a JPEG folder (3 epochs: images/s,
#             the GPU memory's peak epoch by epoch) and from Parquet shards of it, decode_in=worker
#             and the seed benchmark's Ray Data loop; targets >= 0.9x plain torch and >= 2x the
#             Ray Data loop; the device decode of the same bytes twice
#   exact     the final weights after an injected failure, exact mode, decode_in=device, world 1,
#             against the unkilled run's, bit for bit (gpu_job.py --part exact)
#   chaos     the job with a worker killed every ~60 s: goodput (ETTR), its projection at a kill
#             every 480 s, a snapshot's blocking against a step at every step (<= 10 %) and the
#             interval every_n_steps=auto picks (<= 10 steps) (gpu_job.py --part chaos)
#   decoders  JPEG decoders side by side: PIL, torchvision on the CPU and nvJPEG, ftjob's device
#             path, TorchCodec where its wheel imports, DALI (too big to carry) (gpu_decoders.py)
# then only in the time the parts above left: the snapshot's copy off the GPU and the tier beside
# a training loop (gpu_snapshot_copy.py), exact mode at world 1 against 2 (gpu_exact.py; measured
# on 2026-12-04).
#
# PYTHON picks the interpreter (default python). What comes back from the device is $OUT (default
# /tmp/ftjob-gpu-check/out): check.log (everything printed), input.json, the exact and chaos runs'
# summary.json and the chaos run's timeline.png -- at most 8 files. Runs and data go to $WORK.
# GPU_CHECK_DRY=1 runs every part on the CPU with tiny sizes (--device cpu): the test of this
# script on a machine without a GPU. GPU_CHECK_LIST=1 prints each part's name, timeout and command
# (one per line: part or extra, its name, its timeout, its words, separated by tabs) and runs nothing: tests/test_gpu_check.py reads it.
# The exit status is 1 when a part failed or timed out, or a target printed FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ftjob-gpu-check/out}
WORK=${WORK:-/tmp/ftjob-gpu-check/work}
BUDGET=470
DRY=${GPU_CHECK_DRY:-0}
LIST=${GPU_CHECK_LIST:-0}
ONLY=${GPU_CHECK_PARTS:-}
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
LOG=$OUT/check.log
status=0
began=$SECONDS

run_part() { # run_part KIND NAME SECONDS COMMAND...: under a timeout the budget left allows
  local kind=$1 name=$2 limit=$3
  shift 3
  if [[ -n $ONLY && $name != env && " $ONLY " != *" $name "* ]]; then
    return 0
  fi
  if [[ $LIST == 1 ]]; then
    (IFS=$'\t' && echo "$kind	$name	$limit	$*")
    return 0
  fi
  local left=$((BUDGET - (SECONDS - began)))
  ((limit > left)) && limit=$left
  if ((limit < 15)); then
    echo "== $name: skipped, $left s of the check's $BUDGET s left" | tee -a "$LOG"
    return 0
  fi
  echo "== $name (at $((SECONDS - began)) s, $limit s at most): $*" | tee -a "$LOG"
  local start=$SECONDS
  # timeout signals the part's whole process group: Ray's processes end with the part.
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local said=""
  ((rc == 124)) && said=" (timed out)"
  echo "== $name: exit $rc in $((SECONDS - start)) s$said" | tee -a "$LOG"
  ((rc != 0)) && status=1
  return 0
}
part() { run_part part "$@"; }   # the check's parts: their timeouts sum to <= BUDGET
extra() { run_part extra "$@"; } # only in the time the parts left

if [[ $DRY == 1 ]]; then
  TINY=(--device cpu --batch 8 --image-size 32 --resize 36)
  DATA=(--train 48 --val 8)
  INPUT=("${TINY[@]}" "${DATA[@]}" --model small_cnn --epochs 2 --plain-steps 5)
  JOB=("${TINY[@]}" "${DATA[@]}" --model small_cnn)
  EXACT=(--exact-train 32)
  CHAOS=(--chaos-train 64 --epochs 60 --interval 15 --kills 1)
  DECODERS=(--device cpu --files 16 --batch 8 --repeats 1)
  SNAPSHOT=(--device cpu --part tier --model resnet18 --image-size 32 --batch 4 --steps 2 --rounds 1)
  EXACT_WORLDS=(--device cpu --jobs small_cnn)
else
  DATA=(--train 8192 --val 256)
  INPUT=("${DATA[@]}" --epochs 3 --other-epochs 1 --batch 128 --plain-steps 100)
  JOB=("${DATA[@]}" --batch 128)
  EXACT=(--exact-train 2048)
  CHAOS=(--chaos-train 32768 --seconds 75 --interval 50 --kills 2 --project 480)
  DECODERS=(--files 512 --batch 128 --repeats 2)
  SNAPSHOT=(--part all --repeats 5 --steps 8 --rounds 2)
  EXACT_WORLDS=(--jobs small_cnn,resnet18)
fi
# The chaos run is sized by the rate the input part measured for ftjob (a guess without it).
rate() {
  "$PY" -c 'import json, sys
try:
    print(round(json.load(open(sys.argv[1]))["rates"]["ftjob device folder"]))
except Exception:
    print(1000)' "$OUT/input.json" 2>/dev/null || echo 1000
}
if [[ $LIST != 1 ]]; then
  mkdir -p "$OUT" "$WORK"
  : >"$LOG"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm \
      --format=csv 2>&1 | tee -a "$LOG"
  fi
fi

part env 20 "$PY" benchmarks/gpu_env.py --install
part input 175 "$PY" benchmarks/gpu_input.py "${INPUT[@]}" --root "$WORK/data" \
  --results "$OUT/input.json"
part exact 90 "$PY" benchmarks/gpu_job.py --part exact "${JOB[@]}" "${EXACT[@]}" \
  --root "$WORK/data" --out "$OUT"
part chaos 160 "$PY" benchmarks/gpu_job.py --part chaos "${JOB[@]}" "${CHAOS[@]}" \
  --rate "$([[ $LIST == 1 ]] && echo 1000 || rate)" --root "$WORK/data" --out "$OUT"
part decoders 25 "$PY" benchmarks/gpu_decoders.py "${DECODERS[@]}" --root "$WORK/decoders"
extra snapshot 120 "$PY" benchmarks/gpu_snapshot_copy.py "${SNAPSHOT[@]}"
extra exact_worlds 150 "$PY" benchmarks/gpu_exact.py \
  "${EXACT_WORLDS[@]}"

if [[ $LIST != 1 ]]; then
  targets=$(grep -E "PASS|FAIL" "$LOG" | grep -v "^==")
  echo "== the check's targets, at $((SECONDS - began)) s:" | tee -a "$LOG"
  echo "${targets:-none reached}" | tee -a "$LOG"
  grep -q FAIL <<<"$targets" && status=1
fi
exit $status
