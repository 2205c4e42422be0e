"""DeepSeek-V3 specifics beyond the greedy comparison in test_greedy_vs_hf.py: the sigmoid
noaux_tc router against transformers' own router module (V3's 256 experts in 8 groups, and
Kimi-K2's 384 in one group), the multi-token-prediction layers of released checkpoints skipped
while any other stray tensor is still refused, and rope_interleave false refused."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from radixserve.config import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.layers.moe.router import RoutingConfig, select_experts
from radixserve.loader.checkpoint_error import CheckpointError
from tests.models.runner_driver import RunnerDriver
from tests.models.tiny_checkpoints import make_checkpoint


@pytest.mark.parametrize("experts,top_k,groups,topk_group,renormalize", [
    (256, 8, 8, 4, True),  # DeepSeek-V3 / R1
    (384, 8, 1, 1, True),  # Kimi-K2: one group
    (64, 6, 8, 3, False),
])
def test_sigmoid_routing_matches_transformers(experts: int, top_k: int, groups: int,
                                              topk_group: int, renormalize: bool) -> None:
    hf_config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups,
        topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=2.5)
    hf_config.num_local_experts = experts
    router = DeepseekV3TopkRouter(hf_config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.5)
    hidden = torch.randn(40, 32, generator=gen)
    logits, want_weights, want_ids = router(hidden)
    config = RoutingConfig(experts, top_k, renormalize=renormalize, num_groups=groups,
                           topk_group=topk_group, scaling_factor=2.5, scoring="sigmoid")
    got = select_experts(logits, config, router.e_score_correction_bias)
    got_order, want_order = got.ids.long().sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(got.weights.gather(1, got_order.indices),
                               want_weights.gather(1, want_order.indices))
    unbiased = select_experts(logits, config)  # the bias moves the choice
    assert not torch.equal(unbiased.ids.long().sort(dim=-1).values, want_order.values)


def _prefill_logits(folder) -> torch.Tensor:
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=512, max_running_requests=2))
    ids = torch.randint(0, 160, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    return RunnerDriver(runner).extend({0: ids})[0]


def test_multi_token_prediction_layers_are_skipped(tmp_path) -> None:
    hf_model = make_checkpoint("deepseek_v3_noaux", tmp_path)
    ids = torch.randint(0, 160, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0, -1]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    last = hf_model.config.num_hidden_layers  # the MTP layer's index in released checkpoints
    mtp = {f"model.layers.{last}.{name}": torch.randn(shape) for name, shape in (
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("embed_tokens.weight", (160, 64)), ("shared_head.head.weight", (160, 64)),
        ("self_attn.kv_a_proj_with_mqa.weight", (40, 64)))}
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(_prefill_logits(tmp_path), want, atol=1e-4, rtol=1e-4)

    save_file({**tensors, "model.layers.1.stray.weight": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="stray"):
        _prefill_logits(tmp_path)


def test_rope_interleave_false_is_refused(tmp_path) -> None:
    make_checkpoint("deepseek_v3_noaux", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    with pytest.raises(ValueError, match="rope_interleave"):
        _prefill_logits(tmp_path)


def test_correction_bias_stays_float32_and_kimi_k2_configs_load(tmp_path) -> None:
    """The bias only moves the choice, whose gaps bf16 would reorder: float32 in a bf16 model,
    as transformers and vLLM keep it. Kimi-K2's config says model_type "kimi_k2" (unknown to
    transformers) over DeepSeek-V3's architecture."""
    from radixserve.core.model_config import ModelConfig
    make_checkpoint("deepseek_v3_noaux", tmp_path)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="bfloat16", device="cpu",
                                    max_total_tokens=512, max_running_requests=2))
    bias = dict(runner.model.named_parameters())["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    config = json.loads((tmp_path / "config.json").read_text())
    kimi = ModelConfig.from_hf_dict({**config, "model_type": "kimi_k2", "n_group": 1,
                                     "topk_group": 1})
    assert kimi.architecture == "DeepseekV3ForCausalLM" and kimi.hf.n_group == 1
