"""The Llama family: Llama 2/3/3.1 (llama3 rope scaling), Mistral, Qwen2 (q/k/v bias), SmolLM.

Weights arrive with Hugging Face names; q/k/v and gate/up are merged at load time.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.linear import GateUpLinear, Linear, QKVLinear
from radixserve.layers.logits import LogitsOutput, compute_logits
from radixserve.layers.norm import RMSNorm
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import RopeInput, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = Linear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                bias=False)
        self.rotary = rotary
        self.attn = RadixAttention(config.num_attention_heads, config.head_dim,
                                   config.head_dim ** -0.5, config.num_key_value_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        # the backend rotates q/k (fused with its KV store where it can)
        return self.o_proj(self.attn(q, k, v, forward_batch, RopeInput(positions, self.rotary)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size,
                                         bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, self.rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else \
            Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsOutput:
        return compute_logits(self.hidden_states(input_ids, positions, forward_batch),
                              self.lm_head_weight, forward_batch)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    # ---- weights ----
    _MERGED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
               "up_proj": ("gate_up_proj", "up")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; every parameter must be covered (tied lm_head excepted)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still ship a copy
            parts = name.split(".")
            merged = self._MERGED.get(parts[-2]) if len(parts) >= 2 else None
            if merged is not None:
                module_path = ".".join(parts[:-2] + [merged[0]])
                module = self.get_submodule(module_path)
                module.load_shard(merged[1], parts[-1], tensor)
                loaded.add(f"{module_path}.{parts[-1]}#{merged[1]}")
                loaded.add(f"{module_path}.{parts[-1]}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != "
                                 f"{tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


EntryClass = [LlamaForCausalLM]
