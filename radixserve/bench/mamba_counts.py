"""Parameter counts and per-request state sizes of the Mamba-2 hybrids (Nemotron-H and
Nemotron-3, Granite-4.0-H), for the roofline (bench/param_counts.py hands them here).

Nemotron-H: each layer one mixer behind a norm (a Mamba-2 mixer, attention, a ReLU-squared MLP,
or an MoE of ungated experts with a shared one). Granite-4.0-H and Bamba: each layer a mixer
(Mamba-2 or attention) and an MLP (top-k SwiGLU experts beside a shared SwiGLU MLP, or the
shared MLP alone) behind two norms. Falcon-H1: each layer both mixers side by side, then a
SwiGLU MLP.
"""
from __future__ import annotations

from typing import NamedTuple

from radixserve.bench.param_counts import ParamCounts, attention_params
from radixserve.core.model_config import ModelConfig

MAMBA_HYBRIDS = ("NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "BambaForCausalLM",
                 "FalconH1ForCausalLM")


class Mamba2Shape(NamedTuple):
    heads: int
    head_dim: int
    state: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool

    @property
    def conv_channels(self) -> int:  # x | B | C
        return self.heads * self.head_dim + 2 * self.groups * self.state


def mamba2_shape(cfg: ModelConfig) -> Mamba2Shape:
    hf = cfg.hf
    if cfg.architecture == "NemotronHForCausalLM":
        return Mamba2Shape(hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size,
                           hf.n_groups, hf.conv_kernel, bool(hf.use_conv_bias),
                           bool(hf.use_bias))
    return Mamba2Shape(hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups,
                       hf.mamba_d_conv, bool(hf.mamba_conv_bias), bool(hf.mamba_proj_bias))


def _mamba_params(cfg: ModelConfig) -> tuple[int, int]:
    """(linear weights, the rest) of one Mamba-2 mixer: in_proj (z, x | B | C, dt) and out_proj;
    the conv, dt_bias, A_log, D and the gated norm."""
    s, h, hf = mamba2_shape(cfg), cfg.hidden_size, cfg.hf
    inner, channels = s.heads * s.head_dim, s.conv_channels
    falcon = cfg.architecture == "FalconH1ForCausalLM"
    linear = h * (inner + channels + s.heads) + inner * h
    norm = inner if not falcon or hf.mamba_rms_norm else 0
    other = channels * s.conv_kernel + (channels if s.conv_bias else 0) + 3 * s.heads + norm
    if s.proj_bias:
        other += inner + channels + s.heads
    if (hf.projectors_bias if falcon else s.proj_bias):  # out_proj's
        other += h
    return linear, other


def mamba_state_bytes(cfg: ModelConfig, conv_itemsize: int) -> int:
    """One request's states in all Mamba-2 layers: the float32 [heads, state, head_dim] state
    and the conv's last inputs."""
    s = mamba2_shape(cfg)
    per_layer = s.heads * s.state * s.head_dim * 4 + \
        (s.conv_kernel - 1) * s.conv_channels * conv_itemsize
    return len(_mamba_layers(cfg)) * per_layer


def _mamba_layers(cfg: ModelConfig) -> list[int]:
    if cfg.architecture == "FalconH1ForCausalLM":  # a mixer in every layer
        return list(range(cfg.num_hidden_layers))
    return [i for i, t in enumerate(cfg.layer_types or []) if t == "linear_attention"]


class _Layer(NamedTuple):
    linear: int
    active: int
    other: int
    routed: bool


def _nemotron_mlp_layer(cfg: ModelConfig, kind: str) -> _Layer:
    hf, h = cfg.hf, cfg.hidden_size
    if kind == "mlp":
        bias = cfg.intermediate_size + h if cfg.mlp_bias else 0
        return _Layer(2 * h * cfg.intermediate_size, 2 * h * cfg.intermediate_size, bias, False)
    width = hf.moe_latent_size or h
    latent = 2 * h * hf.moe_latent_size if hf.moe_latent_size else 0
    fixed = h * hf.n_routed_experts + 2 * h * hf.moe_shared_expert_intermediate_size + latent
    routed = 2 * width * hf.moe_intermediate_size
    return _Layer(fixed + hf.n_routed_experts * routed, fixed + hf.num_experts_per_tok * routed,
                  0, True)


def _granite_mlp(cfg: ModelConfig) -> _Layer:
    hf, h = cfg.hf, cfg.hidden_size
    shared = 3 * h * getattr(hf, "shared_intermediate_size", cfg.intermediate_size)
    if not getattr(hf, "num_local_experts", 0):  # Granite-4.0-H-Micro, Bamba
        return _Layer(shared, shared, 0, False)
    routed = 3 * h * cfg.intermediate_size
    router = h * hf.num_local_experts
    return _Layer(shared + router + hf.num_local_experts * routed,
                  shared + router + hf.num_experts_per_tok * routed, 0, True)


def mamba_hybrid_counts(cfg: ModelConfig) -> ParamCounts:
    hf, h = cfg.hf, cfg.hidden_size
    nemotron = cfg.architecture == "NemotronHForCausalLM"
    mamba, attention = (_Layer(lin, lin, other, False)
                        for lin, other in (_mamba_params(cfg), attention_params(cfg)))
    mlp = None if nemotron else _granite_mlp(cfg)  # after every mixer but Nemotron-H's
    layers = linear = active = moe_layers = 0
    falcon = cfg.architecture == "FalconH1ForCausalLM"
    kinds = ["falcon"] * cfg.num_hidden_layers if falcon else cfg.layer_types or []
    for kind in kinds:
        if kind == "falcon":  # both mixers
            parts = [mamba, attention]
        elif kind == "linear_attention":
            parts = [mamba]
        elif kind in ("mlp", "moe"):
            parts = [_nemotron_mlp_layer(cfg, kind)]
        else:
            parts = [attention]
        if mlp is not None:
            parts.append(mlp)
        norms = h if nemotron else 2 * h
        layers += sum(p.linear + p.other for p in parts) + norms
        linear += sum(p.linear for p in parts)
        active += sum(p.active for p in parts)
        moe_layers += any(p.routed for p in parts)
    embedding = lm_head = cfg.vocab_size * h
    total = embedding + layers + h + (0 if cfg.tie_word_embeddings else lm_head)
    if nemotron:
        experts, top_k = hf.n_routed_experts, hf.num_experts_per_tok
        expert = 2 * (hf.moe_latent_size or h) * hf.moe_intermediate_size
    else:
        experts = getattr(hf, "num_local_experts", 0) or 0
        top_k, expert = getattr(hf, "num_experts_per_tok", 0), 3 * h * cfg.intermediate_size
    if not moe_layers:
        experts = top_k = expert = 0
    return ParamCounts(embedding, layers, h, lm_head, linear, total, active, expert,
                       moe_layers, experts, top_k)
