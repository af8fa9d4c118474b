"""Triton-language kernels for the model's elementwise/row-wise steps (GPU path).

- `rmsnorm.rms_norm`: RMSNorm with an optional fused residual add.
- `rope.apply_rotary_`: rotary embedding of q and k in place, from the float32 cos/sin cache.
- `activation.silu_and_mul`: SwiGLU's silu(gate) * up in one pass.
"""
