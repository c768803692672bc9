"""Launchers for cuda_src/quantize.cu."""
__all__: list[str] = []
