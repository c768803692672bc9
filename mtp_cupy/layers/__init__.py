"""Model layers built from the kernels: attention variants, MoE, mHC, RoPE tables."""
