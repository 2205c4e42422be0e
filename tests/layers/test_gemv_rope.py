"""The one-row q|k|v GEMV with rope and the KV store in its epilogue (kernels/gemv_rope.py)
against the GEMV followed by the fused rope + store kernel it replaces: the same output rows
and pool rows, bitwise in the interpreter. On the GPU the rows' sums may round differently in
the last place (the compiler lays out the reordered rows' reduction its own way: 10-19% of
the elements one unit apart on the H200), and an FP8 code may then land one step over."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels.gemv import GemvConfig, RowFusion, fp8_gemv, gemv  # noqa: E402
from radixserve.layers.kernels.gemv_rope import RopeStore, rope_rows_fit  # noqa: E402
from radixserve.layers.rotary import RotaryEmbedding, default_inv_freq  # noqa: E402
from radixserve.mem.kernels.rope_kv_store import apply_rotary_and_store_kv  # noqa: E402
from radixserve.mem.kv_pool import KVStoreTarget  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, K = 4, 2, 16, 64
N = (HQ + 2 * HKV) * D


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise in the interpreter; within a unit in the last place (an FP8 step) on the GPU."""
    if DEVICE.type != "cuda":
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)
        return
    rtol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(got.dtype, 0.07)
    torch.testing.assert_close(got.float(), want.float(), atol=rtol, rtol=rtol)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(9, HKV, D, dtype=dtype, device=DEVICE),
            torch.zeros(9, HKV, D, dtype=dtype, device=DEVICE))


def test_rope_rows_fit() -> None:
    assert rope_rows_fit(16, 128) and rope_rows_fit(2, 128) and rope_rows_fit(128, 128)
    assert not rope_rows_fit(1, 128)      # a lone row has no partner
    assert not rope_rows_fit(256, 128)    # a program would span two heads
    assert not rope_rows_fit(48, 128)     # 24 pairs do not tile 64


@pytest.mark.parametrize("dtype,pool_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16),
    (torch.float16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("config", [GemvConfig(16, 32, 4, 1), GemvConfig(4, 64, 2, 2)])
@pytest.mark.parametrize("norm,bias", [(False, False), (True, True)])
def test_gemv_rope_store_matches_gemv_then_rope_store(dtype: torch.dtype,
                                                      pool_dtype: torch.dtype,
                                                      config: GemvConfig, norm: bool,
                                                      bias: bool) -> None:
    x, w = _randn(1, K, dtype=dtype, seed=0), _randn(N, K, dtype=dtype, seed=1) * 0.2
    b = _randn(N, dtype=dtype, seed=2) if bias else None
    fusion = RowFusion(_randn(K, dtype=dtype, seed=3) if norm else None, 1e-6 if norm else 0.0)
    rotary = RotaryEmbedding(D, 64, default_inv_freq(D, 10000.0)).to(DEVICE)
    positions = torch.tensor([37], device=DEVICE)
    loc = torch.tensor([5], device=DEVICE)
    k_scale, v_scale = (0.5, 0.25) if pool_dtype == torch.float8_e4m3fn else (1.0, 1.0)

    # before: the product, then the rope + store kernel on its output
    qkv = gemv(x, w, b, config, fusion)
    ref_k, ref_v = _pool(pool_dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    apply_rotary_and_store_kv(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, D, ref_k,
                              ref_v, loc, k_scale, v_scale)

    k_cache, v_cache = _pool(pool_dtype)
    rope = RopeStore(positions, rotary.cos_cache, rotary.sin_cache,
                     KVStoreTarget(k_cache, v_cache, loc, k_scale, v_scale), HQ, HKV, D)
    out = gemv(x, w, b, config, fusion, rope=rope)
    _assert_same(out, qkv)  # q and k rotated in place by the reference, v as is
    _assert_same(k_cache, ref_k)
    _assert_same(v_cache, ref_v)
    assert k_cache[loc].float().abs().sum() > 0 and k_cache[:5].float().abs().sum() == 0


@pytest.mark.parametrize("vec", [1, 16])
def test_fp8_gemv_rope_store_matches_fp8_gemv_then_rope_store(vec: int) -> None:
    dtype = torch.float16
    x = _randn(1, K, dtype=dtype, seed=4)
    codes = (_randn(N, K, dtype=torch.float32, seed=5) * 40).to(torch.float8_e4m3fn)
    scale = (torch.rand(N, 1, generator=torch.Generator().manual_seed(6)) * 0.01).to(DEVICE)
    config = GemvConfig(8, 64, 4, 1, vec=vec)
    rotary = RotaryEmbedding(D, 64, default_inv_freq(D, 500000.0)).to(DEVICE)
    positions, loc = torch.tensor([3], device=DEVICE), torch.tensor([8], device=DEVICE)
    qkv = fp8_gemv(x, codes, scale, None, config=config)
    ref_k, ref_v = _pool(dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    apply_rotary_and_store_kv(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, D, ref_k,
                              ref_v, loc)
    k_cache, v_cache = _pool(dtype)
    rope = RopeStore(positions, rotary.cos_cache, rotary.sin_cache,
                     KVStoreTarget(k_cache, v_cache, loc), HQ, HKV, D)
    out = fp8_gemv(x, codes, scale, None, config=config, rope=rope)
    _assert_same(out, qkv)
    _assert_same(k_cache, ref_k)
    _assert_same(v_cache, ref_v)


def test_gemv_rope_refuses_a_block_that_splits_pairs() -> None:
    x, w = _randn(1, K, dtype=torch.float32, seed=0), _randn(N, K, dtype=torch.float32, seed=1)
    rotary = RotaryEmbedding(D, 64, default_inv_freq(D, 10000.0)).to(DEVICE)
    k_cache, v_cache = _pool(torch.float32)
    rope = RopeStore(torch.tensor([1], device=DEVICE), rotary.cos_cache, rotary.sin_cache,
                     KVStoreTarget(k_cache, v_cache, torch.tensor([1], device=DEVICE)), HQ, HKV,
                     D)
    with pytest.raises(AssertionError, match="splits a rope pair"):
        gemv(x, w, config=GemvConfig(32, 32, 4, 1), rope=rope)
