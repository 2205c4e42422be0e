"""Falcon-H1 (FalconH1ForCausalLM, 0.5B-34B): every layer runs attention and a Mamba-2 mixer side
by side on the same normed input and adds their outputs, then a SwiGLU MLP.

Each layer has both: KV in every layer (the pool's layer = the layer) and recurrent states in
every layer (the state pool's layer = the layer). The mixer's gated norm is optional
(`mamba_rms_norm`; without it y * SiLU(z)) and normalises before the gate by default
(`mamba_norm_before_gate`); its width is `mamba_d_ssm`.

Falcon-H1's µP multipliers are folded into the weights as they load (a linear map commutes with
a scale): the mixer's input (`ssm_in_multiplier`) and each piece of its in-projection
(`ssm_multipliers`: z, x, B, C, dt) into in_proj's rows, its output (`ssm_out_multiplier`) into
out_proj; attention's input (`attention_in_multiplier`) into q, k and v, `key_multiplier` into
k, its output (`attention_out_multiplier`) into o_proj; the MLP's gate and down multipliers
(`mlp_multipliers`) into gate_proj and down_proj. The embeddings are scaled by
`embedding_multiplier` and the final hidden states by `lm_head_multiplier` before the LM head.
Checkpoint names: the MLP `feed_forward`, its norm `pre_ff_layernorm`, the final norm
`final_layernorm`. FP8 checkpoints are refused (their scales would need the multipliers too);
`--quantization fp8` quantises the folded weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.linear import LinearBase
from radixserve.layers.mamba2_mixer import Mamba2Mixer
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quantization.fp8 import current_fp8_config
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderModel,
                                      PreNormMixerLayer, dense_mlp, renamed_target)
from radixserve.models.granite_hybrid import BAMBA_RENAMES

Scale = Callable[[object], "float | torch.Tensor"]  # shard id -> factor (rows or one)


def _scale_on_load(linear: LinearBase, weight: Scale, bias: Scale | None = None) -> None:
    """Multiply each checkpoint tensor of `linear` by its factor (by shard id) before its
    loader places it: a float, or one factor per row of the tensor as it arrives."""
    for param, scale in ((linear.weight, weight), (linear.bias, bias)):
        if param is None or scale is None:
            continue
        load = param.weight_loader  # type: ignore[attr-defined]

        def scaled(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, *,
                   load: Callable[..., object] = load, scale: Scale = scale) -> object:
            factor = scale(shard_id)
            if isinstance(factor, torch.Tensor):
                # the checkpoint tensor may arrive on the device already (the GPU loader's)
                factor = factor.to(loaded.device).reshape(-1, *([1] * (loaded.dim() - 1)))
            loaded = loaded.float() * factor
            return load(p, loaded) if shard_id is None else load(p, loaded, shard_id)

        param.weight_loader = scaled  # type: ignore[attr-defined]


class FalconH1Layer(PreNormMixerLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf
        self.mamba = Mamba2Mixer(
            config.hidden_size, hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state,
            hf.mamba_n_groups, hf.mamba_d_conv, config.rms_norm_eps, layer_id,
            use_conv_bias=hf.mamba_conv_bias, proj_bias=hf.mamba_proj_bias,
            time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
            norm=("norm_then_gate" if hf.mamba_norm_before_gate else "gate_then_norm")
            if hf.mamba_rms_norm else "gate", out_bias=hf.projectors_bias)
        self.self_attn = DecoderAttention(config, layer_id, rotary)
        self.mlp = dense_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fold_multipliers(hf)

    def _fold_multipliers(self, hf: object) -> None:
        def get(name: str) -> object:
            return getattr(hf, name)

        heads, head_dim = get("mamba_n_heads"), get("mamba_d_head")
        inner = heads * head_dim  # the checkpoint's whole width (mamba_d_ssm or expand * h)
        groups, state = get("mamba_n_groups"), get("mamba_d_state")
        pieces = [inner, inner, groups * state, groups * state, heads]  # z, x, B, C, dt
        mup = torch.cat([torch.full((n,), float(m)) for n, m in
                         zip(pieces, get("ssm_multipliers"))])
        ssm_in = float(get("ssm_in_multiplier"))
        _scale_on_load(self.mamba.in_proj, lambda shard: mup * ssm_in, lambda shard: mup)
        ssm_out = float(get("ssm_out_multiplier"))
        _scale_on_load(self.mamba.out_proj, lambda shard: ssm_out, lambda shard: ssm_out)
        attn_in, key = float(get("attention_in_multiplier")), float(get("key_multiplier"))
        _scale_on_load(self.self_attn.qkv_proj,
                       lambda shard: attn_in * (key if shard == "k" else 1.0),
                       lambda shard: key if shard == "k" else 1.0)
        attn_out = float(get("attention_out_multiplier"))
        _scale_on_load(self.self_attn.o_proj, lambda shard: attn_out, lambda shard: attn_out)
        gate, down = (float(m) for m in get("mlp_multipliers"))
        _scale_on_load(self.mlp.gate_up_proj, lambda shard: gate if shard == 0 else 1.0,
                       lambda shard: gate if shard == 0 else 1.0)
        _scale_on_load(self.mlp.down_proj, lambda shard: down, lambda shard: down)

    def mix(self, positions: torch.Tensor, normed: torch.Tensor,
            forward_batch: ForwardBatch) -> torch.Tensor:
        return self.mamba(normed, forward_batch) + \
            self.self_attn(positions, normed, forward_batch)


class FalconH1ForCausalLM(CausalLM):
    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    def __init__(self, config: ModelConfig) -> None:
        fp8 = current_fp8_config()
        if fp8 is not None and not fp8.online:
            raise ValueError("Falcon-H1 FP8 checkpoints are not supported (its multipliers are "
                             "folded into the weights); --quantization fp8 of a bf16 one is")
        hf = config.hf
        scale = float(hf.embedding_multiplier)
        super().__init__(config, DecoderModel(config, FalconH1Layer, RMSNorm,
                                              embed_scale=None if scale == 1.0 else scale))
        self.lm_head_multiplier = float(hf.lm_head_multiplier)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        return renamed_target(name, BAMBA_RENAMES, self.packed_modules_mapping)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits * lm_head_multiplier, through the LM head
        return hidden if self.lm_head_multiplier == 1.0 else hidden * self.lm_head_multiplier


EntryClass = [FalconH1ForCausalLM]
