"""One file per cuda_src module; each defines the twins of that module's kernels."""
