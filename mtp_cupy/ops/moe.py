"""Launchers for cuda_src/moe.cu."""
__all__: list[str] = []
