"""`load_proposer`: the MTP draft proposer of a checkpoint, whatever its family (mtp_cupy.families)."""
from __future__ import annotations

from ..families import of_checkpoint


def load_proposer(path, gpu=None, max_seq_len: int = 4096, comm=None, **options):
    """Load the MTP draft proposer of the checkpoint at `path`.

    Parameters
    ----------
    path : str or Path
        Checkpoint directory (config.json + *.safetensors); config.json's model_type picks the family.
    gpu : Backend or str, optional
        The device (`mtp_cupy.device(...)`, or one of "auto", "cuda", "ref"); default `device("auto")`.
    max_seq_len : int
        Most drafter rows (positions) one sequence may hold.
    comm : Communicator, optional
        Several ranks (GLM-5 only): this rank's shard is loaded.
    **options
        The family's options (`mtp_cupy.families.family(name).options.help()` lists them).

    Returns
    -------
    MtpProposerBase
        The family's proposer.

    Raises
    ------
    ConfigError
        Unknown family or model type, unknown option or bad option value, a config the family cannot run.
    WeightError
        A tensor missing or of the wrong shape / dtype (the key and file are named)."""
    from ..runtime import as_device
    fam = of_checkpoint(path)
    return fam.proposer.from_checkpoint(path, as_device(gpu), max_seq_len=max_seq_len, comm=comm, **options)
