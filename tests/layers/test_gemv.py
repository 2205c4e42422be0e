"""The Triton GEMV (one-token linear layers) against torch, and the `linear` dispatch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels.gemv import (GemvConfig, RowFusion, fp8_gemv,  # noqa: E402
                                            gemv, gemv_config)
from radixserve.layers.linear import ReplicatedLinear, linear  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,config", [
    (40, 64, GemvConfig(8, 32, 4, 1)),     # N not a multiple of BLOCK_N: masked rows
    (64, 256, GemvConfig(16, 64, 4, 2)),
    (3, 128, GemvConfig(4, 128, 2, 1)),    # fewer rows than one block
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_torch(dtype: torch.dtype, n: int, k: int, config: GemvConfig,
                            with_bias: bool) -> None:
    x, w = randn(1, k, dtype=dtype, seed=0), randn(n, k, dtype=dtype, seed=1)
    bias = randn(n, dtype=dtype, seed=2) if with_bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    out = gemv(x, w, bias, config)
    assert out.shape == (1, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol * k ** 0.5, rtol=tol)


def test_gemv_vector_input_and_strided_weight_rows() -> None:
    big = randn(48, 96, dtype=torch.float32, seed=3)
    w = big[:, :64]  # rows strided by 96, contiguous within a row
    x = randn(64, dtype=torch.float32, seed=4)
    out = gemv(x, w, config=GemvConfig(8, 32, 4, 1))
    assert out.shape == (48,)
    torch.testing.assert_close(out, w @ x, atol=1e-4, rtol=1e-5)


def test_gemv_config_classes() -> None:
    assert gemv_config(4096, 4096) == GemvConfig(4, 512, 8, 4)
    assert gemv_config(6144, 4096) == GemvConfig(8, 512, 4, 3)
    assert gemv_config(128256, 4096) == GemvConfig(16, 256, 4, 3)
    assert gemv_config(4096, 14336) == GemvConfig(2, 1024, 8, 2)
    assert gemv_config(1536, 576).block_k == 64  # SmolLM2-135M's hidden size
    assert gemv_config(100, 100) is None  # no block size divides K: cuBLAS takes it
    with pytest.raises(ValueError):
        gemv(torch.zeros(100), torch.zeros(8, 100))


def test_linear_layer_keeps_nn_linear_parameters() -> None:
    layer = ReplicatedLinear(8, 4, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias", "weight"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(linear(x[:1], layer.weight), x[:1] @ layer.weight.T)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (128256, 4096)])
def test_gemv_real_shapes_bf16_gpu(n: int, k: int) -> None:
    x = randn(1, k, dtype=torch.bfloat16, seed=5)
    w = randn(n, k, dtype=torch.bfloat16, seed=6) * 0.02
    ref = torch.nn.functional.linear(x.float(), w.float())
    out = linear(x, w)  # the dispatch picks the GEMV for one bf16 row on CUDA
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


def test_pdl_is_off_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.core import triton_pdl as pdl
    assert pdl.pdl_launch_args(torch.zeros(1)) == {"USE_PDL": False}
    monkeypatch.setenv("RADIXSERVE_PDL", "1")
    pdl.disable_pdl()
    assert pdl.pdl_launch_args(torch.zeros(1)) == {"USE_PDL": False}


@pytest.mark.parametrize("fusion_kind", ["plain", "norm", "norm+gated", "residual"])
@pytest.mark.parametrize("weights", ["fp16", "fp8 per row", "fp8 per 64-column group"])
def test_vec_accumulation_matches_the_plain_tile(fusion_kind: str, weights: str) -> None:
    """GemvConfig.vec: each thread's contiguous columns summed before they are accumulated
    (a [BLOCK_N, BLOCK_K / vec, vec] tile) gives the plain tile's product, with every fusion
    and FP8 scale kind (masked rows included: N is not a multiple of BLOCK_N)."""
    n, k = 44, 256
    x = randn(1, k, dtype=torch.float16, seed=21) * 2
    rows = 2 * n if fusion_kind == "norm+gated" else n
    fusion = RowFusion(
        norm_weight=randn(k, dtype=torch.float16, seed=22) if "norm" in fusion_kind else None,
        eps=1e-5, gated=fusion_kind == "norm+gated",
        residual=randn(n, dtype=torch.float16, seed=23) if fusion_kind == "residual" else None)
    if weights == "fp16":
        w = randn(rows, k, dtype=torch.float16, seed=24) * 0.1
        product = lambda config: gemv(x, w, config=config, fusion=fusion)  # noqa: E731
    else:
        group = 64 if "group" in weights else None
        scale = randn(rows, 1 if group is None else k // group, dtype=torch.float32,
                      seed=25).abs() * 0.01 + 0.001
        codes = (randn(rows, k, dtype=torch.float32, seed=26) * 100).clamp(-448, 448).to(
            torch.float8_e4m3fn)
        product = lambda config: fp8_gemv(x, codes, scale, group, config=config,  # noqa: E731
                                          fusion=fusion)
    plain, vec = (product(GemvConfig(8, 128, 4, 2, vec=vec)) for vec in (1, 16))
    assert vec.shape == plain.shape == (1, n)
    torch.testing.assert_close(vec.float(), plain.float(), atol=2e-3, rtol=2e-3)
    assert plain.float().abs().sum() > 0


@pytest.mark.parametrize("fusion_kind", ["plain", "norm+gated", "residual"])
@pytest.mark.parametrize("block_k,vec", [(64, 1), (256, 1), (256, 16), (512, 16)])
def test_fp8_steps_over_several_scale_groups(fusion_kind: str, block_k: int, vec: int,
                                             monkeypatch) -> None:
    """Block-scaled FP8 codes (64-column groups here, 128 in DeepSeek-V3's and Qwen3-FP8's
    checkpoints) with a BLOCK_K step of one group or of 4 and 8 side by side: each product
    column takes its own group's scale (masked rows included)."""
    from radixserve.layers.kernels import gemv as gemv_module
    monkeypatch.setattr(gemv_module, "WIDE_GROUP_STEPS", True)
    n, k, group = 44, 1024, 64
    rows = 2 * n if fusion_kind == "norm+gated" else n
    x = randn(1, k, dtype=torch.float16, seed=31)
    norm_weight = randn(k, dtype=torch.float16, seed=32) if "norm" in fusion_kind else None
    residual = randn(n, dtype=torch.float16, seed=33) if fusion_kind == "residual" else None
    fusion = RowFusion(norm_weight=norm_weight, eps=1e-5, gated=fusion_kind == "norm+gated",
                       residual=residual)
    scale = randn(rows, k // group, dtype=torch.float32, seed=34).abs() * 0.01 + 0.001
    codes = (randn(rows, k, dtype=torch.float32, seed=35) * 100).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    config = GemvConfig(8, block_k, 4, 2, vec=vec)
    assert gemv_module.fp8_gemv_config(codes, scale, group, config, fusion).block_k == block_k
    got = fp8_gemv(x, codes, scale, group, config=config, fusion=fusion).float()
    inp = x.float()
    if norm_weight is not None:
        inp = inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()
    weight = codes.float() * scale.repeat_interleave(group, dim=1)
    want = inp @ weight.t()
    if fusion.gated:
        gate, up = want[:, :n].half().float(), want[:, n:].half().float()
        want = torch.nn.functional.silu(gate).half().float() * up
    if residual is not None:
        want = want.half().float() + residual.float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
