"""Launchers for cuda_src/paged_attention.cu."""
__all__: list[str] = []
