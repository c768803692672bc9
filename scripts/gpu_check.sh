#!/usr/bin/env bash
# Run on the GPU machine: GPU tests (CUDA vs twin), NCCL tests over 2 ranks, compute-sanitizer memcheck on
# every kernel at small shapes, and optional benchmarks. Logs go to $OUT (or ./.out).
#   bash scripts/gpu_check.sh [tests] [mpi] [sanitize] [bench] [host] [draft]
#   host: the host path of a propose (B = 1) and of a serving step (B = 64, catch-up included; the wide calls'
#   bookkeeping compiled and in NumPy), V3, real launches; draft: bench_draft for every family at B = 1..64, k = 1, 3, the plot in $OUT (several minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
what=${*:-tests mpi sanitize}
summ="$OUT/summary.txt"; : >"$summ"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$summ" 2>&1
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" >>"$summ" 2>&1
if [[ " $what " == *" tests "* ]]; then
  "$PY" -m pytest -q -rfEs --timeout=900 -p no:cacheprovider tests --ignore=tests/mpi -m gpu ${FILTER:-} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40
  echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")" >>"$summ"
fi
if [[ " $what " == *" mpi "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 600 mpirun --allow-run-as-root -x NCCL_NVLS_ENABLE -x PYTHONPATH -n 2 "$PY" -m pytest -q --color=no \
    -p no:cacheprovider --timeout=300 --timeout-method=thread tests/mpi 2>&1 | tee "$OUT/mpi_tests.log" | tail -15
  echo "mpi tests: $(tail -1 "$OUT/mpi_tests.log")" >>"$summ"
fi
if [[ " $what " == *" sanitize "* ]]; then
  # every kernel at small shapes (the `dev`-parametrised tests' CUDA half), under memcheck
  compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$PY" -m pytest -q -x -p no:cacheprovider \
    tests --ignore=tests/mpi -k "cuda and not real" -m "gpu and not slow" 2>&1 | tee "$OUT/sanitizer.log" | tail -15
  echo "memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1) / $(tail -1 "$OUT/sanitizer.log")" >>"$summ"
fi
if [[ " $what " == *" host "* ]]; then
  for args in "--batch 1 --k 1" "--batch 1 --k 3" "--batch 64 --k 3 --host-path numpy" "--batch 64 --k 3" \
              "--batch 64 --k 3 --catch-up --host-path numpy" "--batch 64 --k 3 --catch-up"; do
    "$PY" scripts/profile_host.py --family deepseek_v3 --device cuda --hidden-on device --no-profile --calls 500 \
      $args 2>&1 | tail -2 | tee -a "$OUT/host.log"
  done
  echo "host path: $(grep -c 'µs wall' "$OUT/host.log") runs in host.log" >>"$summ"
fi
if [[ " $what " == *" draft "* ]]; then
  "$PY" scripts/bench_draft.py --family all --ks 1,3 --batches 1,2,4,8,16,32,64 --iters 10 --hidden-on device \
    --json "$OUT/draft.json" --plot "$OUT/bench_draft_batches.png" 2>&1 | tee "$OUT/draft.log" | tail -80
  echo "bench_draft: $(grep -c '^### ' "$OUT/draft.log") families in draft.log" >>"$summ"
fi
if [[ " $what " == *" bench "* ]]; then
  "$PY" scripts/bench_kernels.py 2>&1 | tee "$OUT/bench_kernels.log" | tail -60
fi
cat "$summ"
