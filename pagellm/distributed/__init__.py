"""Tensor parallelism over torch.distributed: process groups, the rank-0 driver that mirrors
each step to the worker ranks, and the worker loop. See docs/scaling.md, "Tensor parallelism"."""
