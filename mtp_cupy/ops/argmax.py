"""Launchers for cuda_src/argmax.cu."""
__all__: list[str] = []
