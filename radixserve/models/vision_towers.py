"""The ViT image encoders of LLaVA-style checkpoints: CLIP's and SigLIP's vision transformers.

  CLIP    patches by a bias-free conv, a learned class token in front of them, position
          embeddings, `pre_layrnorm`, then pre-norm encoder layers
  SigLIP  patches by a conv with bias, position embeddings, the same encoder layers; its
          `post_layernorm` makes transformers' last_hidden_state (Gemma-3's features; a LLaVA
          model reads hidden_states, before it), its attention-pooling `head` the pooler
          output, which no model here reads

Encoder layer: x + attn(layer_norm1(x)), then + mlp(layer_norm2(.)); attention is bidirectional
over the image's tokens (torch's scaled_dot_product_attention), q/k/v/out projections with bias,
the MLP fc1 -> hidden_act -> fc2.

`VisionTower` returns the hidden states a LLaVA model feeds its projector: those after the
configured layers (hidden_states[0] is the embeddings' output, after CLIP's pre_layrnorm;
hidden_states[i] the output of layer i), several concatenated on the feature dimension; or,
with `post_layernorm`, SigLIP's last_hidden_state (Gemma-3). Layers past the deepest one asked
for are neither built nor run; their checkpoint tensors are skipped (`skip_weight`), as are the
pooling head's and the post-norm's where the features do not go through it. Parameters are
plain, replicated on every tensor-parallel rank, and named as in the checkpoint under
`vision_tower.vision_model.`, so the generic loader copies them whole.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

TOWER_KINDS = ("clip_vision_model", "siglip_vision_model")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ungated activation transformers' ACT2FN names `name`."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]


def hidden_state_indices(layers: int | list[int], num_layers: int) -> list[int]:
    """`vision_feature_layer` (one index or a list) as indices into transformers' hidden_states
    tuple of num_layers + 1 entries, negative ones counted from its end."""
    indices = [layers] if isinstance(layers, int) else list(layers)
    resolved = [i + num_layers + 1 if i < 0 else i for i in indices]
    if not resolved or any(not 0 <= i <= num_layers for i in resolved):
        raise ValueError(f"vision_feature_layer {layers!r} is out of range for a vision tower "
                         f"of {num_layers} layers")
    return resolved


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any, clip: bool) -> None:
        """clip: CLIP's (a class token, a bias-free conv), else SigLIP's (a conv with bias)."""
        super().__init__()
        hidden = cfg.hidden_size
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if clip else None
        self.patch_embedding = nn.Conv2d(getattr(cfg, "num_channels", 3), hidden,
                                         kernel_size=cfg.patch_size, stride=cfg.patch_size,
                                         bias=not clip)
        positions = (cfg.image_size // cfg.patch_size) ** 2 + int(clip)
        self.position_embedding = nn.Embedding(positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, H, W] -> [n, tokens, hidden] (CLIP's class token first)."""
        height, width = pixel_values.shape[-2:]
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"image of {height}x{width} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [n, tokens, hidden] -> [n, H, tokens, D]
            return t.view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)), scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """The checkpoint's `vision_model`: embeddings, CLIP's pre_layrnorm, the first layers,
    SigLIP's post_layernorm where asked for."""

    def __init__(self, cfg: Any, num_layers: int, post_layernorm: bool = False) -> None:
        super().__init__()
        clip = cfg.model_type == "clip_vision_model"
        self.embeddings = VisionEmbeddings(cfg, clip)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) \
            if clip else None
        self.encoder = VisionEncoder(cfg, num_layers)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) \
            if post_layernorm else None


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision transformer (`vision_config.model_type`), run up to the deepest of
    `feature_layers` (indices into transformers' hidden_states, `hidden_state_indices`)."""

    def __init__(self, vision_config: Any, feature_layers: list[int],
                 post_layernorm: bool = False) -> None:
        """post_layernorm: the features are SigLIP's last_hidden_state, its last layer's output
        through `post_layernorm` (Gemma-3's); feature_layers must then be that layer alone."""
        super().__init__()
        kind = getattr(vision_config, "model_type", None)
        if kind not in TOWER_KINDS:
            raise ValueError(f"vision tower {kind!r} is not supported (supported: "
                             f"{', '.join(TOWER_KINDS)})")
        if post_layernorm and (kind != "siglip_vision_model" or
                               list(feature_layers) != [vision_config.num_hidden_layers]):
            raise ValueError("the post-norm's features are a SigLIP tower's last layer's")
        self.feature_layers = list(feature_layers)
        self.num_layers = max(self.feature_layers)
        self.hidden_size: int = vision_config.hidden_size
        self.vision_model = VisionTransformer(vision_config, self.num_layers, post_layernorm)

    @property
    def feature_size(self) -> int:
        """Width of the output: the hidden size times the number of feature layers."""
        return self.hidden_size * len(self.feature_layers)

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors (named below `vision_model.`) the features never use: layers past
        the deepest feature layer, the pooling head, the post-norm unless the features go
        through it."""
        name = name.removeprefix("vision_model.")
        if name.startswith("head.") or name == "embeddings.position_ids":
            return True
        if name.startswith("post_layernorm."):
            return self.vision_model.post_layernorm is None
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= self.num_layers
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, H, W] -> [n, tokens, hidden * len(feature_layers)]."""
        vit = self.vision_model
        hidden = vit.embeddings(pixel_values)
        if vit.pre_layrnorm is not None:
            hidden = vit.pre_layrnorm(hidden)
        states = {0: hidden}
        for i, layer in enumerate(vit.encoder.layers, start=1):
            hidden = layer(hidden)
            if i in self.feature_layers:
                states[i] = hidden
        if vit.post_layernorm is not None:
            return vit.post_layernorm(hidden)
        selected = [states[i] for i in self.feature_layers]
        return selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
