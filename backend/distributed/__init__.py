"""Tensor parallelism: the rank protocol, the worker processes and the peer all-reduce."""
