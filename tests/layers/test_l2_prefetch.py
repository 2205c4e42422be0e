"""L2 prefetch of a decode layer's weights before attention (layers/weight_prefetch.py,
kernels/l2_prefetch.py): the plan's spelling, the bytes it names, that a layer asks for the
weights it holds now, and on a Hopper GPU that the kernel runs and changes no result."""
from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from radixserve.config import ModelConfig
from radixserve.layers import weight_prefetch
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.layers.weight_prefetch import PrefetchPlan
from radixserve.models import blocks


def test_plan_spelling() -> None:
    plan = PrefetchPlan.parse("o=1, gu=0.25")
    assert plan is not None and plan.shares == (("o", 1.0), ("gu", 0.25))
    assert PrefetchPlan.parse("down").shares == (("down", 1.0),)
    assert PrefetchPlan.parse("") is None and PrefetchPlan.parse("0") is None


@pytest.mark.parametrize("spec", ["qkv=1", "o=0", "o=1.5", "gu=-0.1"])
def test_plan_refuses_unknown_weights_and_shares(spec: str) -> None:
    with pytest.raises(ValueError, match="RADIXSERVE_L2_PREFETCH"):
        PrefetchPlan.parse(spec)


def test_prefetched_bytes_are_a_prefix_in_16_byte_units() -> None:
    pytest.importorskip("triton")
    from radixserve.layers.kernels.l2_prefetch import prefetch_bytes
    weight = torch.empty(12, 10, dtype=torch.bfloat16)  # 240 bytes
    assert prefetch_bytes(weight, 1.0) == 240
    assert prefetch_bytes(weight, 0.5) == 112  # 120 rounded down
    assert prefetch_bytes(weight, 0.01) == 0


def test_plan_applies_only_to_small_cuda_batches() -> None:
    plan = PrefetchPlan.parse("o=1", max_rows=8)
    assert not weight_prefetch.applies(plan, torch.zeros(1, 4))  # CPU
    assert not weight_prefetch.applies(None, torch.zeros(1, 4))


def _layer() -> blocks.DecoderLayer:
    config = ModelConfig(transformers.LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    return blocks.DecoderLayer(config, 0, RotaryEmbedding.from_config(config))


@pytest.mark.parametrize("in_attention", [False, True])
def test_the_layer_names_the_weights_it_holds_when_asked(monkeypatch,
                                                         in_attention: bool) -> None:
    """The plan's weights are read at each step, so a weight replaced after loading (FP8's
    codes, a loader's new parameter) is the one prefetched; a kernel of its own issues them,
    or the attention kernel (`RadixAttention.decode_prefetch`), never both."""
    pytest.importorskip("triton")
    layer = _layer()
    asked: list[dict[str, torch.Tensor]] = []
    plan = PrefetchPlan.parse("o=1,gu=0.5", in_attention=in_attention)
    monkeypatch.setattr(weight_prefetch, "env_plan", lambda: plan)
    monkeypatch.setattr(weight_prefetch, "applies", lambda p, rows: p is plan)
    monkeypatch.setattr(weight_prefetch, "prefetch_weights",
                        lambda p, weights: asked.append(weights))
    mlp = layer.mlp
    mlp.gate_up_proj.weight = nn.Parameter(torch.zeros_like(mlp.gate_up_proj.weight))
    rows = torch.zeros(1, 8)
    layer.self_attn.prefetch_for_attention(rows)
    from_attention = layer.self_attn.attn.decode_prefetch(rows)
    o, gate_up = layer.self_attn.o_proj.weight, mlp.gate_up_proj.weight
    if in_attention:
        assert asked == [] and from_attention is not None
        (first, first_bytes), (second, second_bytes) = from_attention.weights
        assert first is o and first_bytes == o.numel() * o.element_size()
        assert second is gate_up and second_bytes == gate_up.numel() * gate_up.element_size() // 2
    else:
        assert from_attention is None and len(asked) == 1
        assert asked[0]["o"] is o and asked[0]["gu"] is gate_up
        assert asked[0]["down"] is mlp.down_proj.weight


def test_the_attention_kernel_prefetches_at_most_two_weights() -> None:
    with pytest.raises(ValueError, match="at most two"):
        PrefetchPlan.parse("o=1,gu=1,down=1")
    assert PrefetchPlan.parse("o=1,gu=1,down=1", in_attention=False) is not None


def test_prefetch_skips_weights_the_layer_lacks(monkeypatch) -> None:
    """An MoE layer has no gate|up of its own: a plan naming it prefetches only o."""
    pytest.importorskip("triton")
    from radixserve.layers.kernels import l2_prefetch
    launched: list[tuple[int, int]] = []
    monkeypatch.setattr(l2_prefetch, "prefetch_to_l2",
                        lambda t, nbytes, chunk, before: launched.append((t.numel(), nbytes)))
    o = torch.zeros(8, 8, dtype=torch.bfloat16)
    weight_prefetch.prefetch_weights(PrefetchPlan.parse("o=0.5,gu=1", in_attention=False),
                                     {"o": o})
    assert launched == [(64, 64)]


hopper = pytest.mark.skipif(not torch.cuda.is_available()
                            or torch.cuda.get_device_capability()[0] < 9,
                            reason="bulk L2 prefetch needs a Hopper GPU")


@hopper
@pytest.mark.parametrize("before_wait", [False, True])
def test_prefetch_kernel_runs_over_odd_sizes_and_changes_nothing(before_wait: bool) -> None:
    from radixserve.layers.kernels.l2_prefetch import prefetch_bytes, prefetch_to_l2
    weight = torch.randn(1000, 4104, dtype=torch.bfloat16, device="cuda")
    copy = weight.clone()
    for share in (1.0, 0.37, 1e-5):
        for chunk in (16, 1 << 12, 1 << 16):
            prefetch_to_l2(weight, prefetch_bytes(weight, share), chunk, before_wait)
    torch.cuda.synchronize()
    assert torch.equal(weight, copy)


@hopper
def test_a_decode_layer_gives_the_same_output_with_prefetch(monkeypatch) -> None:
    torch.manual_seed(0)
    layer = _layer().to("cuda", torch.bfloat16)
    for param in layer.parameters():
        param.data.normal_(0, 0.05)
    layer.self_attn.attend = lambda positions, qkv, batch, kv_stored=False: \
        qkv[:, :layer.self_attn.o_proj.weight.shape[1]].contiguous()
    hidden = torch.randn(3, 64, dtype=torch.bfloat16, device="cuda")
    positions = torch.arange(3, device="cuda")
    plain, _ = layer(positions, hidden, None, None)
    monkeypatch.setattr(weight_prefetch, "env_plan", lambda: PrefetchPlan.parse(
        "o=1,gu=1,down=1", chunk=1024, in_attention=False))
    fetched, _ = layer(positions, hidden, None, None)
    torch.cuda.synchronize()
    assert torch.equal(plain, fetched)
