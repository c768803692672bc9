"""Proposer options: one frozen dataclass per family, documented once (each field's `help`), validated once.

`load_proposer(path, **options)` and every proposer constructor turn their keyword options into the family's
dataclass with `parse`; an unknown name is a ConfigError that lists the known ones, a bad value a ConfigError
that names the field and the value."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from ..runtime.backend import check_stream


def opt(default: Any, help: str) -> Any:
    """A documented option field."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class ProposerOptions:
    """Options every family takes."""
    max_drafts: int = opt(8, "most draft tokens one propose may ask for")
    max_batch: int = opt(64, "most sequences one propose_batch drafts for (graph buckets 1, 2, 4, ... up to it)")
    max_sequences: int | None = opt(None, "KV pool size in sequences of max_seq_len (default: max_batch)")
    max_prefill_rows: int = opt(128, "drafter rows written per batched prefill pass")
    drafter_context: bool = opt(True, "the drafter attends over its own KV of every earlier position, so a "
                                      "propose must follow the newest row without a hole; False: it attends "
                                      "over whatever rows it holds and holes are allowed")
    batch_invariant: bool = opt(True, "a sequence drafts the same (bit for bit) whatever batch it is in: kernels and "
                                      "splits chosen as for one row; False takes the fastest kernel per batch size")
    cuda_graphs: bool | None = opt(None, "replay each draft chain as a CUDA graph (default: on when the device is CUDA)")
    progress: bool | None = opt(None, "show a weight-loading bar (default: for checkpoints over 256 MB)")
    stream: Any = opt(None, "run on this CUDA stream (a torch.cuda.Stream, a cupy stream, anything with "
                            "__cuda_stream__, or a cudaStream_t int) instead of one of the proposer's own; graphs are "
                            "then captured on a private stream and replayed on this one")
    check_device_finite: bool = opt(False, "check CUDA-tensor hiddens for NaN/inf too (one reduction and a wait on "
                                           "the proposer's stream per call); host inputs are always checked")
    host_path: str = opt("auto", "where propose's and the batch calls' bookkeeping runs (checks, KV blocks, slabs, "
                                 "counters): 'c', host_src/batch_host.c built once with the system C compiler; "
                                 "'numpy', array passes; 'auto', c when a compiler builds it")

    def __post_init__(self) -> None:
        self._int("max_drafts", 1, 64)
        self._int("max_batch", 1, 64)
        if self.max_sequences is not None:
            self._int("max_sequences", 1, 1 << 20)
        self._int("max_prefill_rows", 1, 1 << 16)
        self._bool("drafter_context")
        self._bool("batch_invariant")
        self._bool("check_device_finite")
        self._choice("host_path", ("auto", "c", "numpy"))
        try:
            check_stream(self.stream)
        except ConfigError as e:
            raise ConfigError(f"option {e}") from None
        for name in ("cuda_graphs", "progress"):
            if getattr(self, name) is not None:
                self._bool(name)

    def _bool(self, name: str) -> None:
        v = getattr(self, name)
        if not isinstance(v, bool):
            raise ConfigError(f"option {name}={v!r} must be True or False")

    def _int(self, name: str, lo: int, hi: int) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"option {name}={v!r} must be an integer in [{lo}, {hi}]")

    def _choice(self, name: str, choices) -> None:
        if getattr(self, name) not in choices:
            raise ConfigError(f"option {name}={getattr(self, name)!r}: choose one of {', '.join(map(str, choices))}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def parse(cls, family: str, given: dict[str, Any] | None = None, base: "ProposerOptions | None" = None):
        """`base` (or the defaults) with the fields in `given` replaced; unknown names raise ConfigError."""
        given = dict(given or {})
        bad = sorted(set(given) - set(cls.names()))
        if bad:
            raise ConfigError(f"unknown option(s) {bad} for {family}; known: {', '.join(cls.names())}")
        if base is not None and not isinstance(base, cls):
            raise ConfigError(f"options of type {type(base).__name__} given to {family} (expected {cls.__name__})")
        start = {f.name: getattr(base, f.name) for f in fields(cls)} if base is not None else {}
        return cls(**{**start, **given})

    @classmethod
    def doc_entries(cls, skip=()) -> dict[str, str]:
        """numpydoc entries ("name : type, default x" and the help, indented for a Parameters section)."""
        import textwrap
        out = {}
        for f in fields(cls):
            if f.name in skip:
                continue
            tp = str(f.type).replace(" | None", "")
            head = f"        {f.name} : {tp}, " + ("optional" if f.default is None else f"default {f.default!r}")
            text = f.metadata.get("help", "")
            body = textwrap.fill(text[:1].upper() + text[1:], 108, initial_indent=" " * 12,
                                 subsequent_indent=" " * 12)
            out[f.name] = head + "\n" + (body + "\n" if body.strip() else "")
        return out

    @classmethod
    def help(cls) -> str:
        """One line per option: name, default and what it does (docstrings and `--help`)."""
        out = []
        for f in fields(cls):
            d = f.default if f.default is not MISSING else "required"
            out.append(f"{f.name} (default {d!r}): {f.metadata.get('help', '')}")
        return "\n".join(out)
