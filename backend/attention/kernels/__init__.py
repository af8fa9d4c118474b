"""Triton-language kernels behind `backend.attention.triton_backend`.

- `kv_write`: scatter the new tokens' K/V into the paged cache by slot.
- `tile`: the shared inner step (one key tile of online softmax over paged K/V).
- `decode`: split-K paged decode attention (one query token per request) + split reduce.
- `prefill`: causal attention for packed variable-length query chunks over a paged prefix.
"""
