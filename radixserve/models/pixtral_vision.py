"""Pixtral's vision encoder (transformers' PixtralVisionModel; Mistral Small 3.1 / 3.2's tower):
images of any size whose sides are multiples of the patch, each a grid of patches.

  patch_conv  a bias-free conv, one row per patch, row-major over the image's patch grid
  ln_pre      RMSNorm (eps 1e-5, as every norm of the tower: transformers fixes it)
  layers      x + attention(attention_norm(x)), then + feed_forward(ffn_norm(.)); attention
              bidirectional over the image's patches, q/k/v/o without bias, 2D rotary
              embedding; feed_forward gate_proj / up_proj / down_proj, hidden_act on the gate

The rotary embedding is axial: of the head's rotated half (rotate_half pairs i and i + D/2),
the first D/4 frequencies turn by the patch's row, the last D/4 by its column, the frequencies
being rope_theta ** (-2k / D), the even k's for rows and the odd ones for columns (transformers'
`compute_axial_rope_parameters`; the older table of image_size // patch_size positions per side
gave the same angles). Computed from each image's own grid, so no size limit is kept.

transformers packs several images into one sequence with a block-diagonal mask; each image
attending to its own patches alone is the same thing, so a batch here is images of one size,
run side by side. `PixtralVisionTower` returns the hidden states the projector reads
(`hidden_state_indices`: 0 is ln_pre's output, i the output of layer i); layers past the
deepest one read are neither built nor loaded (`skip_weight`). Parameters are plain,
replicated on every tensor-parallel rank, named as the checkpoint's under `vision_tower.`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.norm import RMSNorm
from radixserve.models.vision_towers import activation

NORM_EPS = 1e-5  # PixtralRMSNorm's eps in every place transformers builds one


def rope_theta(vision_config: Any) -> float:
    """The tower's rope base: rope_parameters' (transformers 5), else a bare rope_theta."""
    params = getattr(vision_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "axial")
    if kind != "axial":
        raise ValueError(f"a Pixtral tower with rope_type {kind!r} is not supported "
                         "(supported: axial)")
    return float(params.get("rope_theta", getattr(vision_config, "rope_theta", 10000.0)))


def axial_rope(rows: int, cols: int, head_dim: int, theta: float,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows * cols, head_dim] (fp32) of a rows x cols patch grid, row-major."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=device) / head_dim)
    row = torch.arange(rows, device=device, dtype=torch.float32).repeat_interleave(cols)
    col = torch.arange(cols, device=device, dtype=torch.float32).repeat(rows)
    angles = torch.cat([row[:, None] * inv_freq[0::2], col[:, None] * inv_freq[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, tokens, D] rotated (rotate_half pairs), cos / sin [tokens, D]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class PixtralAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads  # (transformers' config forces the same)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [n, tokens, hidden] -> [n, H, tokens, D]
            return t.view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        q = rotate(heads(self.q_proj(x)), cos, sin)
        k = rotate(heads(self.k_proj(x)), cos, sin)
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)),
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class PixtralMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.attention = PixtralAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.feed_forward = PixtralMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(cfg) for _ in range(num_layers))


class PixtralVisionTower(nn.Module):
    """The checkpoint's `vision_tower` (a `pixtral` vision_config), run up to the deepest of
    `feature_layers` (indices into transformers' hidden_states)."""

    def __init__(self, vision_config: Any, feature_layers: list[int]) -> None:
        super().__init__()
        kind = getattr(vision_config, "model_type", None)
        if kind != "pixtral":
            raise ValueError(f"vision tower {kind!r} is not a Pixtral one")
        self.feature_layers = list(feature_layers)
        self.num_layers = max(self.feature_layers)
        self.hidden_size: int = vision_config.hidden_size
        self.patch_size: int = vision_config.patch_size
        self.head_dim = vision_config.hidden_size // vision_config.num_attention_heads
        self.theta = rope_theta(vision_config)
        self.patch_conv = nn.Conv2d(getattr(vision_config, "num_channels", 3), self.hidden_size,
                                    kernel_size=self.patch_size, stride=self.patch_size,
                                    bias=False)
        self.ln_pre = RMSNorm(self.hidden_size, NORM_EPS)
        self.transformer = PixtralTransformer(vision_config, self.num_layers)

    @property
    def feature_size(self) -> int:
        """Width of the output: the hidden size times the number of feature layers."""
        return self.hidden_size * len(self.feature_layers)

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors (named below `vision_tower.`) of layers past the deepest read."""
        if name.startswith("transformer.layers."):
            return int(name.split(".")[2]) >= self.num_layers
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, H, W] (one size, sides multiples of the patch) ->
        [n, (H / patch) * (W / patch), hidden * len(feature_layers)], patches row-major."""
        height, width = pixel_values.shape[-2:]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"image of {height}x{width} pixels; the Pixtral tower takes sides "
                             f"that are multiples of its {self.patch_size}-pixel patch")
        weight = self.patch_conv.weight
        hidden = self.patch_conv(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        hidden = self.ln_pre(hidden)
        cos, sin = axial_rope(height // self.patch_size, width // self.patch_size,
                              self.head_dim, self.theta, hidden.device)
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        states = {0: hidden}
        for i, layer in enumerate(self.transformer.layers, start=1):
            hidden = layer(hidden, cos, sin)
            if i in self.feature_layers:
                states[i] = hidden
        selected = [states[i] for i in self.feature_layers]
        return selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
