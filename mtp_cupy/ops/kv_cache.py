"""Launchers for cuda_src/kv_cache.cu."""
__all__: list[str] = []
