"""Launchers for cuda_src/rope.cu."""
__all__: list[str] = []
