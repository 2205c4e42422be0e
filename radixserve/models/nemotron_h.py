"""Nemotron-H (Nemotron-H 8B / 47B / 56B, Nemotron Nano 2 9B / 12B, Nemotron-3 Nano / Super): a
hybrid of Mamba-2 and attention layers.

Every layer holds one mixer behind a pre-norm and a residual add; `layers_block_type` (read as
`layer_types`) names it:
  * "linear_attention": a Mamba-2 mixer (layers/mamba2_mixer.py), whose per-request states live
    in the RecurrentStatePool;
  * "full_attention": attention without positional encoding (no rope), the only layers with KV,
    numbered 0.. in the KV pool;
  * "mlp": up_proj, ReLU squared, down_proj (no gate);
  * "moe" (Nemotron-3-Nano): ungated ReLU-squared experts (layers/moe/ungated_experts.py)
    chosen by sigmoid scores with a correction bias, in groups (DeepSeek-V3's routing, the
    router in float32), beside a shared ReLU-squared expert; where `moe_latent_size` is set the
    routed experts work in a smaller width between two projections (fc1 / fc2_latent_proj).
Norms multiply by their weight in float32 and round after (OLMo's RMSNorm). Checkpoints keep the
decoder under `backbone.` (embeddings, norm_f).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.activation import relu_squared
from radixserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.mamba2_mixer import Mamba2Mixer
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.layers.moe.router import select_experts
from radixserve.layers.moe.ungated_experts import UngatedExperts
from radixserve.layers.norm import OlmoRMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderModel,
                                      KVForAttentionLayers, hybrid_layer_types,
                                      index_among_type)
from radixserve.models.moe_blocks import routing_config


class SquaredReluMLP(nn.Module):
    """down(relu(up(x))^2). `reduce_results=False`: this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf
        hidden, latent = config.hidden_size, hf.moe_latent_size
        self.routing = routing_config(config)
        self.gate = nn.Module()  # float32, as transformers keeps the router
        for name, shape in (("weight", (self.routing.num_experts, hidden)),
                            ("e_score_correction_bias", (self.routing.num_experts,))):
            param = nn.Parameter(torch.zeros(shape, dtype=torch.float32), requires_grad=False)
            param.keep_dtype = True  # type: ignore[attr-defined]
            setattr(self.gate, name, param)
        self.experts = UngatedExperts(self.routing.num_experts, latent or hidden,
                                      hf.moe_intermediate_size, hf.mlp_hidden_act)
        self.shared_experts = SquaredReluMLP(hidden, hf.moe_shared_expert_intermediate_size,
                                             hf.mlp_bias, reduce_results=False)
        if latent:  # replicated and left unquantised (small; fc2 is applied by hand to the
            # ranks' partial sums, its bias added once after their sum)
            self.fc1_latent_proj = ReplicatedLinear(hidden, latent, bias=hf.mlp_bias,
                                                    quantize=False)
            self.fc2_latent_proj = ReplicatedLinear(latent, hidden, bias=hf.mlp_bias,
                                                    quantize=False)
        self.tp_size = get_tp_group().size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.float(), self.gate.weight)
        topk = select_experts(logits, self.routing, self.gate.e_score_correction_bias)
        latent = getattr(self, "fc1_latent_proj", None)
        routed = self.experts(hidden if latent is None else latent(hidden), topk)
        bias = None
        if latent is not None:  # linear: fc2 of the ranks' partial sums adds up
            routed = F.linear(routed, self.fc2_latent_proj.weight)
            bias = self.fc2_latent_proj.bias
        out = routed + self.shared_experts(hidden)
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out)
        return out if bias is None else out + bias


def mamba2_mixer(config: ModelConfig, state_index: int) -> Mamba2Mixer:
    hf = config.hf
    return Mamba2Mixer(
        config.hidden_size, hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size,
        hf.n_groups, hf.conv_kernel, hf.layer_norm_epsilon, state_index,
        use_conv_bias=hf.use_conv_bias, proj_bias=hf.use_bias,
        time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))))


class NemotronHLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        types = hybrid_layer_types(config)
        kind, index = types[layer_id], index_among_type(types, layer_id)
        self.kind = kind
        self.norm = OlmoRMSNorm(config.hidden_size, config.hf.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer: nn.Module = mamba2_mixer(config, index)
        elif kind == "full_attention":
            self.mixer = DecoderAttention(config, index, None)  # no rope
        elif kind == "mlp":
            self.mixer = SquaredReluMLP(config.hidden_size, config.intermediate_size,
                                        config.mlp_bias)
        elif kind == "moe":
            self.mixer = NemotronHMoE(config)
        else:
            raise ValueError(f"Nemotron-H layer type {kind!r} is not served yet")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + mixer(norm(x)), the add fused into the next norm (DecoderModel's way)."""
        if residual is None:
            residual, normed = hidden, self.norm(hidden)
        else:
            normed, residual = self.norm(hidden, residual)
        if self.kind in ("mlp", "moe"):
            return self.mixer(normed), residual
        if self.kind == "full_attention":
            return self.mixer(positions, normed, forward_batch), residual
        return self.mixer(normed, forward_batch), residual


class NemotronHForCausalLM(KVForAttentionLayers, CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v")}
    checkpoint_prefixes = {"backbone.embeddings.": "model.embed_tokens.",
                           "backbone.norm_f.": "model.norm.", "backbone.": "model.",
                           "model.embeddings.": "model.embed_tokens.",
                           "model.norm_f.": "model.norm."}

    def __init__(self, config: ModelConfig) -> None:
        def make_layer(config: ModelConfig, layer_id: int, _: RotaryEmbedding) -> nn.Module:
            return NemotronHLayer(config, layer_id)

        config.rms_norm_eps = config.hf.layer_norm_epsilon  # the final norm's
        super().__init__(config, DecoderModel(config, make_layer, OlmoRMSNorm))

    weight_target = staticmethod(expert_weight_target)

    def skip_weight(self, name: str) -> bool:  # multi-token prediction layers
        return name.startswith("mtp.") or super().skip_weight(name)


EntryClass = [NemotronHForCausalLM]
