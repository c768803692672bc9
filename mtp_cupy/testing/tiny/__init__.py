"""Tiny random checkpoints per family, in each family's real key layout and dtypes."""
