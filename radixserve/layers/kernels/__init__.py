"""Fused Triton kernels for the model layers (GPU path), each with a PyTorch reference beside it.

  rmsnorm.fused_rmsnorm(x, weight, eps, residual=None)       RMSNorm, optional fused residual add
  silu_and_mul.silu_and_mul(x)                                [T, 2I] -> silu(gate) * up, [T, I]
  rotary.apply_rotary_inplace(positions, q, k, cos, sin, head_dim)   neox-style RoPE, in place
  rotary.apply_rotary_and_store_kv(...)                       RoPE + the K/V write into the pool
  gemv.gemv(x, weight, bias=None)                             one-row linear (batch-1 decode)
  pdl                                                         programmatic dependent launch

The submodules import triton; this package does not, so callers can try the import and fall
back to PyTorch when triton is missing.
"""
