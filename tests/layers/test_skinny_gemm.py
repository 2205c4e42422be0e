"""The skinny decode GEMM (Triton; interpreter on CPU at small shapes) against torch, with and
without split K, and the swept-configuration tables that route decode-sized products to it."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels import gemm_tables  # noqa: E402
from radixserve.layers.kernels.skinny_gemm import default_config, skinny_gemm  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: fp16


@pytest.mark.parametrize("m,n,k,split,block_n", [(2, 48, 256, 1, 16), (8, 64, 512, 4, 32),
                                                 (16, 40, 384, 2, 16), (20, 32, 256, 1, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("swap_ab", [0, 1])
def test_skinny_gemm_matches_torch(m, n, k, split, block_n, with_bias, swap_ab) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE) if with_bias else None
    cfg = dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n, BLOCK_K=64, SPLIT_K=split,
               SWAP_AB=swap_ab, num_warps=4, num_stages=2)
    got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), cfg,
                      bias=None if bias is None else bias.to(DEVICE))
    want = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    assert got.dtype == DTYPE and got.shape == (m, n)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block", [None, 64])
def test_skinny_gemm_swapped_over_fp8_codes(block) -> None:
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_gemm_reference
    gen = torch.Generator().manual_seed(7)
    n, k, m = 48, 256, 5
    scale = torch.rand(n, 1 if block is None else k // block, generator=gen) * 0.01 + 0.001
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, SWAP_AB=1, num_warps=4,
               num_stages=2)
    got = skinny_gemm(x.to(DEVICE), codes.to(DEVICE), cfg, scale.to(DEVICE), block)
    want = fp8_weight_gemm_reference(x, codes, scale, block)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


def test_default_config_splits_k_only_for_small_batches() -> None:
    small = default_config(8, 4096, 14336, None)
    assert small["BLOCK_M"] == 16 and small["SPLIT_K"] > 1
    assert default_config(8, 128256, 4096, None)["SPLIT_K"] == 1  # tiles enough already
    assert default_config(512, 4096, 4096, None)["BLOCK_M"] == 128
    assert default_config(8, 4096, 4096, 64)["BLOCK_K"] == 64  # inside one scale group


def test_tuned_entry_uses_the_smallest_swept_row_count_covering_m(table_dir) -> None:
    gemv = {"block_n": 4, "block_k": 128, "num_warps": 4, "num_stages": 2, "us": 1.0}
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4,
            "num_stages": 3, "us": 2.0}
    (table_dir / "bf16_N64_K256.json").write_text(json.dumps(
        {"1": gemv, "4": {"kernel": "cublas"}, "16": tile}))
    assert gemm_tables.tuned_entry("bf16", 64, 256, 1) == gemv
    assert gemm_tables.tuned_entry("bf16", 64, 256, 3) == {"kernel": "cublas"}
    assert gemm_tables.tuned_entry("bf16", 64, 256, 5) == tile
    assert gemm_tables.tuned_entry("bf16", 64, 256, 17) is None  # past the sweep
    assert gemm_tables.tuned_entry("fp8", 64, 256, 4) is None  # no table for this kind
    (table_dir / "fp8_N64_K256.json").write_text(json.dumps({"8": tile}))
    assert gemm_tables.tuned_entry("fp8", 64, 256, 1) is None  # a tile entry never serves M=1


def test_linear_dispatch_follows_the_table(table_dir) -> None:
    from radixserve.layers import linear as linear_module
    from radixserve.layers.kernels.gemv import GemvConfig, tuned_gemv_config
    tile = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4,
            "num_stages": 2}
    (table_dir / "bf16_N48_K256.json").write_text(json.dumps(
        {"1": {"block_n": 8, "block_k": 128, "num_warps": 4, "num_stages": 2},
         "2": {"kernel": "cublas"}, "8": tile}))
    linear_module._small_m_kernel.cache_clear()
    try:
        assert tuned_gemv_config("bf16", 48, 256) == GemvConfig(8, 128, 4, 2)
        assert linear_module._small_m_kernel(48, 256, 2) is None  # cuBLAS won at M <= 2
        kernel = linear_module._small_m_kernel(48, 256, 6)
        assert kernel is not None
        x = torch.randn(6, 256).to(DTYPE)
        w = (torch.randn(48, 256) / 16).to(DTYPE)
        got = kernel(x.to(DEVICE), w.to(DEVICE), None)
        torch.testing.assert_close(got.float().cpu(), x.float() @ w.float().t(),
                                   atol=2e-2, rtol=2e-2)
    finally:
        linear_module._small_m_kernel.cache_clear()


def test_a_vendor_entry_yields_its_triton_tile_only_within_the_gap(monkeypatch) -> None:
    from radixserve.layers.kernels import fp8_gemm, skinny_gemm
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "SWAP_AB": 1,
            "num_warps": 4, "num_stages": 3}
    entry = {"kernel": "cublas", "us": 15.0, "triton_us": 16.5, "triton": tile}
    assert skinny_gemm.config_from_entry(entry, vendor_gap_us=0.0) is None  # the sweep's pick
    assert skinny_gemm.config_from_entry(entry, vendor_gap_us=1.0) is None  # 1.5 us slower
    assert skinny_gemm.config_from_entry(entry, vendor_gap_us=2.0) == tile
    assert skinny_gemm.config_from_entry({"kernel": "cublas", "us": 15.0, "triton_us": 15.0},
                                         vendor_gap_us=2.0) is None  # no tile kept
    fp8_entry = dict(entry, kernel="scaled_mm")
    monkeypatch.setattr(skinny_gemm, "VENDOR_GAP_US", 0.0)
    assert fp8_gemm._wants_scaled_mm(fp8_entry, 40)
    monkeypatch.setattr(skinny_gemm, "VENDOR_GAP_US", 2.0)  # the tile runs instead
    assert not fp8_gemm._wants_scaled_mm(fp8_entry, 40)
    assert skinny_gemm.config_from_entry(fp8_entry) == tile


def _shipped_bf16_tiles() -> list[dict[str, int]]:
    from radixserve.layers.kernels.skinny_gemm import CONFIG_KEYS, config_from_entry
    tiles = set()
    paths = [path for board in gemm_tables.shipped_boards()
             for path in sorted(gemm_tables.board_dir(board).glob("bf16_*.json"))]
    for path in paths:
        for entry in json.loads(path.read_text()).values():
            cfg = config_from_entry(entry, vendor_gap_us=0.0)
            if cfg is not None:
                tiles.add(tuple(cfg[key] for key in CONFIG_KEYS))
    return [dict(zip(CONFIG_KEYS, tile)) for tile in sorted(tiles)]


@pytest.mark.parametrize("cfg", _shipped_bf16_tiles(), ids=lambda cfg: "-".join(
    str(value) for value in cfg.values()))
def test_every_shipped_bf16_tile_computes_the_product(cfg: dict[str, int]) -> None:
    """Each distinct tile the package's tables name (session 25 added tiles chosen by a decode
    step A/B rather than a sweep) at a small shape that takes its K split and two N tiles."""
    m, n, k = cfg["BLOCK_M"] // 2 + 1, 2 * cfg["BLOCK_N"], 2 * cfg["BLOCK_K"] * cfg["SPLIT_K"]
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DTYPE)
    got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), cfg)
    torch.testing.assert_close(got.float().cpu(), x.float() @ w.float().t(), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("last_reduces", [True, False], ids=["last", "atomic"])
@pytest.mark.parametrize("m,n,k,split,with_bias,swap_ab", [
    (3, 48, 512, 4, True, 1), (20, 64, 384, 3, False, 0), (8, 40, 256, 2, True, 0)])
def test_split_k_sums(monkeypatch, m, n, k, split, with_bias, swap_ab, last_reduces) -> None:
    """Split K, both ways: the tile's last program adds the partials (the default: one launch,
    no zeroed buffer, no cast back; the counters are left at zero for the next launch, so a
    second product over the same counters is right too), or float32 atomics into a zeroed
    buffer cast back (RADIXSERVE_SKINNY_SPLIT_REDUCE=atomic)."""
    from radixserve.core import tile_counters as counters_module
    from radixserve.layers.kernels import skinny_gemm as module
    monkeypatch.setattr(module, "SPLIT_LAST_REDUCES", last_reduces)
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE) if with_bias else None
    cfg = dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=16, BLOCK_K=64, SPLIT_K=split,
               SWAP_AB=swap_ab, num_warps=4, num_stages=2)
    want = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    for _ in range(2):
        got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), cfg,
                          bias=None if bias is None else bias.to(DEVICE))
        assert got.dtype == DTYPE and got.shape == (m, n)
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    assert all(int(c.count_nonzero()) == 0 for c in counters_module._COUNTERS.values())


def test_split_k_summed_by_the_last_program_over_fp8_codes(monkeypatch) -> None:
    from radixserve.layers.kernels import skinny_gemm as module
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_gemm_reference
    monkeypatch.setattr(module, "SPLIT_LAST_REDUCES", True)
    gen = torch.Generator().manual_seed(9)
    n, k, m, block = 48, 256, 5, 64
    scale = torch.rand(n, k // block, generator=gen) * 0.01 + 0.001
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, SWAP_AB=1, num_warps=4,
               num_stages=2)
    got = skinny_gemm(x.to(DEVICE), codes.to(DEVICE), cfg, scale.to(DEVICE), block)
    torch.testing.assert_close(got.float().cpu(), fp8_weight_gemm_reference(x, codes, scale,
                                                                             block),
                               atol=2e-2, rtol=2e-2)
