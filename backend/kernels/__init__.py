"""Triton-language kernels for the model's GPU path (the torch code in backend/layers is the
reference and the CPU path).

- `rmsnorm.rms_norm`: RMSNorm with an optional fused residual add.
- `rope.apply_rotary_`: rotary embedding of q and k in place, from the float32 cos/sin cache;
  optionally storing the rotated keys and the values in the paged KV cache in the same pass.
- `activation.silu_and_mul`: SwiGLU's silu(gate) * up in one pass.
- `gemv.gemv`: one-token linear layers with RMSNorm / silu·mul prologues and a residual epilogue
  (the batch-1 decode path, `forward_one_token` of a model's decoder layer), over half-precision,
  int8, e4m3 or 4-bit weights (`gemv_weight`), over the weight-streaming dot of `gemv_stream`.
- `w8a16_gemm`, `int4_matmul`, `fp8_gemm`: the quantized formats' products of several rows.
- `gguf_gemv`, `gguf_matmul`, `gguf_dequantize`: GGUF blocks kept quantized (one row, a few
  rows, long steps), over the decoders of `gguf_values`.
- `qkv_rope.qkv_rope_gemv`: that path's qkv projection with rotary and the KV-cache write in its
  epilogue.
- `embedding.embedding`: the token embedding lookup, launched with PDL.
- `argmax.argmax_rows`: row-wise argmax for greedy sampling on GPU (and into pinned host memory
  in the decode CUDA graphs).
- `step_inputs.load_step_inputs`: a decode CUDA graph's first kernel, reading the step's inputs
  from pinned host memory and filling placeholder input ids.
- `tuning`: launch configs per device, read from the JSON tables in `tuning/` that the
  sweeps in `benchmarks/` write.
- `pdl`: programmatic dependent launch for the decode kernel chain (Hopper and later); each PDL
  kernel declares its `Ordering`, and `check_step_input_reads` checks a launch sequence against
  the rule that no kernel reads step inputs before they are written.
"""
