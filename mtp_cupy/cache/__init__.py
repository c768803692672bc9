from .paged import BLOCK_SIZE, CacheSpec, PagedKvCache, SeqBlocks

__all__ = ["BLOCK_SIZE", "CacheSpec", "PagedKvCache", "SeqBlocks"]
