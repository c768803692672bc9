from .proposer import DraftBatch, DraftProposer, DraftResult, ProposerState, mtp_rows_to_trim
from .inputs import check_bitmask, check_position, check_token, hidden_to_device

__all__ = ["DraftBatch", "DraftProposer", "DraftResult", "ProposerState", "mtp_rows_to_trim", "check_bitmask",
           "check_position", "check_token", "hidden_to_device"]
