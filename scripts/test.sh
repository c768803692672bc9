#!/usr/bin/env bash
# The test command: fresh venv, install .[test], compile every kernel, serial tests, then 2-rank MPI tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
step() { echo; echo "== $* =="; }

step "install"
"$PY" -m venv "$VENV" || exit 1
"$VENV/bin/pip" install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import mtp_cupy, mpi4py, torch, transformers" || { echo "install failed"; exit 1; }
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

step "compile cuda_src (nvcc sm_90a, no spills; NVRTC as the runtime does) and host_src (cc)"
PYBIN="$VENV/bin/python" bash scripts/compile_kernels.sh || exit 1

step "serial tests"
"$VENV/bin/python" -m pytest -q --timeout=600 tests --ignore=tests/mpi
rc=$?
[ $rc -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
[ $rc -ne 0 ] && exit $rc

step "mpirun -n 2 tests"
timeout 900 "$VENV/bin/mpiexec" -n 2 "$VENV/bin/python" -m pytest -q --color=no --timeout=300 \
  --timeout-method=thread tests/mpi
rc=$?
[ $rc -eq 5 ] && { echo "pytest collected no MPI tests"; exit 1; }
[ $rc -eq 124 ] && echo "MPI tests timed out (hang)"
exit $rc
