"""The one-launch decode MLP (kernels/dataflow_mlp.py; interpreter on CPU at small shapes) against
the three-kernel MLP's arithmetic, over repeated launches (the counters must come back to zero)
and shapes whose last tiles and K slices are partial."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from radixserve.layers.kernels.dataflow_mlp import (DataflowMlpConfig, dataflow_mlp,  # noqa: E402
                                                    env_choice, supports)

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # interpreter: fp16


def _reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The unfused MLP rounded as the GPU kernels round it: gate|up's output in x's dtype,
    silu in float32 rounded, the product rounded, down in float32."""
    inter = down.shape[1]
    gu = (x.float() @ gate_up.float().t()).to(x.dtype).float()
    silu = F.silu(gu[:, :inter]).to(x.dtype).float()
    act = (silu * gu[:, inter:]).to(x.dtype).float()
    return act @ down.float().t()


def _operands(rows: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(DTYPE)
    gate_up = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DTYPE)
    down = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(DTYPE)
    return x, gate_up, down


@pytest.mark.parametrize("rows,hidden,inter,cfg", [
    (1, 64, 128, DataflowMlpConfig(block_h=16, block_n=16, block_k=32, splits=2,
                                   num_warps=4, num_stages=2)),
    (8, 96, 160, DataflowMlpConfig(block_h=16, block_n=32, block_k=32, splits=3,
                                   num_warps=4, num_stages=2)),
    (16, 64, 200, DataflowMlpConfig(block_h=32, block_n=16, block_k=64, splits=4,
                                    num_warps=4, num_stages=3)),
    (5, 80, 96, DataflowMlpConfig(block_h=16, block_n=32, block_k=32, splits=1,
                                  num_warps=4, num_stages=2)),
])
def test_dataflow_mlp_matches_the_unfused_mlp(rows, hidden, inter, cfg) -> None:
    x, gate_up, down = _operands(rows, hidden, inter, rows * 1000 + inter)
    want = _reference(x, gate_up, down)
    xd, gud, dd = x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE)
    assert supports(xd, gud, dd, cfg)
    for _ in range(3):  # every launch leaves the ticket and slice counters at zero
        got = dataflow_mlp(xd, gud, dd, cfg)
        assert got.shape == (rows, hidden) and got.dtype == DTYPE
        torch.testing.assert_close(got.float().cpu(), want, atol=5e-3, rtol=1e-2)


_COMPILE_ONE_TILE = """
from radixserve.layers.kernels import dataflow_mlp as m
from tests.hopper_compile import compile_for_hopper
compile_for_hopper(m._dataflow_mlp_kernel, dict(
    X="*bf16", WGU="*bf16", WD="*bf16", Y="*bf16", Hbuf="*bf16", Work="*fp32", Sync="*i32",
    M=1, HID=64, INTER=32, k_per_split=32, gate_up_tiles=1, n_tiles=1, splits=1, stride_x=64,
    stride_wgu=64, stride_wd=32, stride_y=64, BLOCK_M=m.MAX_ROWS, BLOCK_H=32, BLOCK_N=64,
    BLOCK_K=32, MAX_SPLITS=m.MAX_SPLITS, USE_PDL=True), num_warps=4, num_stages=2)
print("compiled")
"""


def test_kernel_compiles_for_hopper_with_counts_of_one() -> None:
    """One row, one gate|up tile, one down tile, one K slice: the GPU launcher makes each of
    those 1s a compile-time constant (the interpreter never does; on the H100 a one-tile launch
    once failed to compile for that), so the kernel is compiled for sm_90 here."""
    from tests.hopper_compile import compile_in_fresh_process
    result = compile_in_fresh_process(_COMPILE_ONE_TILE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled"]


def test_dataflow_mlp_counters_return_to_zero() -> None:
    from radixserve.core.tile_counters import tile_counters
    from radixserve.layers.kernels.dataflow_mlp import SYNC_WORDS
    cfg = DataflowMlpConfig(block_h=16, block_n=16, block_k=32, splits=2, num_warps=4,
                            num_stages=2)
    x, gate_up, down = _operands(3, 32, 64, 5)
    dataflow_mlp(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), cfg)
    assert int(tile_counters(torch.device(DEVICE), SYNC_WORDS).abs().sum()) == 0


def test_supports_rejects_what_the_kernel_cannot_take() -> None:
    cfg = DataflowMlpConfig()
    x, gate_up, down = _operands(4, 64, 128, 1)
    assert supports(x, gate_up, down, cfg)
    assert not supports(torch.cat([x] * 5), gate_up, down, cfg)  # 20 rows
    assert not supports(x, gate_up[:100], down, cfg)  # gate|up not 2 x intermediate
    assert not supports(x.float(), gate_up, down, cfg)  # dtypes differ
    assert not supports(x, gate_up, down.t().contiguous().t(), cfg)  # columns not contiguous


def test_env_choice(monkeypatch) -> None:
    from radixserve.layers.kernels.dataflow_mlp import MEASURED_SHAPES
    monkeypatch.delenv("RADIXSERVE_DATAFLOW_MLP", raising=False)
    assert env_choice(4096, 14336) == MEASURED_SHAPES[(4096, 14336)] == (DataflowMlpConfig(), 12)
    assert env_choice(8192, 3584) is None  # a shape not measured keeps the three kernels
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "1")
    assert env_choice(4096, 14336) == (DataflowMlpConfig(), 12)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "0")
    assert env_choice(4096, 14336) is None
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "64,128,64,7,8,3")
    assert env_choice(8192, 3584) == (DataflowMlpConfig(64, 128, 64, 7, 8, 3), 1)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "64,128")
    with pytest.raises(ValueError, match="six integers"):
        env_choice(4096, 14336)


def _measure_shape(monkeypatch, hidden: int, inter: int, min_rows: int = 12) -> int:
    """Pretend the default configuration was measured ahead at this shape from min_rows."""
    from radixserve.layers.kernels import dataflow_mlp as kernel_module
    monkeypatch.setitem(kernel_module.MEASURED_SHAPES, (hidden, inter),
                        (DataflowMlpConfig(), min_rows))
    return min_rows


def _gated_mlp(hidden: int, inter: int):
    from radixserve.models.blocks import GatedMLP
    mlp = GatedMLP(hidden, inter)
    gen = torch.Generator().manual_seed(11)
    for param in mlp.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return mlp.to(DEVICE, DTYPE)


def _count_launches(monkeypatch) -> list[int]:
    from radixserve.layers.kernels import dataflow_mlp as kernel_module
    from radixserve.models import blocks
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    launches: list[int] = []
    real = kernel_module.dataflow_mlp
    monkeypatch.setattr(kernel_module, "dataflow_mlp",
                        lambda *args: launches.append(args[0].shape[0]) or real(*args))
    return launches


def test_gated_mlp_runs_in_one_launch_at_the_default_rows(monkeypatch) -> None:
    """Unset, the one launch takes a measured shape's rows (its fewest to 16) and leaves fewer
    (and more) to the three kernels, with the three kernels' result; a shape not measured
    keeps the three kernels."""
    launches = _count_launches(monkeypatch)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    monkeypatch.delenv("RADIXSERVE_DATAFLOW_MLP", raising=False)
    assert _gated_mlp(64, 96)(x).shape == (16, 64) and launches == []  # not measured
    min_rows = _measure_shape(monkeypatch, 64, 96)
    counts = (min_rows - 1, min_rows, 16)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "0")
    three = _gated_mlp(64, 96)
    wanted = [three(x[:rows]).float() for rows in counts]
    monkeypatch.delenv("RADIXSERVE_DATAFLOW_MLP")
    mlp = _gated_mlp(64, 96)
    for rows, want in zip(counts, wanted):
        torch.testing.assert_close(mlp(x[:rows]).float(), want, atol=2e-2, rtol=2e-2)
    assert mlp(torch.cat([x, x[:2]])).shape == (18, 64)  # past 16 rows: three kernels
    assert launches == [min_rows, 16]


def test_gated_mlp_runs_in_one_launch_when_asked(monkeypatch) -> None:
    launches = _count_launches(monkeypatch)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "0")
    want = _gated_mlp(64, 96)(x)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "16,32,32,2,4,2")
    mlp = _gated_mlp(64, 96)
    got = mlp(x)
    assert launches == [6]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fp8_gated_mlp_keeps_the_three_kernels(monkeypatch) -> None:
    """FP8 weights (quantised at load) never take the one launch, asked or not: its FP8 form
    lost to the three FP8 kernels and was removed."""
    from radixserve.layers.quantization.fp8 import Fp8Config, fp8_linears
    from radixserve.models import blocks
    launches = _count_launches(monkeypatch)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "16,32,32,2,4,2")
    with fp8_linears(Fp8Config(online=True)):
        mlp = blocks.GatedMLP(64, 128)
    for param in mlp.parameters():
        param.data = (torch.randn(param.shape) * 0.1).to(DTYPE)
    mlp = mlp.to(DEVICE)
    mlp.gate_up_proj.finish_loading()
    mlp.down_proj.finish_loading()
    assert mlp._dataflow_config(torch.randn(4, 64).to(DEVICE, DTYPE)) is None
    assert launches == []


# the Engine in the interpreter takes ~20 s a case: CI skips it, the GPU runs it (a no-op mark
# there). Three rows under a configuration of the test's own; thirteen under the default, with
# the tiny model's shape entered as measured from 12 rows (the decode graph pads 13 to 16)
@(pytest.mark.usefixtures() if torch.cuda.is_available() else pytest.mark.slow)
@pytest.mark.parametrize("setting,lengths", [
    ("16,32,32,2,4,2", (30, 41, 17)),
    ("1", (30, 41, 17, 5, 9, 12, 20, 3, 33, 8, 14, 26, 11))], ids=["asked", "default"])
def test_engine_greedy_outputs_unchanged_by_the_one_launch_mlp(tmp_path, monkeypatch, setting,
                                                               lengths) -> None:
    import json
    from tests.models.engine_greedy import engine_greedy_tokens
    from tests.models.tiny_checkpoints import make_checkpoint
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    min_rows = _measure_shape(monkeypatch, config["hidden_size"], config["intermediate_size"])

    def greedy() -> list[list[int]]:
        return engine_greedy_tokens(str(tmp_path), lengths, 5, dtype="float16")

    launches = _count_launches(monkeypatch)
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", "0")
    reference = greedy()
    assert launches == []
    monkeypatch.setenv("RADIXSERVE_DATAFLOW_MLP", setting)
    assert greedy() == reference
    # decode steps ran the MLP in one launch (on the GPU, at the graphs' padded batch sizes
    # when they were captured), the default only at its fewest rows or more
    assert launches and (setting != "1" or min(launches) >= min_rows), launches
