"""A transformers causal LM as the target runner of `mtp_cupy.generate` (the families mtp_cupy has no target of
its own for: DeepSeek-V4, Qwen3-Next, GLM-5). One sequence at a time, over integrations.transformers.HfTarget:
its cache, the hidden the drafter is handed (final-normed; V4's hc streams [hc, D]) and its rollback (crop, or
snapshot + re-run for the caches a crop cannot roll back)."""
from __future__ import annotations

from ..errors import CapacityError, ConfigError, InputError


class HfSeq:
    """One sequence: its HfTarget (cache, length) and what the last forward appended (for truncate)."""

    def __init__(self, t):
        self.t, self.snap, self.last = t, {}, []


class HfTargetRunner:
    """`model` (a transformers causal LM with the drafter's checkpoint's target) as a target runner.

    Parameters
    ----------
    model : transformers PreTrainedModel
        In eval mode, on its device (CPU or CUDA).
    max_seq_len : int
        Most positions one sequence may hold."""

    def __init__(self, model, max_seq_len: int):
        self.model, self.max_seq_len = model, int(max_seq_len)
        self.vocab_size = int(model.config.vocab_size)
        self.cfg = model.config
        self.hidden_size = int(model.config.hidden_size)

    def alloc(self):
        from ..integrations.transformers import HfTarget
        return HfSeq(HfTarget(self.model))

    def free(self, seq) -> None:
        seq.t.close()

    def forward(self, seq, tokens):
        """Append `tokens` at the next positions: (logits float32 [m, V], hiddens float32 [m, ...]) on the host."""
        import torch
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise InputError("forward needs at least one token")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise InputError(f"token out of range [0, {self.vocab_size})")
        if seq.t.length + len(tokens) > self.max_seq_len:
            raise CapacityError(f"{seq.t.length} + {len(tokens)} rows exceed max_seq_len {self.max_seq_len}")
        seq.snap, seq.last = seq.t.snapshot(), tokens
        with torch.no_grad():
            lg, H = seq.t.forward(tokens)
        return lg.float().cpu().numpy(), H.float().cpu().numpy()

    def truncate(self, seq, rows: int) -> None:
        """Keep the first `rows` rows; only rows of the last forward can be dropped."""
        drop = seq.t.length - int(rows)
        if drop <= 0:
            return
        if drop > len(seq.last):
            raise InputError(f"truncate to {rows} drops rows before the last forward ({seq.t.length} held)")
        import torch
        with torch.no_grad():
            seq.t.rollback(seq.snap, len(seq.last), seq.last[:len(seq.last) - drop])


def load_hf_runner(path, gpu, max_seq_len: int) -> HfTargetRunner:
    """The checkpoint's target through transformers (float32, on CUDA when `gpu` is, else the CPU)."""
    import importlib.util
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"this checkpoint's target runs through transformers, which needs {' and '.join(missing)} "
                          "(pip install torch transformers)")
    from ..testing.hf_targets import load_hf_target
    model = load_hf_target(path, device="cuda" if gpu.is_cuda else "cpu")
    return HfTargetRunner(model, max_seq_len)


__all__ = ["HfTargetRunner", "load_hf_runner"]
