"""Fingerprints of a family's drafts and logits at real dims: a line per batch width with the SHA-256 of the
drafted tokens and of the logits' bits, for telling whether a kernel or launch change moved any bit.

A change meant to keep every bit (launch geometry, a walk order, an exact rescale) runs this in a tree before and
after it; the lines must match. The proposer is `mtp_cupy.bench`'s (random weights in the real formats, from
--seed), prefilled with --ctx rows per sequence; each width runs `propose_batch` of --k drafts twice (the second
after `after_verify_batch` of none accepted, so it redrafts the same positions) and both must agree, which also
checks the run is deterministic.

    python scripts/draft_hash.py --family deepseek_v4 [--batches 1,8,64] [--save logits.npz]

A width whose logits are not all finite is an error after its line.

--save writes the first 8192 logit columns of every width (float32 [B, k, 8192]) for an elementwise diff when
two trees' lines differ."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

import mtp_cupy
from mtp_cupy.bench.cli import Parser, device_flags, int_list, positive_int, run_main
from mtp_cupy.bench.drafter import FAMILIES, Drafter
from mtp_cupy.errors import MtpError


def fingerprints(d: Drafter, B: int, k: int) -> tuple[str, str, np.ndarray, bool]:
    """(tokens sha, logits sha, the logits' first 8192 columns, every logit finite) of one propose_batch of B
    sequences."""
    p, sts = d.prop, d.states[:B]
    rs = p.propose_batch(sts, d.toks[:B], np.ascontiguousarray(d.h[:B]), [d.ctx] * B, k, return_logits=True)
    ht, hl = hashlib.sha256(), hashlib.sha256()
    for r in rs:
        ht.update(np.asarray(r.tokens, np.int64).tobytes())
        hl.update(np.ascontiguousarray(r.logits, np.float32).tobytes())
    p.after_verify_batch(sts, [0] * B)
    head = np.stack([np.asarray(r.logits, np.float32)[:, :8192] for r in rs])
    return ht.hexdigest()[:16], hl.hexdigest()[:16], head, all(np.isfinite(r.logits).all() for r in rs)


def main() -> int:
    ap = Parser(__doc__)
    ap.add_argument("--family", choices=FAMILIES, default="deepseek_v4", help="the family")
    ap.add_argument("--batches", type=int_list, default="1,8,64", help="batch widths, comma list (at most 64)")
    ap.add_argument("--k", type=positive_int, default=3, help="drafts per propose")
    ap.add_argument("--ctx", type=positive_int, default=256, help="drafter rows prefilled per sequence")
    ap.add_argument("--save", metavar="NPZ", help="write the logits' first 8192 columns per width (default: none)")
    device_flags(ap)
    a = ap.parse_args()
    if max(a.batches) > 64:
        ap.error(f"--batches: {max(a.batches)} is more than 64")
    if a.save and not Path(a.save).resolve().parent.is_dir():
        ap.error(f"--save: no directory {Path(a.save).resolve().parent}")
    d = Drafter(a.family, mtp_cupy.device(a.device), ctx=a.ctx, kmax=a.k, bmax=max(a.batches), tiny=a.tiny,
                seed=a.seed)
    saved = {}
    for B in a.batches:
        (t1, l1, x, fin), (t2, l2, _, _) = fingerprints(d, B, a.k), fingerprints(d, B, a.k)
        if (t1, l1) != (t2, l2):
            raise MtpError(f"B = {B}: two runs of the same call differ ({t1} {l1} against {t2} {l2})")
        saved[f"B{B}"] = x
        print(f"{a.family} B={B} k={a.k} tokens {t1} logits {l1} finite {fin}", flush=True)
        if not fin:   # a NaN or Inf hashes alike in two trees: never a match
            raise MtpError(f"B = {B}: the logits are not all finite")
    if a.save:
        np.savez_compressed(a.save, **saved)
    return 0


if __name__ == "__main__":
    run_main(main)
