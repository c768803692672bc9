"""The text the embedded model was trained on: the Python standard library's .py files (tests and
site-packages excluded), with about 5% of files, chosen by a hash of their name, held out. Lists the files
of one split, one a line, then their count and bytes on stderr.

    python scripts/stdlib_corpus.py --held-out          # the files acceptance.py cuts its prompts from
    python scripts/stdlib_corpus.py --fold 3 | wc -l    # the training files of another fold

The split itself is `mtp_cupy.bench.corpus.stdlib_files` (train_tiny.py and acceptance.py use it)."""
from __future__ import annotations

import sys

from mtp_cupy.bench.cli import Parser, nonneg_int, run_main
from mtp_cupy.bench.corpus import stdlib_files


def main() -> None:
    p = Parser(__doc__)
    p.add_argument("--held-out", action="store_true", help="list the held-out files instead of the training ones")
    p.add_argument("--fold", type=nonneg_int, default=0, help="which twentieth is held out (0..19)")
    a = p.parse_args()
    if a.fold >= 20:
        p.error(f"--fold {a.fold}: the folds are 0..19")
    files = stdlib_files(a.held_out, a.fold)
    for f in files:
        print(f)
    print(f"{len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.2f} MB "
          f"({'held out' if a.held_out else 'training'}, fold {a.fold})", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
