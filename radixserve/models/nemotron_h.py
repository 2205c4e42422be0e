"""Nemotron-H (Nemotron-H 8B / 47B / 56B, Nemotron Nano 2 9B / 12B): a hybrid of Mamba-2 and
attention layers.

Every layer holds one mixer behind a pre-norm and a residual add; `layers_block_type` (read as
`layer_types`) names it:
  * "linear_attention": a Mamba-2 mixer (layers/mamba2_mixer.py), whose per-request states live
    in the RecurrentStatePool;
  * "full_attention": attention without positional encoding (no rope), the only layers with KV,
    numbered 0.. in the KV pool;
  * "mlp": up_proj, ReLU squared, down_proj (no gate);
  * "moe": Nemotron-3's routed experts, not served yet (refused at build).
Norms multiply by their weight in float32 and round after (OLMo's RMSNorm). Checkpoints keep the
decoder under `backbone.` (embeddings, norm_f).
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixserve.layers.mamba2_mixer import Mamba2Mixer
from radixserve.layers.norm import OlmoRMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderModel,
                                      KVForAttentionLayers, hybrid_layer_types,
                                      index_among_type)


class SquaredReluMLP(nn.Module):
    """down(relu(up(x))^2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


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
        if self.kind == "mlp":
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

    def skip_weight(self, name: str) -> bool:  # multi-token prediction layers
        return name.startswith("mtp.") or super().skip_weight(name)


EntryClass = [NemotronHForCausalLM]
