"""Fused Triton layer kernels (RMSNorm + residual, SiLU-and-mul, RoPE, RoPE + KV-cache store) vs
PyTorch references."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels.rmsnorm import fused_rmsnorm, rmsnorm_reference  # noqa: E402
from radixserve.mem.kernels.rope_kv_store import (apply_rotary_and_store_kv,  # noqa: E402
                                              apply_rotary_inplace, rotary_reference)
from radixserve.layers.kernels.silu_and_mul import (silu_and_mul,  # noqa: E402
                                                    silu_and_mul_reference)

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# bf16 under the CPU interpreter is not trusted; it is tested on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def rope_caches(rot_dim: int, max_pos: int, base: float = 10000.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's layout: [max_pos, rot_dim], both halves equal, float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rmsnorm(dtype: torch.dtype, hidden: int) -> None:
    x, weight = randn(5, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(fused_rmsnorm(x, weight, 1e-6),
                               rmsnorm_reference(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fused_residual(dtype: torch.dtype) -> None:
    x, residual = randn(2, 3, 128, dtype=dtype), randn(2, 3, 128, dtype=dtype, seed=2)
    weight = randn(128, dtype=dtype, seed=1)
    out, new_residual = fused_rmsnorm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rmsnorm_reference(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)  # one rounded add: bit-exact
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert out.shape == x.shape and out.dtype == ref_out.dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("norm_cls", ["GemmaRMSNorm", "OlmoRMSNorm"])
def test_float32_weight_rmsnorm_matches_the_modules(dtype: torch.dtype, with_residual: bool,
                                                    norm_cls: str) -> None:
    """Gemma's (1 + weight) RMSNorm (Gemma, Qwen3-Next, Qwen3.5) and OLMo's weight-in-float32
    one, the residual add in front."""
    from radixserve.layers import norm as norms
    x, residual = randn(3, 96, dtype=dtype), randn(3, 96, dtype=dtype, seed=2)
    norm = getattr(norms, norm_cls)(96, 1e-6)
    norm.weight.data = randn(96, dtype=dtype, seed=1).cpu()
    ref = norm(x.cpu(), residual.cpu() if with_residual else None)
    got = fused_rmsnorm(x, norm.weight.to(DEVICE), 1e-6, residual if with_residual else None,
                        weight_offset=norm.weight_offset)
    if with_residual:
        assert torch.equal(got[1].cpu(), ref[1])
        got, ref = got[0], ref[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), ref, **TOL[dtype])


def test_rmsnorm_strided_rows_and_fp32_weight() -> None:
    x = randn(4, 256, dtype=torch.float16)[:, :128]  # row stride 256
    weight = randn(128, dtype=torch.float32, seed=3)
    out, ref = fused_rmsnorm(x, weight, 1e-6), rmsnorm_reference(x, weight, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[torch.float16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [32, 100])
def test_silu_and_mul(dtype: torch.dtype, intermediate: int) -> None:
    x = randn(3, 2 * intermediate, dtype=dtype)
    out = silu_and_mul(x, block=32)  # several column blocks, a ragged last one
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL[dtype])
    assert out.shape == (3, intermediate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rot_dim", [
    (4, 1, 64, 64), (6, 2, 128, 128), (2, 2, 64, 32),  # GQA, MHA, partial rotary
])
def test_rotary_inplace(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        rot_dim: int) -> None:
    num_tokens = 7
    cos, sin = rope_caches(rot_dim, max_pos=64)
    positions = torch.tensor([0, 1, 2, 40, 41, 5, 63], device=DEVICE)
    # q and k as views into one qkv projection output (strided rows), as models pass them
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    v_before = v.clone()
    ref_q, ref_k = rotary_reference(positions, q.clone(), k.clone(), cos, sin, head_dim)
    apply_rotary_inplace(positions, q, k, cos, sin, head_dim)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(v, v_before)


def test_rotary_reference_matches_transformers() -> None:
    """The reference itself against HF's apply_rotary_pos_emb (needs no triton)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cos, sin = rope_caches(64, max_pos=32)
    positions = torch.tensor([3, 0, 31], device=DEVICE)
    q, k = randn(3, 2 * 64, dtype=torch.float32), randn(3, 64, dtype=torch.float32, seed=1)
    ref_q, ref_k = rotary_reference(positions, q, k, cos, sin, 64)
    hf_q, hf_k = llama.apply_rotary_pos_emb(
        q.view(1, 3, 2, 64).transpose(1, 2), k.view(1, 3, 1, 64).transpose(1, 2),
        cos[positions][None], sin[positions][None])
    torch.testing.assert_close(ref_q, hf_q.transpose(1, 2).reshape(3, -1))
    torch.testing.assert_close(ref_k, hf_k.transpose(1, 2).reshape(3, -1))


def fused_rope_store_case(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, rot_dim: int, loc_dtype: torch.dtype,
                          num_tokens: int = 5, num_slots: int = 12, max_pos: int = 64,
                          cache_dtype: torch.dtype | None = None, seed: int = 0) -> None:
    """Fused rope + KV store against rotary_reference and index writes into a copy of the pool:
    q/k/v are views of one qkv tensor, loc is unsorted, the other slots must stay untouched."""
    cache_dtype = cache_dtype or dtype
    cos, sin = rope_caches(rot_dim, max_pos)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    loc = (torch.randperm(num_slots - 1, generator=gen)[:num_tokens] + 1).to(loc_dtype)
    loc = loc.to(DEVICE)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    k_cache = randn(num_slots, num_kv_heads, head_dim, dtype=cache_dtype, seed=seed + 1)
    v_cache = randn(num_slots, num_kv_heads, head_dim, dtype=cache_dtype, seed=seed + 2)
    ref_q, ref_k = rotary_reference(positions, q.clone(), k.clone(), cos, sin, head_dim)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_k_cache[loc.long()] = ref_k.view(num_tokens, num_kv_heads, head_dim).to(cache_dtype)
    ref_v_cache[loc.long()] = v.view(num_tokens, num_kv_heads, head_dim).to(cache_dtype)
    k_before, v_before = k.clone(), v.clone()
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[loc.long().cpu()] = False
    k_cache_before, v_cache_before = k_cache[untouched].clone(), v_cache[untouched].clone()

    apply_rotary_and_store_kv(positions, q, k, v, cos, sin, head_dim, k_cache, v_cache, loc)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    # the pool holds exactly what the kernel left in k (and v, as it was), cast to its dtype
    assert torch.equal(v, v_before)
    sel = loc.long()
    assert torch.equal(k_cache[sel], k.view(num_tokens, num_kv_heads, head_dim).to(cache_dtype))
    assert torch.equal(v_cache[sel], v.view(num_tokens, num_kv_heads, head_dim).to(cache_dtype))
    torch.testing.assert_close(k_cache, ref_k_cache, **TOL[dtype])
    torch.testing.assert_close(v_cache, ref_v_cache, atol=0, rtol=0)
    assert torch.equal(k_cache[untouched], k_cache_before)
    assert torch.equal(v_cache[untouched], v_cache_before)
    if rot_dim < head_dim:  # dims past rot_dim are stored as they came in
        k_tail = k_before.view(num_tokens, num_kv_heads, head_dim)[..., rot_dim:]
        assert torch.equal(k_cache[sel][..., rot_dim:], k_tail.to(cache_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rot_dim", [
    (4, 2, 64, 64), (8, 1, 128, 128), (4, 2, 128, 64), (2, 2, 64, 32),  # GQA; partial rotary
])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_rotary_and_store_kv(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int, rot_dim: int, loc_dtype: torch.dtype) -> None:
    fused_rope_store_case(dtype, num_heads, num_kv_heads, head_dim, rot_dim, loc_dtype)


def test_rotary_and_store_kv_matches_unfused_bitwise() -> None:
    """Same rounding as apply_rotary_inplace followed by set_kv_buffer's index writes."""
    dtype, num_tokens, heads, kv_heads, head_dim = torch.float16, 6, 4, 2, 64
    cos, sin = rope_caches(head_dim, max_pos=32)
    positions = torch.tensor([31, 0, 7, 7, 2, 19], device=DEVICE)
    loc = torch.tensor([9, 3, 1, 8, 2, 5], device=DEVICE)
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    qkv_ref = qkv.clone()
    caches = [randn(11, kv_heads, head_dim, dtype=dtype, seed=s) for s in (8, 9)]
    ref_caches = [c.clone() for c in caches]
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = qkv.split(widths, dim=-1)
    rq, rk, rv = qkv_ref.split(widths, dim=-1)
    apply_rotary_and_store_kv(positions, q, k, v, cos, sin, head_dim, *caches, loc)
    apply_rotary_inplace(positions, rq, rk, cos, sin, head_dim)
    ref_caches[0][loc] = rk.view(num_tokens, kv_heads, head_dim)
    ref_caches[1][loc] = rv.view(num_tokens, kv_heads, head_dim)
    assert torch.equal(qkv, qkv_ref)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_rotary_and_store_kv_casts_to_cache_dtype_and_skips_empty() -> None:
    fused_rope_store_case(torch.float32, 4, 2, 64, 64, torch.int64,
                          cache_dtype=torch.float16, seed=3)
    cos, sin = rope_caches(64, max_pos=8)
    empty = torch.empty(0, 128, device=DEVICE)
    cache = torch.zeros(4, 2, 64, device=DEVICE)
    apply_rotary_and_store_kv(torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty,
                              empty, cos, sin, 64, cache, cache.clone(),
                              torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not cache.any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 8192])
def test_fused_ops_real_shapes_gpu(dtype: torch.dtype, hidden: int) -> None:
    x, residual = randn(512, hidden, dtype=dtype), randn(512, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    out, new_residual = fused_rmsnorm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rmsnorm_reference(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    gate_up = randn(512, 2 * 14336, dtype=dtype, seed=3)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up),
                               **TOL[dtype])
    cos, sin = rope_caches(128, max_pos=8192)
    positions = torch.randint(0, 8192, (512,), device=DEVICE)
    q, k = randn(512, 32 * 128, dtype=dtype, seed=4), randn(512, 8 * 128, dtype=dtype, seed=5)
    ref_q, ref_k = rotary_reference(positions, q, k, cos, sin, 128)
    apply_rotary_inplace(positions, q, k, cos, sin, 128)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_and_store_kv_real_shapes_gpu(dtype: torch.dtype) -> None:
    fused_rope_store_case(dtype, 32, 8, 128, 128, torch.int64, num_tokens=512,
                          num_slots=4096, max_pos=8192)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 80)])
def test_rotary_and_store_kv_with_per_head_norms_matches_norm_then_rope(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Qwen3's q_norm / k_norm inside the rope + store launch: the same q, k and pool rows as
    RMSNorm over each head (fused_rmsnorm) followed by the kernel without norms. head_dim 80:
    halves padded to 64 lanes (the variance ignores them)."""
    num_tokens, eps = 5, 1e-6
    cos, sin = rope_caches(head_dim, max_pos=32)
    positions = torch.tensor([31, 0, 7, 7, 2], device=DEVICE)
    loc = torch.tensor([9, 3, 1, 8, 2], device=DEVICE)
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4) * 3
    qkv_ref = qkv.clone()
    q_weight = (randn(head_dim, dtype=torch.float32, seed=5) * 0.2 + 1).to(dtype)
    k_weight = (randn(head_dim, dtype=torch.float32, seed=6) * 0.2 + 1).to(dtype)
    caches = [randn(11, kv_heads, head_dim, dtype=dtype, seed=s) for s in (8, 9)]
    ref_caches = [c.clone() for c in caches]
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = qkv.split(widths, dim=-1)
    apply_rotary_and_store_kv(positions, q, k, v, cos, sin, head_dim, *caches, loc,
                              qk_norm=(q_weight, k_weight, eps))
    rq, rk, rv = qkv_ref.split(widths, dim=-1)
    nq = fused_rmsnorm(rq.reshape(-1, head_dim), q_weight, eps).view(num_tokens, -1)
    nk = fused_rmsnorm(rk.reshape(-1, head_dim), k_weight, eps).view(num_tokens, -1)
    apply_rotary_and_store_kv(positions, nq, nk, rv, cos, sin, head_dim, *ref_caches, loc)
    # equal up to the float32 order of each head's sum of squares (a rare last-bit flip)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(q, nq, **tol)
    torch.testing.assert_close(k, nk, **tol)
    torch.testing.assert_close(caches[0], ref_caches[0], **tol)
    assert torch.equal(caches[1], ref_caches[1])
    if dtype != torch.float32:  # the same rounding, not merely close
        assert (q == nq).float().mean() > 0.97
