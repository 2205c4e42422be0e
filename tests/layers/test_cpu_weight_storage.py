"""layers/cpu_linear.py keep_checkpoint_dtype: a bf16 checkpoint computed in float32 keeps its
linear and embedding weights in bf16, with outputs unchanged bit for bit (the GEMV widens the
same values, the packed path packs a float32 copy of them)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import radixserve
from radixserve.config import cpu_computes_natively
from radixserve.layers.cpu_linear import keep_checkpoint_dtype
from radixserve.layers.linear import ReplicatedLinear, linear
from tests.models.tiny_checkpoints import make_checkpoint

PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [8] * 3, [11, 12], [20, 21, 22],
           [30, 31], [40, 41, 42, 43]]
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen2_bias", "llama_tied_mha",
                                        # 12 s; --run-slow
                                        pytest.param("deepseek_v2_lite_mla",
                                                     marks=pytest.mark.slow)])
def bf16_checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, folder).to(torch.bfloat16).save_pretrained(folder)
    return request.param, str(folder)


def _outputs(folder: str, dtype: str, keep: bool) -> tuple[list, dict[str, torch.dtype]]:
    engine = radixserve.Engine(folder, dtype=dtype, skip_tokenizer_init=True, device="cpu")
    try:
        model = engine._runner.model
        if keep:
            assert keep_checkpoint_dtype(model, torch.bfloat16) > 0
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        one = engine.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS)  # the GEMV
        many = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)  # GEMV and packed
        return [o["output_ids"] for o in one + many], dtypes
    finally:
        engine.shutdown()


def test_kept_weights_give_the_same_outputs(bf16_checkpoint) -> None:
    name, folder = bf16_checkpoint
    reference, _ = _outputs(folder, "float32", keep=False)
    kept, dtypes = _outputs(folder, "float32", keep=True)
    assert kept == reference
    narrow = {n for n, d in dtypes.items() if d == torch.bfloat16}
    assert any("embed_tokens" in n for n in narrow)
    assert any("o_proj" in n for n in narrow)
    if name == "deepseek_v2_lite_mla":  # read directly by the absorbed MLA path
        assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.float32
    assert all(d == torch.float32 for n, d in dtypes.items() if "norm" in n or "bias" in n)


@pytest.mark.skipif(cpu_computes_natively(torch.bfloat16),
                    reason="this CPU computes bf16 natively: auto keeps bf16 compute")
def test_auto_dtype_keeps_the_checkpoint_dtype_where_bf16_is_emulated(bf16_checkpoint) -> None:
    _, folder = bf16_checkpoint
    reference, _ = _outputs(folder, "float32", keep=False)
    auto, dtypes = _outputs(folder, "auto", keep=False)
    assert auto == reference
    assert any(d == torch.bfloat16 for d in dtypes.values())


def test_values_bf16_would_round_stay_float32() -> None:
    layer = ReplicatedLinear(8, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 8))  # not bf16 values
    assert keep_checkpoint_dtype(layer, torch.bfloat16) == 0
    assert layer.weight.dtype == torch.float32
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    assert keep_checkpoint_dtype(layer, torch.bfloat16) == 4 * 8 * 2
    assert layer.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_a_bf16_weight_under_float32_gives_its_float32_copys_product(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    narrow = torch.randn(48, 40, generator=gen).bfloat16()
    x = torch.randn(rows, 40, generator=gen)
    bias = torch.randn(48, generator=gen)
    for b in (None, bias):
        got = linear(x, nn.Parameter(narrow, requires_grad=False), b)
        ref = linear(x, nn.Parameter(narrow.float(), requires_grad=False), b)
        assert got.dtype == torch.float32
        assert torch.equal(got, ref)
