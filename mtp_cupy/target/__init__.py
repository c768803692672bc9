"""Target-model runners built from the same kernels as the drafters (for end-to-end speculative decoding)."""
from .deepseek_v3 import DeepseekV3Target
from .hf import HfTargetRunner


def load_target(path, gpu, max_seq_len: int, max_sequences: int = 2):
    """The target runner of a checkpoint: mtp_cupy's own DeepseekV3Target for a deepseek_v3 checkpoint (its cache
    sized for `max_sequences` sequences of max_seq_len), the checkpoint's target through transformers
    (HfTargetRunner, needs torch + transformers; a cache per sequence) for the others."""
    from ..weights.config import load_config
    from ..weights.info import checkpoint_dir
    if load_config(checkpoint_dir(path)).family == "deepseek_v3":
        return DeepseekV3Target(gpu, path, max_seq_len=max_seq_len, max_sequences=max_sequences)
    from .hf import load_hf_runner
    return load_hf_runner(path, gpu, max_seq_len)

# the class's reference documentation (target/deepseek_v3.py's module docstring describes the internals)
DeepseekV3Target.__doc__ = """The whole DeepSeek-V3-layout target model (MLA + MoE, no MTP layer) on the drafters'
    kernels, over its own paged latent cache: the target runner of `mtp_cupy.generate`.

    Parameters
    ----------
    gpu : Backend
        `mtp_cupy.device(...)`. Every layer of the runner is built with invariant=True (launch geometry
        independent of the row count), so a verified row computes exactly as the same row decoded alone.
    path : str or Path
        A deepseek_v3 checkpoint directory (config.json + *.safetensors).
    max_seq_len : int
        Most rows (positions) one sequence may hold.
    max_sequences : int
        Sequences the KV cache holds at once.
    rows_per_pass : int
        Rows one kernel pass computes; `forward` splits longer inputs into passes.
    progress : bool, optional
        Show a weight-loading bar (default: for large checkpoints).

    Methods
    -------
    alloc() -> TargetSeq
        A new, empty sequence.
    forward(seq, tokens) -> (logits, hiddens)
        Appends len(tokens) rows at the next positions. `tokens`: sequence of int ids in [0, vocab_size).
        Returns logits float32 [m, vocab_size] and the final-normed hiddens float32 [m, hidden_size] (what
        the MTP drafter pairs with the next token). Raises InputError (empty, id out of range) or
        CapacityError (past max_seq_len); the sequence is unchanged on failure.
    truncate(seq, rows)
        Keep the first `rows` rows (drop rejected drafts).
    free(seq)
        Give the sequence's cache blocks back.

    Raises
    ------
    ConfigError
        A checkpoint that is not deepseek_v3, or not a checkpoint directory.
    WeightError
        A missing or mis-shaped tensor."""

__all__ = ["DeepseekV3Target", "HfTargetRunner", "load_target"]
