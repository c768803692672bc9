"""docs/ is the reference: every file path docs/architecture.md names exists, and every docs/model_math.md
section the code cites is a heading there."""
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"`([\w./{},-]+\.(?:py|cu|cuh|md))`")


def expand(p: str) -> list[str]:
    """`layers/{mla,dsa}.py` -> layers/mla.py, layers/dsa.py."""
    parts = re.split(r"\{([^}]*)\}", p)
    opts = [[s] if i % 2 == 0 else s.split(",") for i, s in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*opts)]


def test_architecture_names_only_files_that_exist():
    text = (ROOT / "docs/architecture.md").read_text()
    named = {q for m in PATH.finditer(text) for q in expand(m.group(1)) if "<" not in q}
    assert len(named) > 30, sorted(named)
    def exists(q: str) -> bool:
        if "/" not in q:    # a bare file name in prose: somewhere in the package or the kernels
            return any(ROOT.glob(f"mtp_cupy/**/{q}")) or any((ROOT / d / q).exists() for d in ("cuda_src", "docs"))
        return any((b / q).exists() for b in (ROOT, ROOT / "mtp_cupy"))
    missing = [q for q in sorted(named) if not exists(q)]
    assert not missing, missing


def test_cited_model_math_sections_exist():
    heads = set(re.findall(r"^#+ ([A-Z0-9])(?:\.(\d+))?[. ]", (ROOT / "docs/model_math.md").read_text(), re.M))
    have = {a for a, _ in heads} | {f"{a}.{b}" for a, b in heads if b}
    cited = set()
    for f in itertools.chain(*(ROOT.glob(g) for g in ("mtp_cupy/**/*.py", "tests/**/*.py", "cuda_src/*.cu*"))):
        for m in re.finditer(r"model_math\.md(?: section)? ([A-Z0-9](?:\.\d+)?)", f.read_text()):
            cited.add((m.group(1), f.relative_to(ROOT).as_posix()))
    assert len(cited) > 20
    bad = sorted(c for c in cited if c[0] not in have)
    assert not bad, bad
