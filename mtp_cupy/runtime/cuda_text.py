"""Reading cuda_src text without a compiler: comments stripped, and the kernels that function-like macros define
expanded (token pasting with ##), so that the kernel names (runtime.backend.cuda_kernel_names) and argument
lists (tests/test_kernel_signatures.py) of macro-made kernels are seen like any other's."""
from __future__ import annotations

import re

__all__ = ["strip_comments", "split_top", "close_paren", "expand_kernel_macros"]

_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)


def strip_comments(src: str) -> str:
    """src without // and /* */ comments (string literals kept)."""
    out, i = [], 0
    while i < len(src):
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = len(src) if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            out.append(" ")
            i = len(src) if j < 0 else j + 2
        elif src[i] == '"':
            j = i + 1
            while src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def close_paren(text: str, i: int) -> int:
    """text[i] == '(': the index just past its matching ')'."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    raise ValueError(f"unbalanced parentheses from {text[i:i + 60]!r}")


def split_top(s: str) -> list[str]:
    """Split on commas outside (), <>, [] (no operators appear in parameter lists or macro arguments)."""
    parts, depth, cur = [], 0, []
    for ch in s:
        depth += 1 if ch in "(<[" else -1 if ch in ")>]" else 0
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    parts = [p.strip() for p in parts]
    return [] if parts == [""] else parts


def expand_kernel_macros(code: str) -> str:
    """Expand the function-like macros whose body defines a __global__, or calls such a macro (token pasting
    with ##), until none is left."""
    defs = {m.group(1): ([p.strip() for p in m.group(2).split(",") if p.strip()], m.group(3).replace("\\\n", " "))
            for m in _DEFINE.finditer(code)}
    macros = {k: v for k, v in defs.items() if "__global__" in v[1]}
    while (more := {k: v for k, v in defs.items() if k not in macros
                    and any(re.search(r"\b%s\s*\(" % n, v[1]) for n in macros)}):
        macros.update(more)
    if not macros:
        return code
    code = _DEFINE.sub(lambda m: "" if m.group(1) in macros else m.group(0), code)
    while any(re.search(r"\b%s\s*\(" % name, code) for name in macros):
        code = _expand_once(code, macros)
    return code


def _expand_once(code: str, macros: dict) -> str:
    for name, (params, body) in macros.items():
        while (m := re.search(r"\b%s\s*\(" % name, code)):
            end = close_paren(code, m.end() - 1)
            args = split_top(code[m.end():end - 1])
            assert len(args) == len(params), f"macro {name}: {len(args)} arguments for {len(params)} parameters"
            text = body
            for p, a in zip(params, args):
                text = re.sub(r"\b%s\b" % p, lambda _: a, text)
            code = code[:m.start()] + re.sub(r"\s*##\s*", "", text) + code[end:]
    return code
