from .backend import RefBackend
from .registry import twin

__all__ = ["RefBackend", "twin"]
