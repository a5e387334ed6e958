#!/usr/bin/env bash
# The GPU round (issues 19, 29), one command on a machine with one CUDA GPU, from the repo root:
#   bash benchmarks/gpu_round.sh     # tables in $OUT/summary.md, logs and run directories in $OUT/runs.tgz
# A lent device gives one call of at most 600 s, so the parts run in priority order under one deadline
# (BUDGET seconds from the start, default 540): each part gets the smaller of its own limit and the time
# left, a part that would get under 30 s is skipped, and a hang stops only its part:
#   1. MFU: `megascope train --preset gpu-2b` traced (CUDA events + NVML);
#   2-3. the changes that may raise MFU, each alone: micro-batches of 8, then also 64 sequences a step;
#   4-5. CUPTI kernel activity on the same training run, on every step, then on every 4th;
#   6. straggler: two ranks sharing the GPU (gloo), rank 1's kernels slowed by extra matmuls;
#   7. the GPU tests (the gpu marker);
#   8. benchmarks/gpu_report.py over the runs (MFU from the analyzer and the formula, the step-time
#      breakdown, NVML clock and power, CUPTI kernels per step, findings);
#   9. with what is left: the tracer's cost (tracing off / default interleaved in one process), eager
#      blocks, SDPA's backends, window attention.
# Measured on an H100 (2026-11-27, round 3): mfu 93 s, tracer cost ~225 s (24 rounds; ~135 s of it before
# the first round: start, compilation, warm-up), straggler 35 s, eager 76 s. On an H200 (2026-11-28, round
# 4): mfu 92 s, mfu_mb8 101, mfu_mb8_64 89, the CUPTI runs 99 and 88 (Inductor's cache warm), straggler 31,
# the GPU tests 25 s alone: parts 1-7 fill the 570 s budget; the run directories come back in runs.tgz
# and gpu_report.py gives the tables on any machine.
# Few files come back from a lent device (8 at most): everything goes into summary.md and runs.tgz.
# DRY_RUN=1 runs the same plumbing on the CPU with the tiny preset (a check of this script, not a result).
set -uo pipefail
OUT=${OUT:-/tmp/megascope-gpu}
RUNS=${RUNS:-/tmp/megascope-gpu-runs}
LOGS=$RUNS/logs
SUMMARY=$OUT/summary.md
mkdir -p "$OUT" && rm -rf "$RUNS" && mkdir -p "$LOGS" && : >"$SUMMARY"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  PRESET=(--preset tiny --device cpu); STEPS=6; SKIP=2; ROUNDS=3; EAGER_STEPS=6; DEVICE=cpu
  BIG_STEPS=6; BIG_BATCH=32; MB8=8
  STRAGGLER=(--preset tiny --device cpu --set train.global_batch=16); STRAGGLER_STEPS=24
else
  PRESET=(--preset gpu-2b); STEPS=10; SKIP=4; ROUNDS=24; EAGER_STEPS=8; DEVICE=cuda
  BIG_STEPS=8; BIG_BATCH=64; MB8=8  # 3.4 s steps: 8 of them cost what 16 do at 32 sequences
  STRAGGLER=(--preset gpu --set model.n_layers=8 --set train.global_batch=16); STRAGGLER_STEPS=30
  if ls .whl/*.whl >/dev/null 2>&1; then  # duckdb, cupti-python where the image lacks them
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || cat "$LOGS/install.log"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv | tee -a "$SUMMARY"
  $PY -m pip list 2>/dev/null | grep -i -e cupti -e duckdb -e triton | tee -a "$SUMMARY"
fi
$PY -c "import torch, duckdb; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'duckdb', duckdb.__version__)" \
  | tee -a "$SUMMARY"

BUDGET=${BUDGET:-540}  # seconds for the whole script: the device's per-call limit is 600
part() {  # part NAME SECONDS CMD...: run under min(SECONDS, time left), log to $LOGS/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 10))  # 10 s for the last packing
  if [ $left -lt 30 ]; then
    echo "=== $name: skipped, ${left}s left of the ${BUDGET}s budget" | tee -a "$SUMMARY"
    return 124
  fi
  [ $limit -le $left ] || limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
  # SIGTERM first (the benchmarks dump their threads' stacks on it: a hang says where), SIGKILL 10 s later
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  [ $rc = 0 ] || tail -n 30 "$LOGS/$name.log" | tee -a "$SUMMARY"
  tar czf "$OUT/runs.tgz" -C "$RUNS" . 2>/dev/null  # what is done so far comes back even if later parts hang
  return $rc
}
# the log's tail without Python's warning lines (not pytest's "N passed, M warnings" line: round 4 lost it)
show() { grep -v -e 'Warning:' -e 'warnings.warn(' "$LOGS/$1.log" | tail -n "${2:-40}" | tee -a "$SUMMARY"; }
TRAIN=($PY -m megascope train)

# 1. MFU, traced with the default tracing; a smaller micro-batch only if the first does not fit.
MFU_SET=()
if ! part mfu 200 "${TRAIN[@]}" "${PRESET[@]}" --steps $STEPS --run-dir "$RUNS/mfu" \
    && grep -qi "out of memory" "$LOGS/mfu.log"; then
  rm -rf "$RUNS/mfu"
  MFU_SET=(--set train.micro_batch=2)
  part mfu-mb2 150 "${TRAIN[@]}" "${PRESET[@]}" --steps $STEPS "${MFU_SET[@]}" --run-dir "$RUNS/mfu"
fi

# 2-3. Each change that may raise MFU alone, the same preset and tracing otherwise (round 4): micro-batches
#   of 8 (larger GEMMs; fits a 141 GB H200, not an 80 GB H100), then 8 with 64 sequences a step (the
#   optimizer paid once per 8 micro-batches of 8).
VARIANTS=(mfu)
variant() {  # variant NAME STEPS --set ...: one more traced training run
  local name=$1 steps=$2; shift 2
  part "$name" 150 "${TRAIN[@]}" "${PRESET[@]}" --steps "$steps" "${MFU_SET[@]}" "$@" --run-dir "$RUNS/$name" \
    && VARIANTS+=("$name")
}
variant mfu_mb8 $STEPS --set train.micro_batch=$MB8
variant mfu_mb8_64 $BIG_STEPS --set train.micro_batch=$MB8 --set train.global_batch=$BIG_BATCH

# 4-5. CUPTI kernel activity on the same run, its cost against the baseline's step time (kernel records
#   per step in the device table divide it): every step, then every 4th (steps 4 and 8 of the measured
#   4-9: is the cost per recorded step? round 4 found 64 MiB buffers no cheaper than 8).
variant mfu_cupti $STEPS --set trace.cupti=true
variant mfu_cupti_every4 $STEPS --set trace.cupti=true --set trace.cupti_every=4

# 6. A straggler on a real device: two ranks on the one GPU (gloo), rank 1 slowed 1.5x from step 10.
part straggler 120 "${TRAIN[@]}" "${STRAGGLER[@]}" --dp 2 --set train.backend=gloo --set parallel.zero=false \
  --steps $STRAGGLER_STEPS --inject straggler:rank=1,slowdown=1.5,from=10 --run-dir "$RUNS/straggler"

# 7. The GPU tests (the gpu marker: kernels, CUDA-event tracing, CUPTI, the device delay).
if [ "$DEVICE" = cuda ]; then
  part gpu_tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/test_kernels.py \
    tests/test_tracer_gpu.py tests/test_gpu_delay.py
  show gpu_tests 25
fi

# 8. The tables (the run directories come back in runs.tgz too: gpu_report.py reads them anywhere).
part report_variants 90 $PY benchmarks/gpu_report.py "${VARIANTS[@]/#/$RUNS/}" --skip $SKIP \
  && show report_variants 60
part straggler_report 40 $PY benchmarks/gpu_report.py "$RUNS/straggler" --skip $SKIP && show straggler_report

# 9. What is left of the budget: the tracer's cost (tracing off / default interleaved in one process),
#    eager blocks, SDPA's backends, window attention.
part tracer_cost 260 $PY benchmarks/tracer_overhead.py "${PRESET[@]}" --dp 1 --pp 1 --device $DEVICE \
  --rounds $ROUNDS --steps 1 --warmup 2 --progress "${MFU_SET[@]}"
show tracer_cost 30
part mfu_eager 120 "${TRAIN[@]}" "${PRESET[@]}" --steps $EAGER_STEPS --set train.compile=false "${MFU_SET[@]}" \
  --run-dir "$RUNS/mfu_eager"
part report_eager 40 $PY benchmarks/gpu_report.py "$RUNS/mfu" "$RUNS/mfu_eager" --skip $SKIP && show report_eager
[ "$DEVICE" = cuda ] && part sdpa 60 $PY benchmarks/sdpa_backends.py && show sdpa
[ "$DEVICE" = cuda ] && part attention 60 $PY benchmarks/attention_window.py && show attention
echo "=== done in $SECONDS s of the ${BUDGET}s budget" | tee -a "$SUMMARY"
tar czf "$OUT/runs.tgz" -C "$RUNS" . 2>/dev/null
