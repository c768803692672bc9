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
        The family's options, one frozen dataclass per family (`mtp_cupy.families.family(name).options`).
        Every family takes:

{common}
        Per family:

{families}
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


def _options_doc() -> dict[str, str]:
    """The option entries of load_proposer's docstring, written from the options dataclasses themselves."""
    from ..families import FAMILIES
    from ..speculative.options import ProposerOptions
    common = ProposerOptions.doc_entries()
    for name in ProposerOptions.names():        # defaults a family overrides
        base = getattr(ProposerOptions(), name)
        other = [f"{f.name}: {getattr(f.options(), name)!r}" for f in FAMILIES if getattr(f.options(), name) != base]
        if other:
            common[name] = common[name].replace("\n", f" ({', '.join(other)})\n", 1)
    per: dict[str, list[str]] = {}
    for f in FAMILIES:
        for name, entry in f.options.doc_entries(skip=ProposerOptions.names()).items():
            per.setdefault(name, [entry, []])[1].append(f.name)
    fam = [e.replace("\n", f" ({', '.join(names)})\n", 1) for e, names in per.values()]
    return dict(common="".join(common.values()), families="".join(fam))


load_proposer.__doc__ = load_proposer.__doc__.format(**_options_doc())
