#!/usr/bin/env bash
# The GPU check: one prepared run that fits in ~8 minutes on one H100/H200 and needs no network.
#   1. ResNet-50 on synthetic 224x224 images: plain torch (compute-bound ceiling) vs ftjob with
#      1 GPU worker (bf16, channels_last, the images made on the GPU: decode_in=device),
#      images/s + ratio;
#   2. a short GPU run with a failure forced at step 50, twice: the memory tier off (Ray Train
#      restarts the worker, ftjob restores the step-40 checkpoint from storage) and on (a snapshot
#      after every step; the restore comes from memory): the recovery's parts, and the training
#      thread's blocking time per snapshot of a ResNet-50 state on the GPU; that copy alone,
#      and the tier in a training loop -- before and after its copy left the step, what a
#      snapshot after every step takes from a step, and what every_n_steps=auto picks
#      (benchmarks/gpu_snapshot_copy.py);
#   3. JPEG decoders side by side on ImageNet-like files (benchmarks/gpu_decoders.py): PIL,
#      torchvision on the CPU and nvJPEG, ftjob's device path, TorchCodec and DALI where
#      installed; the same bytes -> the same pixels on the GPU;
#   4. the GPU input path in whole jobs (benchmarks/gpu_input.py): ResNet-50 at 224 px, plain
#      torch against ftjob decode_in=device from a JPEG folder and from Parquet shards of it,
#      ftjob decode_in=worker, and the hand-written Ray Train loop with Ray Data decoding;
#   5. exact mode on the GPU (benchmarks/gpu_exact.py): world 1 against world 2 bit for bit.
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
    lost, wait = (1e3 * m.get(k, 0) / snapshots for k in ("checkpoint/memory_snapshot_time", "checkpoint/memory_snapshot_wait"))
    print(f"  memory snapshots {int(snapshots)}, training thread lost per snapshot {lost:.2f} ms "
          f"(of it waiting before optimizer steps {wait:.2f} ms), restores from memory {int(m['checkpoint/memory_restores'])}")
assert s["status"] == "succeeded" and s["failures"] and s["failures"][0]["recovered"], "GPU recovery failed"
PY
}
for run in tier_off tier_on; do
  if [[ -f "$OUT/$run/summary.json" ]]; then
    summarise "$OUT/$run/summary.json" 2>&1 | tee "$OUT/summary_$run.txt" || status=1
  fi
done
# The snapshot's copy off the GPU alone (per tensor, gathered, into page-locked memory), then
# the tier beside ResNet-50's steps: before/after, blocking per snapshot against a step.
part snapshot_copy 180 "$PY" benchmarks/gpu_snapshot_copy.py

# JPEG decoders alone, then the input path in whole jobs (their files made in temporary folders).
part decoders 120 "$PY" benchmarks/gpu_decoders.py --files 512 --batch 128 --repeats 3
part input 330 "$PY" benchmarks/gpu_input.py --train 8192 --val 256 --epochs 2 --batch 128

part exact 150 "$PY" benchmarks/gpu_exact.py
exit $status
