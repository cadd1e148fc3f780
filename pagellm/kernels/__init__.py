"""Compiled kernels that the model and the attention backends call where they serve."""
