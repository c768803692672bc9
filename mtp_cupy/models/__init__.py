"""`load_proposer`: the MTP draft proposer of a checkpoint, whatever its family (mtp_cupy.families)."""
from __future__ import annotations

from ..families import of_checkpoint


def load_proposer(path, gpu=None, max_seq_len: int = 4096, comm=None, **options):
    """Load the MTP draft proposer of the checkpoint at `path`.

    Parameters
    ----------
    path : str or Path
        Checkpoint directory (config.json + *.safetensors), not a file in it; config.json's model_type picks
        the family (`mtp_cupy.families`).
    gpu : Backend or str, optional
        The device: `mtp_cupy.device(...)`, or one of "auto", "cuda", "ref"; default `device("auto")`.
    max_seq_len : int
        Most drafter rows (positions) one sequence may hold; sizes the KV pool and the metadata slabs.
    comm : Communicator, optional
        Several ranks (GLM-5 only; `mtp_cupy.runtime.comm.make_communicator`, which holds the
        `collective_timeout_s` deadline): this rank's shard is loaded. Collective: every rank calls together.
    **options
        The family's options, a frozen dataclass (`mtp_cupy.families.family(name).options.help()` lists them
        with their defaults). Every family takes:

        max_drafts : int, default 8
            Most drafts one propose may ask for (1 to 64).
        max_batch : int, default 64
            Most sequences one propose_batch drafts for (1 to 64); CUDA graph buckets 1, 2, 4, ... up to it.
        max_sequences : int, optional
            KV pool size in sequences of max_seq_len (default: max_batch).
        max_prefill_rows : int, default 128 (qwen3_next 512)
            Drafter rows written per batched prefill pass.
        drafter_context : bool, default True
            The drafter attends over its own KV of every earlier position, so a propose must follow the
            newest row without a hole (InputError otherwise; catch up with `prefill`); False allows holes.
        cuda_graphs : bool, optional
            Replay each draft chain as a CUDA graph (default: on when the device is CUDA).
        progress : bool, optional
            Show a weight-loading bar (default: for checkpoints over 256 MB).

        Per family:

        mtp_vocab_size : int, default 0 (deepseek_v4, deepseek_v3, qwen3_next)
            Score only the first n vocab rows (0 = the whole vocab).
        device_hidden : {"streams", "single"}, default "streams" (deepseek_v4)
            What a device-pointer hidden holds: the target's [hc, D] pre-hc_head streams or one [D] hidden.
        quantization : {"nvfp4", "fp4", "fp8", "bf16"}, optional (qwen3_next)
            Precision of the projections (default: the checkpoint's own format).
        kv_scale : float, default 1.0 (qwen3_next)
            Scale of FP8 K/V cache rows.
        refeed_accepted : bool, default False (qwen3_next)
            after_verify also drops accepted rows built from a drafter hidden; the caller re-feeds them from
            the target's hiddens with `prefill(..., start_position=...)`.
        head_fp8 : bool, default False (glm5)
            Draft from an FP8 (per-row scale) copy of this rank's head slice.
        head_exchange : {"digits", "pairs"}, default "digits" (glm5)
            Cross-rank argmax: bf16 lanes in one all-reduce, or (f32, i32) pairs in one all-gather.

    Returns
    -------
    MtpProposerBase
        The family's proposer: `alloc_state`, `prefill`, `propose`, `propose_batch`, `after_verify`,
        `free_state` (each documented in `mtp_cupy.speculative.base`).

    Raises
    ------
    ConfigError
        A path that is not a checkpoint directory, an unknown family or model type, an unknown option or a bad
        option value, a config the family cannot run, a communicator of several ranks for a one-GPU family,
        a `gpu` that is neither a Backend nor a device name.
    WeightError
        A tensor missing or of the wrong shape / dtype (the key and file are named)."""
    from ..runtime import as_device
    fam = of_checkpoint(path)
    return fam.proposer.from_checkpoint(path, as_device(gpu), max_seq_len=max_seq_len, comm=comm, **options)
