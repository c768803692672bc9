#!/usr/bin/env bash
# A/B of git refs on one GPU in one device call (timings compare only within one machine and call).
#   bash scripts/ab_trees.sh build NAME=REF [NAME=REF ...]   # here (needs git): .ab/NAME = `git archive REF`
#   bash scripts/ab_trees.sh run [-r ROUNDS] [-t SECONDS] -- CMD [ARGS ...]   # there: CMD in every tree
# `build` writes each ref's sources (cuda_src, host_src, mtp_cupy, scripts, tests, docs and the packaging files)
# into .ab/NAME with the checkout's mtp_cupy/data linked in, and the ref's short hash in .ab/NAME/REF. `run` runs
# CMD with each built tree (a folder of .ab holding REF) as working directory and PYTHONPATH, the trees interleaved ROUNDS times (default 2:
# a b a b), each run headed "== NAME (REF) round R", each cut at SECONDS (default 300). .ab/ is gitignored: give
# the device call carry [".ab"]. Example, the bits and the MoE of two refs:
#   bash scripts/ab_trees.sh build main=main new=wip/x
#   bash scripts/ab_trees.sh run -r 1 -- python scripts/draft_hash.py --family deepseek_v4
#   bash scripts/ab_trees.sh run -- python scripts/bench_moe.py --models deepseek_v4 --batches 1,64
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: ab_trees.sh build NAME=REF ... | run [-r ROUNDS] [-t SECONDS] -- CMD ..." >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1; shift
case $mode in
build)
  [ $# -ge 1 ] || usage
  for nr in "$@"; do
    n=${nr%%=*}; r=${nr#*=}
    [[ $nr == *=* && $n =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "ab_trees.sh: error: '$nr' is not NAME=REF" >&2; exit 2; }
    h=$(git rev-parse --short --verify -q "$r^{commit}") || { echo "ab_trees.sh: error: no commit '$r'" >&2; exit 1; }
    rm -rf ".ab/$n" && mkdir -p ".ab/$n"
    git archive "$h" cuda_src host_src mtp_cupy scripts tests docs setup.cfg pyproject.toml \
      | tar x -C ".ab/$n" || exit 1
    rm -rf ".ab/$n/mtp_cupy/data" && ln -s ../../../mtp_cupy/data ".ab/$n/mtp_cupy/data"
    echo "$h" > ".ab/$n/REF"
    echo "built .ab/$n ($h)"
  done ;;
run)
  rounds=2; secs=300
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    [ $# -ge 2 ] || usage
    case $1 in
      -r) rounds=$2; shift 2 ;;
      -t) secs=$2; shift 2 ;;
      *) usage ;;
    esac
  done
  [ "${1:-}" = "--" ] && [ $# -ge 2 ] || usage
  shift
  [[ $rounds =~ ^[1-9][0-9]*$ && $secs =~ ^[1-9][0-9]*$ ]] ||
    { echo "ab_trees.sh: error: -r and -t take whole numbers >= 1" >&2; exit 2; }
  trees=$(for d in .ab/*/; do [ -f "$d/REF" ] && basename "$d"; done)   # built trees only (not scratch dirs)
  [ -n "$trees" ] ||
    { echo "ab_trees.sh: error: no trees in .ab/ (run 'build' first; carry .ab to the device)" >&2; exit 1; }
  for ((i = 1; i <= rounds; i++)); do
    for n in $trees; do
      echo "== $n ($(cat ".ab/$n/REF" 2>/dev/null)) round $i"
      (cd ".ab/$n" && PYTHONPATH=$PWD timeout "$secs" "$@") 2>&1
    done
  done ;;
*) usage ;;
esac
