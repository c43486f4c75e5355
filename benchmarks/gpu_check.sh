#!/usr/bin/env bash
# The GPU check: one prepared run that fits in 8 minutes on one H200 and needs no network.
#   1. ResNet-50 on synthetic 224x224 images: plain torch (compute-bound ceiling) vs ftjob with
#      1 GPU worker (bf16, channels_last, pinned memory, Ray Data decoding), images/s + ratio;
#   2. a short GPU run with a failure forced at step 50: Ray Train restarts the worker, ftjob
#      restores the step-40 checkpoint on the GPU, and summary.json records the recovery.
# Needs a Python with ftjob and its dependencies (torch with CUDA); PYTHON=... picks it.
# Figures land in $OUT (default /tmp/ftjob-gpu-check); record them in benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ftjob-gpu-check}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

timeout 300 "$PY" benchmarks/gpu_throughput.py --repeats 2 --steps 150 --batch 128 | tee "$OUT/throughput.txt"

timeout 200 "$PY" -m ftjob model=resnet50 dataset=synthetic dataset.image_size=224 \
  dataset.num_classes=100 dataset.num_samples=6400 dataset.num_val_samples=256 \
  trainer.use_gpu=true trainer.num_workers=1 trainer.resources_per_worker.CPU=4 \
  trainer.batch_size=64 trainer.epochs=1 trainer.optimizer=sgd trainer.lr=0.05 \
  trainer.precision=bf16 trainer.channels_last=true trainer.prefetch_batches=4 \
  trainer.checkpoint_every_n_steps=20 trainer.log_every_n_steps=20 \
  'chaos.fail_at_steps=[50]' failure.max_failures=1 hydra.run.dir="$OUT/recovery" \
  | tee "$OUT/recovery.txt"

"$PY" - "$OUT/recovery/summary.json" <<'PY' | tee "$OUT/recovery_summary.txt"
import json, sys
s = json.load(open(sys.argv[1]))
m = s["metrics"]
print(f"status {s['status']}, steps {int(m['train/steps_completed'])}, {m['train/global_throughput']:.0f} img/s")
for f in s["failures"]:
    print(
        f"failure {f['attempt']} ({f['kind']}): detect {f['detection_s']:.1f}s, restart {f['restart_s']:.1f}s, "
        f"download {f['download_s']:.2f}s, load {f['load_s']:.2f}s, skip {f['skip_s']:.3f}s, "
        f"time-to-recover {f['time_to_recover_s']:.1f}s, restored step {f['restored_step']}, lost {f['lost_steps']} steps"
    )
assert s["status"] == "succeeded" and s["failures"] and s["failures"][0]["recovered"], "GPU recovery failed"
PY
