"""One error hierarchy for the runtime. Every failed call leaves proposer state as it was."""


class MtpError(Exception):
    """Root of every error mtp_cupy raises on purpose."""


class ConfigError(MtpError):
    """A config.json or option that cannot be used (unknown model_type, bad quantisation name, ...)."""


class WeightError(MtpError):
    """A checkpoint tensor that is missing, truncated, or of the wrong shape/dtype.

    The message names the key, the file, and what was expected vs found."""

    def __init__(self, msg: str, key: str | None = None, file: str | None = None):
        where = "".join([f" [key {key}]" if key else "", f" [file {file}]" if file else ""])
        super().__init__(msg + where)
        self.key, self.file = key, file


class InputError(MtpError):
    """Bad call input: token id out of range, position past the sized context, wrong hidden shape."""


class CapacityError(MtpError):
    """A fixed-size resource is full: KV block pool, metadata region, arena."""


class KernelError(MtpError):
    """A kernel that is not defined, or a launch that failed (names the kernel)."""


class CommError(MtpError):
    """Rank/world mismatch or a communicator that cannot do what was asked."""


class CollectiveTimeout(CommError):
    """A collective that did not complete within the communicator's `collective_timeout_s`: another rank is
    hung, dead, or never made the call. The communicator is aborted and refuses every later call."""
