"""The FP8 tensor-core kernel for decode rows (kernels/fp8_mma_rows.py; the Triton interpreter on
CPU at small shapes) against the dequantised product, with each one-row fusion, and the table
entries that route decode products to it."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from radixserve.layers.kernels import fp8_mma_rows as mma_rows, gemm_tables  # noqa: E402
from radixserve.layers.kernels.fp8_gemm import (fp8_rows_product,  # noqa: E402
                                                fp8_weight_gemm_reference)
from radixserve.layers.kernels.fp8_mma_rows import MmaRowsConfig, fp8_mma_rows  # noqa: E402
from radixserve.layers.kernels.gemv import RowFusion  # noqa: E402
from tests.triton_interpreter import fix_fp8_rounding  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

fix_fp8_rounding()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: fp16
SMALL = MmaRowsConfig(block_n=64, block_k=64, num_warps=4, num_stages=2)


def _weights(n: int, k: int, block: int | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, 1 if block is None else k // block, generator=gen) * 0.01 + 0.001
    return codes, scale


def _rows(m: int, k: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # a few large columns, as real activations have, so a step's scale is not one number
    x = torch.randn(m, k, generator=gen) * (1 + spread * (torch.rand(k, generator=gen) > 0.97))
    return x.to(DTYPE)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("block", [None, 64])
def test_rows_match_the_dequantised_product(m: int, block: int | None) -> None:
    codes, scale = _weights(96, 256, block, seed=m)  # 96: the second program is half masked
    x = _rows(m, 256, seed=m + 1, spread=20.0)
    bias = torch.randn(96).to(DTYPE)
    got = fp8_mma_rows(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), block, SMALL,
                       bias.to(DEVICE))
    want = fp8_weight_gemm_reference(x, codes, scale, block) + bias.float()
    assert got.shape == (m, 96) and got.dtype == DTYPE
    assert _relative_error(got, want) < 8e-3


@pytest.mark.parametrize("m,split", [(1, 4), (5, 3)])
def test_split_k_programs_add_up_in_the_last_to_arrive(m: int, split: int) -> None:
    codes, scale = _weights(96, 512, 64, seed=20 + m)
    x = _rows(m, 512, seed=21, spread=20.0)
    config = SMALL._replace(split_k=split)
    want = fp8_weight_gemm_reference(x, codes, scale, 64)
    for _ in range(2):  # the second launch finds the tile counters back at zero
        got = fp8_mma_rows(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), 64, config=config)
        assert _relative_error(got, want) < 8e-3
    from radixserve.core.tile_counters import tile_counters
    assert not tile_counters(got.device, 2).any()


@pytest.mark.parametrize("m,split", [(1, 1), (6, 2)])
def test_rows_already_quantised(m: int, split: int) -> None:
    from radixserve.layers.kernels.per_token_quant import per_token_quant_reference
    codes, scale = _weights(96, 256, None, seed=30 + m)
    x = _rows(m, 256, seed=31, spread=20.0)
    x_codes, x_scale = per_token_quant_reference(x, torch.float8_e4m3fn)
    stream = _rows(m, 96, seed=32)
    got = fp8_mma_rows(x_codes.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None,
                       config=SMALL._replace(split_k=split), x_scale=x_scale.to(DEVICE),
                       out_dtype=DTYPE, fusion=RowFusion(residual=stream.to(DEVICE)))
    dequantised = x_codes.float() * x_scale
    want = fp8_weight_gemm_reference(dequantised, codes, scale, None) + stream.float()
    assert got.dtype == DTYPE and _relative_error(got, want) < 8e-3


@pytest.mark.parametrize("m,split", [(17, 1), (40, 2), (128, 1)])
def test_more_rows_of_codes_take_a_larger_row_tile(m: int, split: int) -> None:
    """Past 16 rows of activation codes the MMA's row tile grows to the next power of two
    (32, 64, 128): every row still gets its own product, the padding rows are not stored."""
    from radixserve.layers.kernels.per_token_quant import per_token_quant_reference
    assert mma_rows.block_rows(m) == max(16, 1 << (m - 1).bit_length())
    codes, scale = _weights(64, 256, None, seed=40 + m)
    x = _rows(m, 256, seed=41, spread=20.0)
    x_codes, x_scale = per_token_quant_reference(x, torch.float8_e4m3fn)
    got = fp8_mma_rows(x_codes.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None,
                       config=SMALL._replace(split_k=split), x_scale=x_scale.to(DEVICE),
                       out_dtype=DTYPE)
    want = fp8_weight_gemm_reference(x_codes.float() * x_scale, codes, scale, None)
    assert got.shape == (m, 64) and _relative_error(got, want) < 8e-3
    for row in (0, m // 2, m - 1):  # each row against its own product, not a neighbour's
        assert _relative_error(got[row:row + 1], want[row:row + 1]) < 8e-3


def test_rows_quantised_in_registers_stop_at_sixteen() -> None:
    codes, scale = _weights(64, 256, None, seed=50)
    with pytest.raises(AssertionError):
        fp8_mma_rows(_rows(17, 256, seed=51).to(DEVICE), codes.to(DEVICE), scale.to(DEVICE),
                     None, config=SMALL)


def test_the_second_activation_term_restores_bf16_precision() -> None:
    codes, scale = _weights(64, 512, None, seed=3)
    x = _rows(4, 512, seed=4, spread=50.0)
    want = fp8_weight_gemm_reference(x, codes, scale, None)
    errors = {terms: _relative_error(fp8_mma_rows(
        x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None,
        config=SMALL._replace(x_terms=terms)), want) for terms in (1, 2)}
    # one e4m3 term: ~2^-4 per element; two: ~2^-8, the output's own rounding
    assert errors[2] < 5e-3 < errors[1] and errors[2] * 4 < errors[1]


def _norm_weight(k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.2 * torch.randn(k, generator=gen)).to(DTYPE)


def _rms_normed(stream: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    s = stream.float()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE) * weight


@pytest.mark.parametrize("m,split", [(1, 1), (3, 1), (1, 2)])
def test_norm_fused_in_the_prologue(m: int, split: int) -> None:
    codes, scale = _weights(128, 256, None, seed=5)
    stream, weight = _rows(m, 256, seed=6) * 3, _norm_weight(256, 7)
    got = fp8_mma_rows(stream.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None,
                       config=SMALL._replace(split_k=split),
                       fusion=RowFusion(weight.to(DEVICE), 1e-5))
    want = fp8_weight_gemm_reference(_rms_normed(stream, weight), codes, scale, None)
    assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize("m,block,split", [(2, None, 1), (2, 64, 1), (1, 64, 2)])
def test_norm_and_silu_of_gate_up(m: int, block: int | None, split: int) -> None:
    codes, scale = _weights(256, 256, block, seed=8)  # gate rows 0-127, up rows 128-255
    stream, weight = _rows(m, 256, seed=9), _norm_weight(256, 10)
    got = fp8_mma_rows(stream.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), block,
                       config=SMALL._replace(split_k=split),
                       fusion=RowFusion(weight.to(DEVICE), 1e-5, gated=True))
    product = fp8_weight_gemm_reference(_rms_normed(stream, weight), codes, scale, block)
    want = F.silu(product[:, :128]) * product[:, 128:]
    assert got.shape == (m, 128)
    assert _relative_error(got, want) < 2e-2


@pytest.mark.parametrize("m,split", [(3, 1), (1, 3)])
def test_residual_add_in_the_epilogue(m: int, split: int) -> None:
    codes, scale = _weights(64, 512, None, seed=11)
    x, stream = _rows(m, 512, seed=12), _rows(m, 64, seed=13) * 4
    got = fp8_mma_rows(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None,
                       config=SMALL._replace(split_k=split),
                       fusion=RowFusion(residual=stream.to(DEVICE)))
    want = fp8_weight_gemm_reference(x, codes, scale, None) + stream.float()
    assert _relative_error(got, want) < 1e-2


def test_a_swept_entry_routes_rows_to_the_kernel(table_dir, monkeypatch) -> None:
    swept = dict(block_n=64, block_k=128, num_warps=4, num_stages=2, x_terms=2, split_k=2,
                 us=1.0)
    (table_dir / "fp8_N64_K256.json").write_text(json.dumps({
        "1": {"block_n": 4, "block_k": 128, "num_warps": 4, "num_stages": 2,
              "mma": {"residual": swept}},
        "8": {"kernel": "scaled_mm", "mma": {"": swept}}}))
    assert mma_rows.tuned_config(64, 256, 1, "residual") == MmaRowsConfig(64, 128, 4, 2, 2, 2)
    assert mma_rows.tuned_config(64, 256, 1, "") is None  # the plain GEMV won at M = 1
    assert mma_rows.tuned_config(64, 256, 6, "") == MmaRowsConfig(64, 128, 4, 2, 2, 2)
    assert mma_rows.tuned_config(64, 256, 9, "") is None  # past the sweep
    # a block-scaled weight keeps each step inside one scale group
    assert mma_rows.within_group(MmaRowsConfig(64, 256, 4, 2), 64).block_k == 64

    launched = []
    real = mma_rows.fp8_mma_rows
    monkeypatch.setattr(mma_rows, "fp8_mma_rows",
                        lambda *args: launched.append(args[4]) or real(*args))
    codes, scale = _weights(64, 256, None, seed=14)
    x = _rows(6, 256, seed=15)
    got = fp8_rows_product(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None)
    assert launched == [MmaRowsConfig(64, 128, 4, 2, 2, 2)]
    assert _relative_error(got, fp8_weight_gemm_reference(x, codes, scale, None)) < 8e-3
    # one plain row: the FP8 GEMV; and nothing for 6 rows once the kernel is switched off
    assert fp8_rows_product(x[:1].to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None) \
        is not None and len(launched) == 1
    monkeypatch.setattr(mma_rows, "ENABLED", False)
    assert fp8_rows_product(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None) is None


def test_codes_entries_cover_up_to_128_rows(table_dir) -> None:
    """A "codes" entry swept at 64 rows serves 17-64 rows of activation codes (the smallest
    swept row count at or above), nothing past 128."""
    from radixserve.layers.kernels.fp8_gemm import fp8_codes_config
    swept = dict(block_n=128, block_k=128, num_warps=8, num_stages=3, x_terms=1, split_k=1,
                 us=1.0)
    (table_dir / "fp8_N64_K256.json").write_text(json.dumps({
        "16": {"mma": {"codes": dict(swept, block_n=64)}},
        "64": {"kernel": "scaled_mm", "mma": {"codes": swept}},
        "128": {"kernel": "scaled_mm"}}))
    assert fp8_codes_config(64, 256, 9, None).block_n == 64
    assert fp8_codes_config(64, 256, 40, None) == MmaRowsConfig(128, 128, 8, 3, 1, 1)
    assert fp8_codes_config(64, 256, 100, None) is None  # the 128-row sweep kept scaled_mm
    assert fp8_codes_config(64, 256, 129, None) is None  # past the kernel's rows


@pytest.mark.parametrize("margin_us,takes_codes", [(5.0, True), (1.0, False)])
def test_rows_past_sixteen_quantise_for_the_codes_kernel_where_that_pays(
        table_dir, monkeypatch, margin_us: float, takes_codes: bool) -> None:
    """A linear of 17-128 bf16 rows (o_proj in the FP8 rows layer) runs per_token_quant and the
    codes kernel only when the swept margin over the incumbent covers the quantising pass."""
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_matmul
    swept = dict(block_n=64, block_k=64, num_warps=4, num_stages=2, x_terms=1, split_k=1,
                 us=10.0, base_us=10.0 + margin_us)
    (table_dir / "fp8_N64_K256.json").write_text(json.dumps({
        "64": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP_AB": 0,
               "num_warps": 4, "num_stages": 2, "us": 20.0, "mma": {"codes": swept}}}))
    launched = []
    real = mma_rows.fp8_mma_rows
    monkeypatch.setattr(mma_rows, "fp8_mma_rows", lambda *args, **kw: launched.append(
        kw.get("x_scale") is not None) or real(*args, **kw))
    codes, scale = _weights(64, 256, None, seed=60)
    x = _rows(40, 256, seed=61)
    got = fp8_weight_matmul(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None, None)
    assert launched == ([True] if takes_codes else [])
    # one e4m3 term per activation (~2^-4 relative each) on the codes path
    assert _relative_error(got, fp8_weight_gemm_reference(x, codes, scale, None)) < 3e-2


def test_an_entry_of_other_sweeps_only_leaves_the_vendor_choice_to_the_row_count(
        table_dir) -> None:
    """A row count whose entry holds only the tensor-core kernel's configurations (the codes
    sweep at 128 rows) keeps _scaled_mm from 64 rows on, as a row count with no entry does;
    where the tile sweep decided, its choice stands."""
    from radixserve.layers.kernels.fp8_gemm import SCALED_MM_MIN_TOKENS, _wants_scaled_mm
    from radixserve.layers.kernels.gemm_tables import tuned_entry
    codes = dict(block_n=64, block_k=64, num_warps=4, num_stages=2, x_terms=1, split_k=1,
                 us=10.0, base_us=11.0)
    tiles = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP_AB": 0,
             "num_warps": 4, "num_stages": 2, "us": 20.0}
    (table_dir / "fp8_N64_K256.json").write_text(json.dumps({
        "32": tiles, "64": {"kernel": "scaled_mm"}, "128": {"mma": {"codes": codes}}}))
    assert not _wants_scaled_mm(tuned_entry("fp8", 64, 256, 20), 20)  # the tiles won
    assert _wants_scaled_mm(tuned_entry("fp8", 64, 256, 50), 50)  # the vendor kernel won
    assert _wants_scaled_mm(tuned_entry("fp8", 64, 256, 100), 100)  # codes-only entry
    assert _wants_scaled_mm(None, SCALED_MM_MIN_TOKENS)
    assert not _wants_scaled_mm({}, SCALED_MM_MIN_TOKENS - 1)


def test_a_sweep_leaves_no_empty_entry(table_dir) -> None:
    """benchmarks/gpu_fp8_mma.py drops a row count's entry once its last configuration goes (an
    empty entry would shadow the larger row counts' entries)."""
    from benchmarks.gpu_fp8_mma import store
    config = dict(block_n=64, block_k=64, num_warps=4, num_stages=2, x_terms=1, split_k=1)
    store("gate_up", 64, 256, 128, "codes", config)
    assert json.loads((table_dir / "fp8_N64_K256.json").read_text()) == {
        "128": {"mma": {"codes": config}}}
    store("gate_up", 64, 256, 128, "codes", None)
    assert json.loads((table_dir / "fp8_N64_K256.json").read_text()) == {}


@pytest.mark.parametrize("board", gemm_tables.shipped_boards())
def test_the_shipped_tables_entries_are_launchable(board: str, as_board) -> None:
    """Every "mma" entry in each board's fp8 tables reads back on that board as a configuration
    that divides its K (benchmarks/gpu_fp8_mma.py wrote them)."""
    as_board(board)
    seen = 0
    for path in sorted(gemm_tables.board_dir(board).glob("fp8_N*_K*.json")):
        n, k = (int(part[1:]) for part in path.stem.split("_")[1:])
        for m, entry in json.loads(path.read_text()).items():
            assert entry, (path.name, m)  # an empty entry shadows larger row counts
            for variant in entry.get("mma", {}):
                config = mma_rows.tuned_config(n, k, int(m), variant)
                assert config is not None and k % config.block_k == 0, (path.name, m, variant)
                assert config.block_n in (64, 128) and config.x_terms in (1, 2)
                assert config.split_k >= 1 and k // config.split_k >= config.block_k
                seen += 1
    assert seen, "the tables carry no tensor-core entries"
