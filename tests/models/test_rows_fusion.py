"""Small-batch decode's fused products (kernels/fused_rows.py, 2-8 rows; DecoderLayer.forward_fused)
against the unfused layers: the kernel per fusion, the swept tables that switch it on per row
count, and the Engine's greedy tokens on a tiny random checkpoint (Triton interpreter on CPU, in
fp16; bf16 on a GPU)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from radixserve.layers import linear as linear_module  # noqa: E402
from radixserve.layers.activation import SiluAndMul  # noqa: E402
from radixserve.layers.kernels import gemm_tables  # noqa: E402
from radixserve.layers.kernels.fused_rows import RowsConfig, fused_rows, rows_config  # noqa: E402
from radixserve.layers.kernels.gemv import RowFusion  # noqa: E402
from radixserve.layers.linear import RowParallelLinear  # noqa: E402
from radixserve.layers.merged_linear import QKVParallelLinear  # noqa: E402
from radixserve.layers.norm import RMSNorm  # noqa: E402
from radixserve.layers.quantization.fp8 import Fp8Config, fp8_linears  # noqa: E402
from radixserve.models import blocks  # noqa: E402
from tests.models.engine_greedy import engine_greedy_tokens  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: fp16
TOL = dict(atol=3e-2, rtol=3e-2)
CONFIG = RowsConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
VEC_CONFIG = RowsConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, vec=8)
CONFIGS = pytest.mark.parametrize("config", [CONFIG, VEC_CONFIG], ids=["plain_tile", "vec8"])
ENTRY = dict(CONFIG._asdict(), us=1.0)


def _write(table_dir, n: int, k: int, rows: int, variant: str) -> None:
    path = table_dir / f"bf16_N{n}_K{k}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.setdefault(str(rows), {"kernel": "cublas"})[variant] = ENTRY
    path.write_text(json.dumps(table))
    gemm_tables.clear_cache()


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, DTYPE)


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = 1.0 + 0.2 * torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm.to(DEVICE, DTYPE)


@CONFIGS
@pytest.mark.parametrize("rows,with_bias", [(2, False), (5, True), (8, False), (8, True)])
def test_norm_fused_into_the_product(rows: int, with_bias: bool, config: RowsConfig) -> None:
    w, norm = _rand(96, 128, seed=1, scale=0.1), _norm(128, 2)
    bias = _rand(96, seed=3) if with_bias else None
    stream = _rand(rows, 128, seed=4, scale=3.0)
    got = fused_rows(stream, w, config, RowFusion(norm.weight, 1e-5), bias)
    want = F.linear(norm(stream), w, bias)
    assert got.shape == (rows, 96) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@CONFIGS
@pytest.mark.parametrize("rows", [3, 8])
def test_norm_and_silu_fused_into_the_gate_up_product(rows: int, config: RowsConfig) -> None:
    w, norm, bias = _rand(2 * 48, 128, seed=5, scale=0.1), _norm(128, 6), _rand(96, seed=7)
    stream = _rand(rows, 128, seed=8)
    got = fused_rows(stream, w, config, RowFusion(norm.weight, 1e-5, gated=True), bias)
    want = SiluAndMul()(F.linear(norm(stream), w, bias))
    assert got.shape == (rows, 48)  # 48 is not a multiple of block_n: the last tile is masked
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@CONFIGS
@pytest.mark.parametrize("rows", [2, 7])
def test_residual_add_fused_into_the_product(rows: int, config: RowsConfig) -> None:
    w, x = _rand(64, 96, seed=9, scale=0.1), _rand(rows, 96, seed=10)
    stream = _rand(rows, 64, seed=11, scale=4.0)
    got = fused_rows(x, w, config, RowFusion(residual=stream))
    torch.testing.assert_close(got.float(), (F.linear(x, w) + stream).float(), **TOL)


def test_the_table_decides_per_row_count_and_fusion(table_dir) -> None:
    _write(table_dir, 96, 128, 4, "norm")
    assert rows_config(96, 128, 3, "norm") == CONFIG  # the M = 4 entry covers 2-4 rows
    assert rows_config(96, 128, 3, "residual") is None  # another fusion: not swept
    assert rows_config(96, 128, 5, "norm") is None  # past the sweep
    assert rows_config(96, 128, 1, "norm") is None  # one row is the GEMV's
    assert rows_config(96, 128, 9, "norm") is None  # past the kernel's rows


def test_a_table_entry_s_vec_reaches_the_configuration(table_dir) -> None:
    path = table_dir / "bf16_N96_K128.json"
    path.write_text(json.dumps({"8": {"kernel": "cublas", "residual": dict(ENTRY, vec=8)}}))
    gemm_tables.clear_cache()
    assert rows_config(96, 128, 6, "residual") == VEC_CONFIG


def test_linear_runs_the_rows_gemv_where_the_plain_product_won(table_dir) -> None:
    """A "plain" entry (gpu_rows_fusion.py's sweep without fusions) sends linear()'s rows to the
    GEMV widened to M rows; without one, the skinny GEMM / cuBLAS choice stands."""
    linear_module._small_m_kernel.cache_clear()
    try:
        assert linear_module._small_m_kernel(96, 128, 3) is None  # nothing swept
        _write(table_dir, 96, 128, 4, "plain")
        linear_module._small_m_kernel.cache_clear()
        kernel = linear_module._small_m_kernel(96, 128, 3)  # the M = 4 entry covers 3 rows
        assert kernel is not None
        w, x, bias = _rand(96, 128, seed=12, scale=0.1), _rand(3, 128, seed=13), _rand(96, seed=14)
        torch.testing.assert_close(kernel(x, w, bias).float(), F.linear(x, w, bias).float(),
                                   **TOL)
    finally:
        linear_module._small_m_kernel.cache_clear()


def test_the_shipped_rows_entries_are_launchable(as_board) -> None:
    """Every rows-GEMV entry in each board's bf16 tables (at 2+ rows: "plain", or a fusion's
    name; written by benchmarks/gpu_rows_fusion.py) reads back on that board at its row count as
    a configuration whose block_k divides K, in an entry that is not empty (an empty one would
    shadow larger row counts)."""
    from radixserve.layers.kernels.fused_rows import MAX_ROWS, PLAIN
    seen = 0
    paths = []
    for board in gemm_tables.shipped_boards():
        paths += [(board, path) for path in gemm_tables.board_dir(board).glob("bf16_N*_K*.json")]
    for board, path in sorted(paths):
        as_board(board)
        n, k = (int(part[1:]) for part in path.stem.split("_")[1:])
        for m, entry in json.loads(path.read_text()).items():
            assert entry, (path.name, m)
            if m == "1":  # the one-row GEMV's entry (its fusion variants are its own)
                continue
            for variant in (PLAIN, "norm", "norm+gated", "residual"):
                if variant not in entry:
                    continue
                assert int(m) <= MAX_ROWS, (path.name, m, variant)
                config = rows_config(n, k, int(m), "" if variant == PLAIN else variant)
                assert config is not None and k % config.block_k == 0, (path.name, m, variant)
                seen += 1
    assert seen, "the tables carry no rows-GEMV entries"


def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return module.to(DEVICE, DTYPE)


def test_linear_layers_fuse_where_swept(table_dir) -> None:
    qkv = _fill(QKVParallelLinear(64, 16, 4, 2, bias=True, tp_rank=0, tp_size=1), 1)
    down = _fill(RowParallelLinear(128, 64, bias=True, tp_rank=0, tp_size=1), 2)
    assert not qkv.fuses_rows(4, DTYPE, norm=True)
    _write(table_dir, 128, 64, 4, "norm")
    _write(table_dir, 64, 128, 4, "residual")
    assert qkv.fuses_rows(4, DTYPE, norm=True) and not qkv.fuses_rows(8, DTYPE, norm=True)
    assert not qkv.fuses_rows(4, torch.float32, norm=True)
    norm, stream = _norm(64, 3), _rand(4, 64, seed=4)
    torch.testing.assert_close(qkv.fused_row_product(stream, norm=norm).float(),
                               qkv(norm(stream)).float(), **TOL)
    act = _rand(4, 128, seed=5)
    assert down.fuses_rows(4, DTYPE, residual=True)
    torch.testing.assert_close(down.fused_row_product(act, residual=stream).float(),
                               (down(act) + stream).float(), **TOL)
    split = _fill(RowParallelLinear(256, 64, tp_rank=0, tp_size=2), 6)  # K 128 on this rank
    assert not split.fuses_rows(4, DTYPE, residual=True)  # the add waits for the all-reduce
    with fp8_linears(Fp8Config(online=True)):
        quantised = RowParallelLinear(128, 64, tp_rank=0, tp_size=1)
    _fill(quantised, 7).finish_loading()
    assert not quantised.fuses_rows(4, DTYPE, residual=True)  # FP8 rows take their own path


def test_off_switch(table_dir, monkeypatch) -> None:
    down = _fill(RowParallelLinear(128, 64, tp_rank=0, tp_size=1), 2)
    _write(table_dir, 64, 128, 8, "residual")
    assert down.fuses_rows(8, DTYPE, residual=True)
    monkeypatch.setattr(linear_module, "ROW_FUSION_ENABLED", False)
    assert not down.fuses_rows(8, DTYPE, residual=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_biases_i128")
    make_checkpoint("llama_biases_i128", folder)
    return str(folder)


def _greedy(checkpoint: str) -> list[list[int]]:
    return engine_greedy_tokens(checkpoint, (30, 37, 44), 4,
                                dtype="float16" if DEVICE == "cpu" else "bfloat16")


@pytest.mark.slow_interpreted  # 7 s interpreted
def test_engine_greedy_outputs_unchanged_by_the_fused_rows(checkpoint, table_dir,
                                                           monkeypatch) -> None:
    """Three requests decode together (3 rows; 4 in a CUDA graph): with every product of the
    tiny Llama swept at 4 rows, each layer runs `forward_fused` and the tokens stay."""
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    monkeypatch.setattr(linear_module, "ROW_FUSION_ENABLED", False)
    reference = _greedy(checkpoint)
    monkeypatch.setattr(linear_module, "ROW_FUSION_ENABLED", True)
    # hidden 64, q|k|v 64 + 2 x 2 x 16, intermediate 128
    for (n, k), variant in {(128, 64): "norm", (64, 64): "residual", (256, 64): "norm+gated",
                            (64, 128): "residual"}.items():
        _write(table_dir, n, k, 4, variant)
    rows_seen = []
    fused = blocks.DecoderLayer.forward_fused

    def counting(self, positions, hidden, *args):  # type: ignore[no-untyped-def]
        rows_seen.append(hidden.shape[0])
        return fused(self, positions, hidden, *args)

    monkeypatch.setattr(blocks.DecoderLayer, "forward_fused", counting)
    assert _greedy(checkpoint) == reference
    assert any(2 <= rows <= 4 for rows in rows_seen)
