"""A small-batch gate|up product that writes silu(gate) * up itself on the skinny GEMM's tile
(kernels/skinny_gemm.py GATED; LinearBase.gated_rows_product, GatedMLP) against the product and
SiLU-mul apart: the kernel in both operand orders, the tile it takes from the tables, the switch,
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
from radixserve.layers.kernels.skinny_gemm import gated_tile_config, skinny_gemm  # noqa: E402
from radixserve.layers.linear import MergedColumnParallelLinear  # noqa: E402
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


@pytest.mark.parametrize("swap_ab", [1, 0])
@pytest.mark.parametrize("rows,with_bias", [(5, True), (16, False)])
def test_silu_mul_written_by_the_gate_up_tile(swap_ab: int, rows: int, with_bias: bool) -> None:
    """K (160) is not a multiple of BLOCK_K, and the 24 outputs not one of BLOCK_N: the last
    step and the last tile are masked."""
    w, x = _rand(2 * 24, 160, seed=5, scale=0.1), _rand(rows, 160, seed=8)
    bias = _rand(48, seed=7) if with_bias else None
    got = skinny_gemm(x, w, dict(TILE, SWAP_AB=swap_ab), bias=bias, gated=True)
    assert got.shape == (rows, 24) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), SiluAndMul()(F.linear(x, w, bias)).float(), **TOL)


def test_the_gated_tile_comes_from_the_table(table_dir) -> None:
    """The plain product's tile with K unsplit; a "gated" sweep's own tile where written;
    nothing where cuBLAS won by more than the gap, or past the sweep."""
    _write(table_dir, 64, 128, 4, dict(TILE, us=1.0))
    assert gated_tile_config(64, 128, 3) == dict(TILE, SPLIT_K=1)
    own = dict(TILE, BLOCK_N=32, SPLIT_K=1)
    _write(table_dir, 64, 128, 4, dict(TILE, us=1.0, gated=dict(own, us=1.0)))
    assert gated_tile_config(64, 128, 4) == own
    assert gated_tile_config(64, 128, 5) is None
    _write(table_dir, 64, 128, 8, {"kernel": "cublas", "us": 1.0, "triton_us": 9.0,
                                   "triton": TILE})
    assert gated_tile_config(64, 128, 8) is None


def test_a_gated_tile_fits_shared_memory(table_dir) -> None:
    """Two weight tiles per step: the plain product's 128-column tile is halved, and stages
    dropped where the operand tiles would overflow shared memory."""
    wide = dict(TILE, BLOCK_N=128, BLOCK_K=128, num_stages=4)
    _write(table_dir, 256, 128, 8, dict(wide, us=1.0))
    assert gated_tile_config(256, 128, 8) == dict(wide, BLOCK_N=64, SPLIT_K=1)  # 144 KiB
    deep = dict(TILE, BLOCK_N=64, BLOCK_K=256, num_stages=4)
    _write(table_dir, 256, 128, 16, dict(deep, us=1.0))
    assert gated_tile_config(256, 128, 16)["num_stages"] == 3  # 3 x 72 KiB


def _on_the_interpreter(monkeypatch) -> None:
    """The Triton rows' products on this machine's tensors (the interpreter on CPU)."""
    monkeypatch.setattr(linear_module, "_triton_rows", lambda x, weight: (
        x.dim() == 2 and 0 < x.shape[0] <= linear_module.SMALL_M_MAX
        and x.dtype == weight.dtype == DTYPE))


def test_the_switch_and_the_table_decide(table_dir, monkeypatch) -> None:
    _on_the_interpreter(monkeypatch)
    gate_up = MergedColumnParallelLinear(64, [48, 48], bias=True, tp_rank=0, tp_size=1)
    gen = torch.Generator().manual_seed(1)
    for param in gate_up.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    gate_up = gate_up.to(DEVICE, DTYPE)
    x = _rand(12, 64, seed=4)
    _write(table_dir, 96, 64, 16, dict(TILE, us=1.0))
    monkeypatch.setattr(linear_module, "SKINNY_GATED_MIN_ROWS", 0)  # off
    assert gate_up.gated_rows_product(x) is None
    monkeypatch.setattr(linear_module, "SKINNY_GATED_MIN_ROWS", 13)
    assert gate_up.gated_rows_product(x) is None  # below the switch
    monkeypatch.setattr(linear_module, "SKINNY_GATED_MIN_ROWS", 12)
    assert gate_up.gated_rows_product(_rand(17, 64, seed=5)) is None  # past the sweep
    torch.testing.assert_close(gate_up.gated_rows_product(x).float(),
                               SiluAndMul()(gate_up(x)).float(), **TOL)


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


def test_engine_greedy_outputs_unchanged_by_the_gated_tile(checkpoint, table_dir,
                                                           monkeypatch) -> None:
    """Three requests decode together (3 rows; 4 in a CUDA graph): with the tiny Llama's
    gate|up on a tile at 4 rows and the switch on, each MLP's SiLU-mul rides on the tile and
    the tokens stay."""
    _on_the_interpreter(monkeypatch)
    reference = _greedy(checkpoint)
    monkeypatch.setattr(linear_module, "SKINNY_GATED_MIN_ROWS", 2)
    _write(table_dir, 256, 64, 4, dict(TILE, us=1.0))  # hidden 64, intermediate 128
    rows_seen = []
    gated = MergedColumnParallelLinear.gated_rows_product

    def counting(self, x):  # type: ignore[no-untyped-def]
        out = gated(self, x)
        if out is not None:
            rows_seen.append(x.shape[0])
        return out

    monkeypatch.setattr(MergedColumnParallelLinear, "gated_rows_product", counting)
    assert _greedy(checkpoint) == reference
    assert any(2 <= rows <= 4 for rows in rows_seen)
