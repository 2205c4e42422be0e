"""Fused Triton kernels for the model layers (GPU path), each with a PyTorch reference beside it.

  rmsnorm.fused_rmsnorm(x, weight, eps, residual=None)       RMSNorm, optional fused residual add
  silu_and_mul.silu_and_mul(x)                                [T, 2I] -> silu(gate) * up, [T, I]
  gemv.gemv(x, weight, bias=None)                             one-row linear (batch-1 decode)

The rotary kernel (in place, or fused with the K/V store) is the KV pool's:
mem/kernels/rope_kv_store.py. Programmatic dependent launch helpers: core/triton_pdl.py.

The submodules import triton; this package does not, so callers can try the import and fall
back to PyTorch when triton is missing.
"""
