"""Launchers for cuda_src/rms_norm.cu."""
__all__: list[str] = []
