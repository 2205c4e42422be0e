"""Batch-1 decode's fused one-row kernels (kernels/gemv.py RowFusion, DecoderLayer.forward_fused)
against the unfused layers: per linear (bf16-style fp16 and FP8 weights, the Triton interpreter on
CPU) and through the Engine on a tiny random checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import radixserve  # noqa: E402
from radixserve.layers import linear as linear_module  # noqa: E402
from radixserve.layers.activation import SiluAndMul  # noqa: E402
from radixserve.layers.linear import RowParallelLinear  # noqa: E402
from radixserve.layers.merged_linear import (MergedColumnParallelLinear,  # noqa: E402
                                             QKVParallelLinear)
from radixserve.layers.norm import RMSNorm  # noqa: E402
from radixserve.layers.quantization.fp8 import Fp8Config, fp8_linears  # noqa: E402
from radixserve.models import blocks  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16


def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        if param.dtype.is_floating_point and param.element_size() > 1:
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return module.to(DEVICE, DTYPE)


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = 1.0 + 0.2 * torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm.to(DEVICE, DTYPE)


def _row(size: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, size, generator=gen) * scale).to(DEVICE, DTYPE)


def _quantised(make):  # the layer with per-channel FP8 weights, quantised at load
    with fp8_linears(Fp8Config(online=True)):
        layer = make()
    _fill(layer, 7)
    layer.finish_loading()
    return layer


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_fused_into_the_qkv_product(fp8: bool) -> None:
    make = lambda: QKVParallelLinear(128, 32, 4, 2, bias=True, tp_rank=0, tp_size=1)  # noqa
    layer = _quantised(make) if fp8 else _fill(make(), 1)
    norm, stream = _norm(128, 2), _row(128, 3, scale=3.0)
    assert layer.fuses_one_row(DTYPE)
    got = layer.fused_row_product(stream, norm=norm)
    want = layer(norm(stream))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_and_silu_fused_into_the_gate_up_product(fp8: bool) -> None:
    make = lambda: MergedColumnParallelLinear(128, [64, 64], bias=True, tp_rank=0,  # noqa
                                              tp_size=1)
    layer = _quantised(make) if fp8 else _fill(make(), 4)
    norm, stream = _norm(128, 5), _row(128, 6)
    got = layer.fused_row_product(stream, norm=norm, gated=True)
    want = SiluAndMul()(layer(norm(stream)))
    assert got.shape == (1, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_residual_add_fused_into_the_down_product(fp8: bool) -> None:
    make = lambda: RowParallelLinear(256, 128, bias=True, tp_rank=0, tp_size=1)  # noqa
    layer = _quantised(make) if fp8 else _fill(make(), 8)
    x, stream = _row(256, 9), _row(128, 10, scale=4.0)
    assert layer.fuses_one_row(DTYPE, residual=True)
    got = layer.fused_row_product(x, residual=stream)
    want = layer(x) + stream
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_what_does_not_fuse() -> None:
    # the ranks' partial sums must be reduced before the residual add
    row = _fill(RowParallelLinear(256, 128, tp_rank=0, tp_size=2), 1)
    assert row.fuses_one_row(DTYPE) and not row.fuses_one_row(DTYPE, residual=True)
    odd = _fill(RowParallelLinear(100, 128, tp_rank=0, tp_size=1), 1)  # no block divides K
    assert not odd.fuses_one_row(DTYPE, residual=True)
    fp32 = RowParallelLinear(256, 128, tp_rank=0, tp_size=1)  # float32 stays on cuBLAS
    assert not fp32.fuses_one_row(torch.float32)


def test_off_switch(monkeypatch) -> None:
    layer = _fill(RowParallelLinear(256, 128, tp_rank=0, tp_size=1), 1)
    assert layer.fuses_one_row(DTYPE)
    monkeypatch.setattr(linear_module, "ROW_FUSION_ENABLED", False)
    assert not layer.fuses_one_row(DTYPE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_biases_i128")
    make_checkpoint("llama_biases_i128", folder)
    return str(folder)


def _greedy(checkpoint: str, with_logprobs: bool = False, **args):
    """The greedy tokens of one request (and, with_logprobs, their log-probabilities)."""
    engine = radixserve.Engine(checkpoint, dtype="float16", skip_tokenizer_init=True,
                               max_total_tokens=2000, **args)
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    # one request: every decode step is one row (few steps: the interpreter is slow)
    out = engine.generate(input_ids=[prompt], sampling_params={
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        return_logprob=with_logprobs)
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    engine.shutdown()
    if with_logprobs:
        return out[0]["output_ids"], [lp for lp, _ in out[0]["meta_info"]["output_token_logprobs"]]
    return out[0]["output_ids"]


@pytest.mark.slow_interpreted  # 14 s interpreted; the fused layer against the unfused one
# above, in CI
def test_engine_greedy_outputs_unchanged_by_the_fused_layers(checkpoint, monkeypatch) -> None:
    reference = _greedy(checkpoint)
    calls = []
    fused = blocks.DecoderLayer.forward_fused

    def counting(self, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fused(self, *args)

    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    monkeypatch.setattr(blocks.DecoderLayer, "forward_fused", counting)
    assert _greedy(checkpoint) == reference
    # 2 layers x the decode steps after the first token (with CUDA graphs: at capture only)
    assert len(calls) == 2 * 3 or (torch.cuda.is_available() and calls)


@pytest.mark.slow_interpreted
def test_engine_greedy_outputs_with_fp8_rows_on_the_tensor_cores(checkpoint, monkeypatch) -> None:
    """FP8 weights: every fused one-row product on kernels/fp8_mma_rows.py (two activation
    terms, K split in two) gives the greedy tokens of the GEMV."""
    from radixserve.layers.kernels import fp8_mma_rows
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    monkeypatch.setattr(fp8_mma_rows, "ENABLED", False)
    reference = _greedy(checkpoint, quantization="fp8")
    configs = []
    monkeypatch.setattr(fp8_mma_rows, "ENABLED", True)
    monkeypatch.setattr(fp8_mma_rows, "tuned_config", lambda n, k, m, variant="": configs.append(
        variant) or fp8_mma_rows.MmaRowsConfig(64, 64, 4, 2, x_terms=2, split_k=2))
    assert _greedy(checkpoint, quantization="fp8") == reference
    assert {"norm", "norm+gated", "residual"} <= set(configs)


def test_block_scaled_fp8_gate_up_with_norm_matches_the_dequantised_product() -> None:
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_gemm_reference
    from radixserve.layers.kernels.gemv import RowFusion, fp8_gemv
    gen = torch.Generator().manual_seed(11)
    n, k, block = 48, 256, 64
    scale = torch.rand(n, k // block, generator=gen) * 0.01 + 0.001
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    norm, stream = _norm(k, 12), _row(k, 13, scale=2.0)
    got = fp8_gemv(stream, codes.to(DEVICE), scale.to(DEVICE), block,
                   fusion=RowFusion(norm.weight, norm.variance_epsilon, gated=True))
    product = fp8_weight_gemm_reference(norm(stream).cpu(), codes, scale, block).to(DTYPE)
    want = F.silu(product[:, :n // 2]) * product[:, n // 2:]
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_swept_variant_configuration_is_used(table_dir) -> None:
    import json

    from radixserve.layers.kernels.gemv import (GemvConfig, RowFusion, gemv_config,
                                                row_config)
    (table_dir / "bf16_N128_K256.json").write_text(json.dumps({"1": {"norm+gated": dict(
        block_n=2, block_k=128, num_warps=2, num_stages=1)}}))
    (table_dir / "fp8_N128_K256.json").write_text(json.dumps({"1": {
        "block_n": 4, "block_k": 256, "num_warps": 4, "num_stages": 2, "vec": 16,
        "residual": dict(block_n=8, block_k=128, num_warps=4, num_stages=3, vec=16)}}))
    norm = torch.ones(256)
    assert row_config("bf16", 128, 256, RowFusion(norm, 1e-5, gated=True)) == \
        GemvConfig(2, 128, 2, 1)  # an entry without "vec" (written before it) has 1
    # entries with "vec" (the FP8 sweeps since session 32) keep it, plain and fused
    assert row_config("fp8", 128, 256, RowFusion()) == GemvConfig(4, 256, 4, 2, vec=16)
    assert row_config("fp8", 128, 256, RowFusion(residual=torch.ones(128))) == \
        GemvConfig(8, 128, 4, 3, vec=16)
    plain = gemv_config(128, 256)
    assert row_config("bf16", 128, 256, RowFusion(norm, 1e-5)) == plain  # not swept
    assert row_config("bf16", 64, 256, RowFusion(norm, 1e-5, gated=True)) == \
        plain._replace(block_n=plain.block_n // 2)  # no table: half rows per half


# ~30 s in the interpreter; test_gemv_rope.py checks the product bitwise in CI
@pytest.mark.slow_interpreted
def test_engine_greedy_outputs_with_rope_and_store_in_the_qkv_gemv(checkpoint,
                                                                   monkeypatch) -> None:
    """Decode on the Triton backend (the interpreter on CPU; prefill on torch's, through the
    hybrid backend): the one-row q|k|v GEMV rotates q and k and stores K/V itself
    (kernels/gemv_rope.py), bitwise as the rope + store kernel it replaces, so the greedy
    tokens and their log-probabilities are those without it, and the pool's accounting is
    unchanged."""
    from radixserve.layers.kernels import gemv_rope
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    args = dict(prefill_attention_backend="torch_native", decode_attention_backend="triton",
                disable_cuda_graph=True, with_logprobs=True)
    monkeypatch.setattr(gemv_rope, "ENABLED", False)
    reference = _greedy(checkpoint, **args)
    monkeypatch.setattr(gemv_rope, "ENABLED", True)
    carried = []
    store = blocks.DecoderAttention.rope_store

    def recording(self, *rest):  # type: ignore[no-untyped-def]
        rope = store(self, *rest)
        carried.append(rope is not None)
        return rope

    monkeypatch.setattr(blocks.DecoderAttention, "rope_store", recording)
    tokens, logprobs = _greedy(checkpoint, **args)
    assert tokens == reference[0]
    if torch.cuda.is_available():  # the reordered rows' sums may round one unit apart there
        torch.testing.assert_close(logprobs, reference[1], atol=2e-2, rtol=0.0)
    else:
        assert logprobs == reference[1]
    assert carried == [True] * (2 * 3)  # 2 layers x the decode steps after the first token


@pytest.mark.parametrize("qk_norm,partial_rope,carries", [
    (False, False, True), (True, False, False), (False, True, False)])
def test_which_attention_layers_carry_rope_in_the_qkv_gemv(qk_norm: bool, partial_rope: bool,
                                                           carries: bool) -> None:
    """Per-head q/k norms (Qwen3) sit between the product and rope, and a partial rope pairs
    dims the GEMV's programs do not: both keep the rope + store kernel. Otherwise the layer
    hands the product the backend's target, or nothing when the backend stores K/V itself."""
    from types import SimpleNamespace

    import transformers

    from radixserve.core.model_config import ModelConfig
    from radixserve.layers.rotary import RotaryEmbedding
    from radixserve.mem.kv_pool import KVStoreTarget
    config = ModelConfig(transformers.LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
        partial_rotary_factor=0.5 if partial_rope else 1.0))
    attn = _fill(blocks.DecoderAttention(config, 0, RotaryEmbedding.from_config(config),
                                         qk_norm=qk_norm), 1)
    target = KVStoreTarget(torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), torch.tensor([1]))
    positions = torch.tensor([5])

    def batch(offered: "KVStoreTarget | None") -> SimpleNamespace:
        return SimpleNamespace(attn_backend=SimpleNamespace(
            kv_store_target=lambda layer, forward_batch: offered))

    rope = attn.rope_store(positions, _norm(64, 2), DTYPE, batch(target))
    assert (rope is not None) == carries
    if carries:
        assert rope.target is target and rope.positions is positions
        assert (rope.num_q_heads, rope.num_kv_heads, rope.head_dim) == (4, 2, 16)
        assert attn.rope_store(positions, _norm(64, 2), DTYPE, batch(None)) is None
