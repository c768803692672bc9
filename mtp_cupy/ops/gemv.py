"""Launchers for cuda_src/gemv.cu."""
__all__: list[str] = []
