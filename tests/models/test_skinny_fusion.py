"""Small-batch decode's neighbours fused into the skinny GEMM's tiles (kernels/skinny_gemm.py
`fusion=`; LinearBase.fused_row_product past the rows GEMV) against the unfused layers: the
kernel per fusion and operand order, the tile each product takes from the tables, the switch,
and the Engine's greedy tokens on a tiny random checkpoint (Triton interpreter on CPU, in fp16;
bf16 on a GPU)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # read when a kernel is decorated: before the imports below
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import radixserve  # noqa: E402
from radixserve.layers import linear as linear_module  # noqa: E402
from radixserve.layers.activation import SiluAndMul  # noqa: E402
from radixserve.layers.kernels import gemm_tables  # noqa: E402
from radixserve.layers.kernels.gemv import RowFusion  # noqa: E402
from radixserve.layers.kernels.skinny_gemm import fused_tile_config, skinny_gemm  # noqa: E402
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402
from radixserve.layers.norm import RMSNorm  # noqa: E402
from radixserve.models import blocks  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: fp16
TOL = dict(atol=3e-2, rtol=3e-2)
TILE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, SWAP_AB=1, num_warps=4,
            num_stages=2)


def _write(table_dir, n: int, k: int, rows: int, entry: dict) -> None:
    path = table_dir / f"bf16_N{n}_K{k}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    table[str(rows)] = entry
    path.write_text(json.dumps(table))
    gemm_tables.clear_cache()


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, DTYPE)


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = 1.0 + 0.2 * torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm.to(DEVICE, DTYPE)


@pytest.mark.parametrize("swap_ab", [1, 0])
@pytest.mark.parametrize("rows,with_bias", [(3, True), (16, False)])
def test_norm_fused_into_the_tile(swap_ab: int, rows: int, with_bias: bool) -> None:
    """K (160) is not a multiple of BLOCK_K: the last step's columns are masked, and their
    squares must not count."""
    w, norm = _rand(40, 160, seed=1, scale=0.1), _norm(160, 2)
    bias = _rand(40, seed=3) if with_bias else None
    stream = _rand(rows, 160, seed=4, scale=3.0)
    got = skinny_gemm(stream, w, dict(TILE, SWAP_AB=swap_ab), bias=bias,
                      fusion=RowFusion(norm.weight, 1e-5))
    assert got.shape == (rows, 40) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), F.linear(norm(stream), w, bias).float(), **TOL)


@pytest.mark.parametrize("swap_ab", [1, 0])
def test_norm_and_silu_fused_into_the_gate_up_tile(swap_ab: int) -> None:
    w, norm, bias = _rand(2 * 24, 128, seed=5, scale=0.1), _norm(128, 6), _rand(48, seed=7)
    stream = _rand(5, 128, seed=8)
    got = skinny_gemm(stream, w, dict(TILE, SWAP_AB=swap_ab), bias=bias,
                      fusion=RowFusion(norm.weight, 1e-5, gated=True))
    want = SiluAndMul()(F.linear(norm(stream), w, bias))
    assert got.shape == (5, 24)  # 24 is not a multiple of BLOCK_N: the last tile is masked
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@pytest.mark.parametrize("swap_ab", [1, 0])
def test_residual_add_fused_into_the_tile(swap_ab: int) -> None:
    w, x = _rand(48, 96, seed=9, scale=0.1), _rand(6, 96, seed=10)
    stream = _rand(6, 48, seed=11, scale=4.0)
    got = skinny_gemm(x, w, dict(TILE, SWAP_AB=swap_ab), fusion=RowFusion(residual=stream))
    torch.testing.assert_close(got.float(), (F.linear(x, w) + stream).float(), **TOL)


def test_the_fused_tile_comes_from_the_table(table_dir) -> None:
    """The plain product's tile with K unsplit; a variant's own tile where swept; nothing where
    cuBLAS won by more than the gap, or past the sweep."""
    _write(table_dir, 64, 128, 4, dict(TILE, us=1.0))
    assert fused_tile_config(64, 128, 3, "norm") == dict(TILE, SPLIT_K=1)
    own = dict(TILE, BLOCK_N=32, SPLIT_K=1)
    _write(table_dir, 64, 128, 4, dict(TILE, us=1.0, norm=dict(own, us=1.0)))
    assert fused_tile_config(64, 128, 4, "norm") == own
    assert fused_tile_config(64, 128, 4, "residual") == dict(TILE, SPLIT_K=1)
    assert fused_tile_config(64, 128, 5, "norm") is None
    _write(table_dir, 64, 128, 8, {"kernel": "cublas", "us": 1.0, "triton_us": 9.0,
                                   "triton": TILE})
    assert fused_tile_config(64, 128, 8, "norm") is None


def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return module.to(DEVICE, DTYPE)


def test_linear_layers_fuse_on_tiles_from_the_switch_on(table_dir, monkeypatch) -> None:
    gate_up = _fill(MergedColumnParallelLinear(64, [48, 48], tp_rank=0, tp_size=1), 1)
    down = _fill(RowParallelLinear(48, 64, bias=True, tp_rank=0, tp_size=1), 2)
    _write(table_dir, 96, 64, 16, dict(TILE, us=1.0))
    _write(table_dir, 64, 48, 16, dict(TILE, us=1.0))
    monkeypatch.setattr(linear_module, "SKINNY_FUSION_MIN_ROWS", 0)  # off
    assert not gate_up.fuses_rows(12, DTYPE, norm=True, gated=True)
    monkeypatch.setattr(linear_module, "SKINNY_FUSION_MIN_ROWS", 12)
    assert not gate_up.fuses_rows(11, DTYPE, norm=True, gated=True)  # below the switch
    assert not gate_up.fuses_rows(17, DTYPE, norm=True, gated=True)  # past MAX_FUSED_ROWS
    assert not gate_up.fuses_rows(12, torch.float32, norm=True, gated=True)
    assert gate_up.fuses_rows(12, DTYPE, norm=True, gated=True)
    norm, stream = _norm(64, 3), _rand(12, 64, seed=4)
    torch.testing.assert_close(
        gate_up.fused_row_product(stream, norm=norm, gated=True).float(),
        SiluAndMul()(gate_up(norm(stream))).float(), **TOL)
    act = _rand(12, 48, seed=5)
    assert down.fuses_rows(12, DTYPE, residual=True)
    torch.testing.assert_close(down.fused_row_product(act, residual=stream).float(),
                               (down(act) + stream).float(), **TOL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_biases_i128")
    make_checkpoint("llama_biases_i128", folder)
    return str(folder)


def _greedy(checkpoint: str) -> list[list[int]]:
    engine = radixserve.Engine(checkpoint, dtype="float16" if DEVICE == "cpu" else "bfloat16",
                               skip_tokenizer_init=True, max_total_tokens=2000)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (30 + 7 * i,), generator=gen).tolist() for i in range(3)]
    out = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    engine.shutdown()
    return [o["output_ids"] for o in out]


def test_engine_greedy_outputs_unchanged_by_the_fused_tiles(checkpoint, table_dir,
                                                            monkeypatch) -> None:
    """Three requests decode together (3 rows; 4 in a CUDA graph): with every product of the
    tiny Llama on a tile at 4 rows and the switch on, each layer runs `forward_fused` on the
    tiles (the rows GEMV has no entry) and the tokens stay."""
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    reference = _greedy(checkpoint)
    monkeypatch.setattr(linear_module, "SKINNY_FUSION_MIN_ROWS", 2)
    # hidden 64, q|k|v 64 + 2 x 2 x 16, intermediate 128
    for n, k in ((128, 64), (64, 64), (256, 64), (64, 128)):
        _write(table_dir, n, k, 4, dict(TILE, us=1.0))
    rows_seen = []
    fused = blocks.DecoderLayer.forward_fused

    def counting(self, positions, hidden, *args):  # type: ignore[no-untyped-def]
        rows_seen.append(hidden.shape[0])
        return fused(self, positions, hidden, *args)

    monkeypatch.setattr(blocks.DecoderLayer, "forward_fused", counting)
    assert _greedy(checkpoint) == reference
    assert any(2 <= rows <= 4 for rows in rows_seen)


def test_a_gated_tile_fits_shared_memory(table_dir) -> None:
    """A gate|up product loads two weight tiles per step: the plain product's 128-column tile
    is halved, and stages dropped where the operand tiles would overflow shared memory."""
    wide = dict(TILE, BLOCK_N=128, BLOCK_K=128, num_stages=4)
    _write(table_dir, 256, 128, 8, dict(wide, us=1.0))
    assert fused_tile_config(256, 128, 8, "norm+gated") == dict(wide, BLOCK_N=64, SPLIT_K=1)
    assert fused_tile_config(256, 128, 8, "norm") == dict(wide, SPLIT_K=1)  # 144 KiB: fits
    deep = dict(TILE, BLOCK_N=64, BLOCK_K=256, num_stages=4)
    _write(table_dir, 256, 128, 16, dict(deep, us=1.0))
    assert fused_tile_config(256, 128, 16, "norm+gated")["num_stages"] == 3  # 3 x 72 KiB
