"""Shared building blocks: a Llama-like family is a short file on top of these.

  DecoderAttention  q|k|v projection, optional per-head q/k RMSNorm (Qwen3), rope through the
                    attention backend (RadixAttention), output projection
  GatedMLP          gate|up projection, a gated activation, down projection
  DecoderLayer      pre-norm attention + MLP with the residual add fused into the norms
  DecoderModel      embedding (optionally scaled), the layers, the final norm
  CausalLM          `model` + LM head (tied or not) + logits; the checkpoint name mapping

Parameters are named as in the transformers state dict (`model.layers.0.self_attn...`), except
the merged q|k|v and gate|up, listed in `packed_modules_mapping` for the generic loader
(loader/weight_loading.py). Linears are column/row parallel with their own weight loaders, so
tensor parallelism shards them without the model files changing.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.activation import SiluAndMul, gated_activation
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import MAX_FUSED_ROWS, RowParallelLinear
from radixserve.layers.logits import LogitsOutput, compute_logits, pooled_last_token
from radixserve.layers.merged_linear import MergedColumnParallelLinear, QKVParallelLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quantization.fp8 import Fp8Rows
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import QKNorm, RopeInput, RotaryEmbedding, rotary_from_config
from radixserve.mem.kv_pool import KVCacheSpec

if TYPE_CHECKING:
    from radixserve.layers.kernels.gemv_rope import RopeStore  # needs triton


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding | None,
                 scaling: float | None = None, logit_cap: float = 0.0,
                 qk_norm: bool = False,
                 qkv_linear: type[QKVParallelLinear] = QKVParallelLinear,
                 attention_chunk: int | None = None) -> None:
        """rotary None: no positional encoding (Nemotron-H's attention layers). qkv_linear:
        the q|k|v projection's class (Llama-4's permutes rope pairs at load);
        attention_chunk: RadixAttention's (Llama-4's local layers)."""
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                   config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=config.o_proj_bias)
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self._carries_rope: dict[torch.dtype, bool] = {}
        self.attn = RadixAttention(self.qkv_proj.num_heads, head_dim,
                                   scaling if scaling is not None else head_dim ** -0.5,
                                   self.qkv_proj.num_kv_heads, layer_id,
                                   sliding_window=config.layer_sliding_window(layer_id),
                                   logit_cap=logit_cap, attention_chunk=attention_chunk)

    def forward(self, positions: torch.Tensor, hidden: "torch.Tensor | Fp8Rows",
                forward_batch: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), forward_batch))

    def rope_store(self, positions: torch.Tensor, norm: RMSNorm, dtype: torch.dtype,
                   forward_batch: ForwardBatch) -> "RopeStore | None":
        """Rope and the K/V store for a one-row q|k|v product normed by `norm` to carry
        (kernels/gemv_rope.py), where the backend takes K/V stored by it this pass; None
        otherwise (per-head q/k norms sit between product and rope; partial rope; a product
        whose programs do not hold whole rope pairs)."""
        if dtype not in self._carries_rope:
            self._carries_rope[dtype] = (
                self.q_norm is None and self.rotary is not None
                and self.rotary.rotary_dim == self.head_dim
                and self.qkv_proj.carries_rope_store(dtype, self.head_dim, norm))
        if not self._carries_rope[dtype]:
            return None
        target = self.attn.kv_store_target(forward_batch)
        if target is None:
            return None
        from radixserve.layers.kernels.gemv_rope import RopeStore
        return RopeStore(positions, self.rotary.cos_cache, self.rotary.sin_cache, target,
                         self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               forward_batch: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        """Attention over the projected q|k|v, before the output projection. kv_stored: the
        product rotated q and k and stored K/V (`rope_store`)."""
        q, k, v = self.qkv_proj.split(qkv)
        if kv_stored:
            return self.attn(q, k, v, forward_batch, kv_stored=True)
        if self.rotary is None:
            return self.attn(q, k, v, forward_batch, None)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = QKNorm(self.q_norm, self.k_norm, self.head_dim)
        # the backend norms (per head) and rotates q/k, fused with its KV store where it can
        return self.attn(q, k, v, forward_batch, RopeInput(positions, self.rotary, qk_norm))


class GatedMLP(nn.Module):
    """`reduce_results=False`: the output is this rank's partial sum (see RowParallelLinear)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size,
                                                       [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           reduce_results=reduce_results)
        self.act = gated_activation(activation)
        # kernels/dataflow_mlp.py's (configuration, fewest rows), resolved at first use
        self._dataflow: "tuple[object, int] | None" = None
        self._dataflow_resolved = False

    def forward(self, x: "torch.Tensor | Fp8Rows") -> torch.Tensor:
        cfg = self._dataflow_config(x) if isinstance(x, torch.Tensor) else None
        if cfg is not None:
            from radixserve.layers.kernels.dataflow_mlp import dataflow_mlp
            return self.down_proj.reduce_partial(dataflow_mlp(
                x, self.gate_up_proj.weight, self.down_proj.weight, cfg))
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def forward_fp8_rows(self, x: Fp8Rows) -> torch.Tensor:
        """Rows quantised beforehand: SiLU-mul quantises its output for the down projection."""
        return self.down_proj(self.act.forward_quantized(self.gate_up_proj(x)))

    def _dataflow_config(self, rows: torch.Tensor):  # -> DataflowMlpConfig | None
        """The configuration to run this decode batch's whole MLP in one launch with
        (kernels/dataflow_mlp.py), where RADIXSERVE_DATAFLOW_MLP and this MLP's shape (read
        once per layer) let it run at this many rows and the layer fits: SiLU, no biases,
        half-precision weights; else None."""
        if not one_row_kernels_apply(rows):
            return None
        if not self._dataflow_resolved:
            self._dataflow_resolved = True
            gate_up, down = self.gate_up_proj, self.down_proj
            if isinstance(self.act, SiluAndMul) and gate_up.bias is None and \
                    down.bias is None and gate_up.fp8 is None and down.fp8 is None and \
                    gate_up.int4 is None and down.int4 is None and \
                    gate_up.lora is None and down.lora is None:
                from radixserve.layers.kernels.dataflow_mlp import env_choice
                self._dataflow = env_choice(down.weight.shape[0], down.weight.shape[1])
        if self._dataflow is None:
            return None
        cfg, min_rows = self._dataflow
        from radixserve.layers.kernels.dataflow_mlp import supports
        return cfg if rows.shape[0] >= min_rows and supports(
            rows, self.gate_up_proj.weight, self.down_proj.weight, cfg) else None


def dense_mlp(config: ModelConfig, intermediate_size: int | None = None,
              reduce_results: bool = True) -> GatedMLP:
    return GatedMLP(config.hidden_size, intermediate_size or config.intermediate_size,
                    getattr(config.hf, "hidden_act", "silu"), config.mlp_bias, reduce_results)


MLPFactory = Callable[[ModelConfig, int], nn.Module]


class DecoderLayer(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); out = h + mlp(norm(h)), the adds fused into the norms
    (each layer returns its output and the residual stream still to be added)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 qk_norm: bool = False, make_mlp: "MLPFactory | None" = None,
                 make_attention: "LayerFactory | None" = None) -> None:
        """make_mlp(config, layer_id): the layer's MLP (default: the dense GatedMLP; MoE
        models give their sparse block); make_attention(config, layer_id, rotary): its
        attention (default: DecoderAttention; DeepSeek gives MLA)."""
        super().__init__()
        self.self_attn = make_attention(config, layer_id, rotary) if make_attention else \
            DecoderAttention(config, layer_id, rotary, qk_norm=qk_norm)
        self.mlp = make_mlp(config, layer_id) if make_mlp else dense_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

        self._fuses_rows: dict[tuple[int, torch.dtype], bool] = {}
        self._takes_fp8_rows: dict[int, bool] = {}

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if one_row_kernels_apply(hidden) and self.fuses_rows(hidden.shape[0], hidden.dtype):
            return self.forward_fused(positions, hidden, residual, forward_batch), None
        if one_row_kernels_apply(hidden) and self.takes_fp8_rows(hidden):
            return self.forward_fp8_rows(positions, hidden, residual, forward_batch)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _dense_swiglu(self) -> bool:
        """Attention, then a SiLU-gated MLP, each behind a Llama RMSNorm: the layer the fused
        decode paths rewrite."""
        return isinstance(self.self_attn, DecoderAttention) and \
            isinstance(self.mlp, GatedMLP) and isinstance(self.mlp.act, SiluAndMul) and \
            type(self.input_layernorm) is RMSNorm and \
            type(self.post_attention_layernorm) is RMSNorm

    def fuses_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """A dense SwiGLU layer whose four linears all have fused kernels for `rows` rows of
        `dtype` (one row: the GEMVs; 2-8: kernels/fused_rows.py where swept), decided once
        per row count and dtype."""
        if not 1 <= rows <= MAX_FUSED_ROWS:
            return False
        key = (rows, dtype)
        if key not in self._fuses_rows:
            attn, mlp = self.self_attn, self.mlp
            self._fuses_rows[key] = (
                self._dense_swiglu()
                and attn.qkv_proj.fuses_rows(rows, dtype, norm=True)
                and attn.o_proj.fuses_rows(rows, dtype, residual=True)
                and mlp.gate_up_proj.fuses_rows(rows, dtype, norm=True, gated=True)
                and mlp.down_proj.fuses_rows(rows, dtype, residual=True))
        return self._fuses_rows[key]

    def takes_fp8_rows(self, hidden: torch.Tensor) -> bool:
        """A dense SwiGLU layer whose q|k|v, gate|up and down products take this many rows of
        activations quantised beforehand (FP8 weights on the GPU: the tensor-core kernel's
        configurations at 2-128 rows, _scaled_mm's batches past them; kernels/fp8_gemm.py
        `fp8_codes_product`); decided once per row count."""
        rows, dtype = hidden.shape[0], hidden.dtype
        if rows not in self._takes_fp8_rows:
            attn, mlp = self.self_attn, self.mlp
            self._takes_fp8_rows[rows] = (
                self._dense_swiglu()
                and self.input_layernorm.weight.dtype == dtype
                and attn.qkv_proj.takes_fp8_rows(rows, dtype)
                and mlp.gate_up_proj.takes_fp8_rows(rows, dtype)
                and mlp.down_proj.takes_fp8_rows(rows, dtype))
        return self._takes_fp8_rows[rows]

    def forward_fp8_rows(self, positions: torch.Tensor, hidden: torch.Tensor,
                         residual: torch.Tensor | None, forward_batch: ForwardBatch
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with FP8 weights where the products take codes: both RMSNorms and
        SiLU-mul emit e4m3 rows and a scale per row, so q|k|v, gate|up and down take
        activation codes as they are (per-token W8A8, the activations `--quantization fp8`
        specifies) instead of quantising them in registers (decode rows) or in a pass of
        their own (batches). o_proj quantises its input itself, as before."""
        rows, residual = self.input_layernorm.forward_quantized(hidden, residual)
        if residual is None:
            residual = hidden
        hidden = self.self_attn(positions, rows, forward_batch)
        rows, residual = self.post_attention_layernorm.forward_quantized(hidden, residual)
        assert residual is not None
        return self.mlp.forward_fp8_rows(rows), residual

    def forward_fused(self, positions: torch.Tensor, hidden: torch.Tensor,
                      residual: torch.Tensor | None, forward_batch: ForwardBatch
                      ) -> torch.Tensor:
        """A decode batch of 1-8 rows where `fuses_rows` said so: four products (one row:
        GEMVs; more: kernels/fused_rows.py) carry the two RMSNorms (into the q|k|v and gate|up
        products), SiLU-mul (gate|up's output) and both residual adds (o and down's outputs),
        so seven kernels become four; at one row the q|k|v GEMV also carries rope and the K/V
        store where it can (`DecoderAttention.rope_store`), one kernel fewer. Returns the
        residual stream after the layer (nothing left to add)."""
        stream = hidden if residual is None else hidden + residual
        attn, mlp = self.self_attn, self.mlp
        rope = None if stream.shape[0] > 1 else \
            attn.rope_store(positions, self.input_layernorm, stream.dtype, forward_batch)
        qkv = attn.qkv_proj.fused_row_product(stream, norm=self.input_layernorm, rope=rope)
        attended = attn.attend(positions, qkv, forward_batch, kv_stored=rope is not None)
        stream = attn.o_proj.fused_row_product(attended, residual=stream)
        act = mlp.gate_up_proj.fused_row_product(stream, norm=self.post_attention_layernorm,
                                                 gated=True)
        return mlp.down_proj.fused_row_product(act, residual=stream)


class PreNormMixerLayer(nn.Module):
    """A hybrid model's layer: h = x + m * mix(norm(x)); out = h + m * mlp(norm(h)), m the
    `multiplier` (Granite's residual multiplier, 1 elsewhere), the adds fused into the norms
    (DecoderModel's convention). Subclasses build `input_layernorm`,
    `post_attention_layernorm`, `mlp` and the mixer `mix` runs (attention or a recurrent
    mixer)."""

    multiplier = 1.0

    def mix(self, positions: torch.Tensor, normed: torch.Tensor,
            forward_batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        mixed = self.mix(positions, normed, forward_batch)
        if self.multiplier != 1.0:
            mixed = mixed * self.multiplier
        normed, residual = self.post_attention_layernorm(mixed, residual)
        out = self.mlp(normed)
        return (out if self.multiplier == 1.0 else out * self.multiplier), residual


def one_row_kernels_apply(hidden: torch.Tensor) -> bool:
    """The fused decode-row kernels (one row; FP8 rows quantised beforehand) are GPU kernels
    (tests point this at the interpreter)."""
    return hidden.is_cuda and hidden.dim() == 2


LayerFactory = Callable[[ModelConfig, int, RotaryEmbedding], nn.Module]


class DecoderModel(nn.Module):
    """Embedding, layers, final norm. Layers take (positions, hidden, residual, batch) and
    return (hidden, residual); residual None means the layer added it already."""

    def __init__(self, config: ModelConfig, make_layer: LayerFactory,
                 norm_cls: type[nn.Module] = RMSNorm, embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = rotary_from_config(config)
        self.layers = nn.ModuleList(make_layer(config, i, self.rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch, input_embeds: torch.Tensor | None = None,
                layer_additions: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> torch.Tensor:
        """input_embeds: the first layer's input as it is (a multimodal model's text and image
        rows), in place of the embedded (and scaled) input_ids. layer_additions[i]: (rows,
        values) added to those rows of the residual stream after layer i (Qwen3-VL's
        DeepStack features)."""
        if input_embeds is not None:
            hidden = input_embeds
        else:
            hidden = self.embed_tokens(input_ids)
            if self.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, forward_batch)
            if layer_additions is not None and i < len(layer_additions):
                rows, values = layer_additions[i]  # the stream is hidden (+ residual)
                hidden = hidden.index_add(0, rows, values.to(hidden.dtype))
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def renamed_target(name: str, renames: tuple[tuple[str, str], ...],
                   packed: dict[str, tuple[str, object]]) -> tuple[str, object] | None:
    """A model's `weight_target` for checkpoint names that differ from ours by `renames` (old,
    new pieces): the renamed parameter, into its merged parameter's shard where `packed` maps
    the module (gate_proj -> gate_up_proj, 0); None for names none of them touch."""
    if not any(old in name for old, _ in renames):
        return None
    for old, new in renames:
        name = name.replace(old, new)
    part = name.split(".")[-2]
    if part in packed:
        merged, shard = packed[part]
        return name.replace(f".{part}.", f".{merged}."), shard
    return name, None


class SkipsMtpLayers:
    """Mixin in front of a CausalLM: checkpoint tensors of `model.layers.{i}` with i >=
    num_hidden_layers are skipped, the multi-token prediction layers DeepSeek-V3 and GLM-4.5
    ship for speculative decoding, which decoding one token per step does not use."""

    def skip_weight(self, name: str) -> bool:
        if name.startswith("model.layers."):
            layer = name.split(".", 3)[2]
            if layer.isdigit() and int(layer) >= self.config.num_hidden_layers:  # type: ignore
                return True
        return super().skip_weight(name)  # type: ignore[misc]


def hybrid_layer_types(config: ModelConfig) -> list[str]:
    """A hybrid model's `layer_types` (each layer's token mixer), one per layer."""
    types = list(config.layer_types or ())
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"{config.architecture} needs layer_types for its "
                         f"{config.num_hidden_layers} layers")
    return types


def index_among_type(types: list[str], layer_id: int) -> int:
    """A layer's index among the layers of its own type (its KV pool or state pool layer)."""
    return types[:layer_id].count(types[layer_id])


# the layer types of hybrid models that keep KV (the others: recurrent mixers, MLPs, MoEs)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


class KVForAttentionLayers:
    """Mixin in front of a CausalLM whose `layer_types` name recurrent layers (hybrid models):
    KV for the attention layers only, numbered apart (`index_among_type`)."""

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig, dtype: torch.dtype,
                      tp_size: int | None = None) -> KVCacheSpec:
        spec = super().kv_cache_spec(config, dtype, tp_size)  # type: ignore[misc]
        layers = sum(t in ATTENTION_LAYER_TYPES for t in hybrid_layer_types(config))
        return dataclasses.replace(spec, num_layers=layers)


class CausalLM(nn.Module):
    """`model` (a DecoderModel) + LM head. Subclasses build `self.model` in `__init__`."""

    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = None if config.tie_word_embeddings else \
            ParallelLMHead(config.vocab_size, config.hidden_size)
        self.final_logit_cap = float(getattr(config.hf, "final_logit_softcapping", None) or 0.0)

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig, dtype: torch.dtype,
                      tp_size: int | None = None) -> KVCacheSpec:
        """What the KV pool stores per token: K and V of this rank's KV heads (replicated when
        there are fewer KV heads than ranks)."""
        tp_size = get_tp_group().size if tp_size is None else tp_size
        return KVCacheSpec("mha", config.num_hidden_layers,
                           max(1, config.num_key_value_heads // tp_size), config.head_dim, dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's rows of the LM head (the embedding's when tied)."""
        return self._head().weight

    def _head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors without a place on purpose: rotary tables, and the copy of the
        embedding some tied checkpoints still ship as lm_head.weight."""
        return "rotary_emb.inv_freq" in name or \
            (name == "lm_head.weight" and self.lm_head is None)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states as the LM head takes them: the model's own, or scaled
        where a family scales its logits (Granite, Falcon-H1: a linear head commutes)."""
        return hidden

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              forward_batch: ForwardBatch) -> torch.Tensor:
        """An embedding model's pass (--is-embedding): each request's last-token final hidden
        state, L2-normalised, [requests, hidden] float32."""
        return pooled_last_token(
            self.final_hidden(self.model(input_ids, positions, forward_batch)), forward_batch)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsOutput:
        return compute_logits(self.final_hidden(self.model(input_ids, positions, forward_batch)),
                              self._head(), forward_batch, self.final_logit_cap)
