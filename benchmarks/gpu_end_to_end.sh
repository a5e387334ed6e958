#!/usr/bin/env bash
# The prepared GPU check (run on a machine with one CUDA GPU, from the repo root):
# the real trainer on the GPU (NCCL, bf16, CUDA-event tracing, NVML, CUPTI), traced and untraced,
# then the run directory packed into $OUT/gpurun.tgz for `megascope analyze` elsewhere.
set -uo pipefail
OUT=${OUT:-/tmp/megascope-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # cupti-python where the image lacks it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
nvidia-smi -L
steps=${STEPS:-12}
rm -rf /tmp/gpurun /tmp/gpurun-off  # train refuses a directory that already holds a run
python3 -m megascope train --preset gpu --steps "$steps" --set trace.cupti=true --run-dir /tmp/gpurun 2>&1 | tee "$OUT/train_traced.log"
python3 -m megascope train --preset gpu --steps "$steps" --trace off --run-dir /tmp/gpurun-off 2>&1 | tee "$OUT/train_untraced.log"
tar czf "$OUT/gpurun.tgz" -C /tmp gpurun
ls -la /tmp/gpurun /tmp/gpurun/*
