"""Sampling: the batched sampler and its logits processors."""
