#!/usr/bin/env bash
# Compile every cuda_src/*.cu for sm_90a with nvcc; fail on any error, warning or register spill. Then every
# host_src/*.c with the C compiler, warnings as errors.
# Also refuse includes NVRTC cannot satisfy (it has no host std headers): only cuda_*.h and local .cuh.
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "compile_kernels: nvcc not found (set NVCC=...)"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail=0
bad=$(grep -nE '^\s*#\s*include' cuda_src/*.cu cuda_src/*.cuh | grep -vE '#\s*include\s*(<cuda_[a-z0-9_]+\.h>|"[a-z0-9_]+\.cuh")')
if [ -n "$bad" ]; then echo "includes NVRTC cannot compile:"; echo "$bad"; fail=1; fi
for f in cuda_src/*.cu; do
  log="$tmp/$(basename "$f").log"
  if ! "$NVCC" -std=c++17 -arch=sm_90a -cubin --resource-usage -Werror all-warnings -I cuda_src \
        -o "$tmp/k.cubin" "$f" >"$log" 2>&1; then
    echo "FAIL $f"; cat "$log"; fail=1; continue
  fi
  spills=$(grep -E '[1-9][0-9]* bytes spill (stores|loads)' "$log")
  if [ -n "$spills" ]; then echo "SPILL $f"; grep -B2 -E '[1-9][0-9]* bytes spill' "$log"; fail=1; continue; fi
  echo "ok   $f ($(grep -c 'Function properties' "$log") kernels, max $(grep -oE 'Used [0-9]+ registers' "$log" | awk '{print $2}' | sort -n | tail -1) registers)"
done
# host_src: the batch calls' compiled bookkeeping (speculative/batch_host.py builds it at run time with the same
# flags, less the warning gate)
CC=${CC:-cc}
for f in host_src/*.c; do
  if ! "$CC" -O2 -std=c11 -shared -fPIC -Wall -Wextra -Werror -o "$tmp/h.so" "$f" >"$tmp/h.log" 2>&1; then
    echo "FAIL $f"; cat "$tmp/h.log"; fail=1
  else
    echo "ok   $f"
  fi
done
# NVRTC, the compiler the runtime uses (no host std headers): the same source inlining and options
PYBIN=${PYBIN:-python3}
if "$PYBIN" -c "import nvidia" 2>/dev/null; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYBIN" scripts/nvrtc_check.py || fail=1   # this tree's mtp_cupy
else
  echo "NVRTC check skipped: the nvidia-cuda-nvrtc wheel is not installed for $PYBIN"
fi
exit $fail
