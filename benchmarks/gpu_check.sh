#!/usr/bin/env bash
# The GPU check: one prepared run that fits in ~6 minutes on one H200 and needs no network.
#   1. ResNet-50 on synthetic 224x224 images: plain torch (compute-bound ceiling) vs ftjob with
#      1 GPU worker (bf16, channels_last, pinned memory, Ray Data decoding), images/s + ratio;
#   2. a short GPU run with a failure forced at step 50, twice: the memory tier off (Ray Train
#      restarts the worker, ftjob restores the step-40 checkpoint from storage) and on (a snapshot
#      after every step; the restore comes from memory): the recovery's parts, and the training
#      thread's blocking time per snapshot of a ResNet-50 state on the GPU, and that copy
#      alone (benchmarks/gpu_snapshot_copy.py);
#   3. JPEG decoding for a GPU worker: the same ResNet-18 job on a JPEG tree, decoded in the
#      worker by its pool (the CPUs it reserves but one) and in Ray Data, images/s + ratio;
#   4. exact mode on the GPU (benchmarks/gpu_exact.py): world 1 against world 2 bit for bit.
# Needs a Python with ftjob and its dependencies (torch with CUDA); PYTHON=... picks it.
# Each part runs under its own timeout and the check goes on after a failed part; the exit
# status is that of the worst part. Figures land in $OUT (default /tmp/ftjob-gpu-check);
# record them in benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ftjob-gpu-check}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
status=0
part() { # part NAME SECONDS COMMAND...: run under a timeout, its output into $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name" >&2
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - start)) s" >&2
  ((rc != 0)) && status=$rc
  return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

part throughput 150 "$PY" benchmarks/gpu_throughput.py --repeats 1 --steps 100 --batch 128

# The recovery job: ResNet-50, 100 steps of 64, checkpoints every 20, a failure at step 50.
RECOVERY=(model=resnet50 dataset=synthetic dataset.image_size=224
  dataset.num_classes=100 dataset.num_samples=6400 dataset.num_val_samples=256
  trainer.use_gpu=true trainer.num_workers=1 trainer.resources_per_worker.CPU=4
  trainer.batch_size=64 trainer.epochs=1 optimizer=sgd trainer.lr=0.05
  trainer.precision=bf16 trainer.channels_last=true trainer.prefetch_batches=4
  trainer.checkpoint_every_n_steps=20 trainer.log_every_n_steps=20
  'chaos.fail_at_steps=[50]' failure.max_failures=1)
part recovery_tier_off 150 "$PY" -m ftjob "${RECOVERY[@]}" hydra.run.dir="$OUT/tier_off"
part recovery_tier_on 150 "$PY" -m ftjob "${RECOVERY[@]}" checkpoint.memory.enabled=true \
  checkpoint.memory.every_n_steps=1 hydra.run.dir="$OUT/tier_on"

summarise() { # the recovery and the snapshots of one run's summary.json
  "$PY" - "$1" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m = s["metrics"]
print(f"{sys.argv[1]}: status {s['status']}, steps {int(m['train/steps_completed'])}, {m['train/global_throughput']:.0f} img/s")
for f in s["failures"]:
    print(
        f"  failure {f['attempt']} ({f['kind']}): detect {f['detection_s']:.1f}s, restart {f['restart_s']:.1f}s, "
        f"download {f['download_s']:.2f}s, load {f['load_s']:.2f}s, skip {f['skip_s']:.3f}s, "
        f"time-to-recover {f['time_to_recover_s']:.1f}s, restored step {f['restored_step']} "
        f"from {f.get('tier')} ({f.get('holder')}), lost {f['lost_steps']} steps"
    )
snapshots = m.get("checkpoint/memory_snapshots", 0)
if snapshots:
    print(f"  memory snapshots {int(snapshots)}, training thread blocked per snapshot "
          f"{m['checkpoint/memory_snapshot_time']}, restores from memory {int(m['checkpoint/memory_restores'])}")
assert s["status"] == "succeeded" and s["failures"] and s["failures"][0]["recovered"], "GPU recovery failed"
PY
}
for run in tier_off tier_on; do
  if [[ -f "$OUT/$run/summary.json" ]]; then
    summarise "$OUT/$run/summary.json" 2>&1 | tee "$OUT/summary_$run.txt" || status=1
  fi
done
# The snapshot's copy off the GPU alone: per tensor, gathered, into page-locked memory.
part snapshot_copy 90 "$PY" benchmarks/gpu_snapshot_copy.py

# A GPU worker's JPEG decoding: its own pool (CPU=8: 7 threads) against Ray Data's tasks.
JPEGS=$(mktemp -d)
trap 'rm -rf "$JPEGS"' EXIT
"$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from throughput import write_jpeg_tree; write_jpeg_tree('$JPEGS')"
DECODE=(model=resnet18 dataset=imagefolder dataset.path="$JPEGS" dataset.image_size=160
  dataset.resize_size=176 trainer.use_gpu=true trainer.num_workers=1
  trainer.resources_per_worker.CPU=8 trainer.batch_size=128 trainer.epochs=3
  trainer.precision=bf16 trainer.channels_last=true trainer.log_every_n_steps=16)
for where in worker ray; do
  part "decode_$where" 120 "$PY" -m ftjob "${DECODE[@]}" trainer.decode_in=$where \
    hydra.run.dir="$OUT/decode_$where"
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/decode.txt"
import json, sys
rate = {}
for where in ("worker", "ray"):
    try:
        s = json.load(open(f"{sys.argv[1]}/decode_{where}/summary.json"))
        rate[where] = s["metrics"]["train/global_throughput"]
        print(f"decode_in={where}: {s['status']}, {rate[where]:.0f} images/s")
    except (OSError, KeyError, ValueError) as e:
        print(f"decode_in={where}: no result ({e!r})")
if len(rate) == 2:
    print(f"worker pool/ray data = {rate['worker'] / rate['ray']:.3f}")
PY

part exact 150 "$PY" benchmarks/gpu_exact.py
exit $status
