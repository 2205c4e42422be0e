"""The vision transformers of Qwen2-VL and Qwen2.5-VL (`visual.*` of their checkpoints).

An image arrives as its image processor made it: [patches, 3 x temporal_patch x patch x patch]
rows (a still image is its frame twice), the patches of each merge x merge block adjacent, and
its patch grid (t, h, w). The tower:

  patch_embed   a bias-free Conv3d over each patch's pixels (a product here: its stride is its
                kernel)
  rope          2-D: the first half of each head's rotary pairs turns by the patch's row, the
                second by its column (inv_freq over head_dim / 2, base 10000), in float32
  blocks        pre-norm: x + attn(norm1(x)), then + mlp(norm2(.)); attention bidirectional
                within each image or window (`Segments`: no padding, no masks),
                qkv and proj with bias.
                Qwen2-VL: LayerNorms, an fc1 -> act (quick_gelu) -> fc2 MLP, every block over
                the whole image.
                Qwen2.5-VL: RMSNorms, a gated MLP (gate / up / down with bias, silu), and every
                block but `fullatt_block_indexes` inside windows of window_size pixels a side
                (the patches reordered window by window in units of merge blocks, as
                transformers' `get_vision_window_index`; the order is undone after the merger)
  merger        the norm `ln_q` per patch, each merge x merge block concatenated, then
                Linear -> GELU -> Linear to the language model's width: one row per image
                token, row-major over the (h / merge) x (w / merge) grid

Parameters are plain, replicated on every tensor-parallel rank, named as in the checkpoint under
`visual.`. A call encodes images of one grid together (`ReadsImages` groups them so)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.models.vision_towers import activation


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2RMSNorm: float32 statistics, the weight applied in the input dtype."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _norm(windowed: bool, size: int) -> nn.Module:
    return VisionRMSNorm(size) if windowed else nn.LayerNorm(size, eps=1e-6)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Any, width: int, bias: bool = False) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(getattr(cfg, "in_channels", 3), width, kernel, kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, 3 * t * p * p] -> [N, width]."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1),
                        self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: "Segments") -> torch.Tensor:
        """x [N, width] of images (or windows) laid end to end, `segments` of them attending
        within themselves."""
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = segments.attend(q, k, v)  # [N, heads, head_dim]
        return self.proj(out.reshape(tokens, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half rope in float32 (as transformers' vision rope), back to x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Segments:
    """Runs of tokens [N] that attend within themselves: `lengths` in order. Runs of one
    length attend as one batch, without a mask (so SDPA keeps its fused kernels): all of them
    by a reshape where every run has the same length (a whole image; windows of a grid that is
    whole windows), else each length's runs gathered into their own batch (a grid's edge
    windows are shorter) and scattered back."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        # per distinct length: the token indices [runs, length] of its runs
        self.groups: list[torch.Tensor] = []
        if any(n != lengths[0] for n in lengths):
            starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
            sizes = torch.tensor(lengths)
            for length in sorted(set(lengths)):
                first = starts[sizes == length]
                self.groups.append((first[:, None] + torch.arange(length)[None, :]).to(device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, D] -> [N, heads, D]."""
        if not self.groups:
            count = len(self.lengths)

            def split(t: torch.Tensor) -> torch.Tensor:  # -> [runs, heads, len, D]
                return t.view(count, -1, *t.shape[1:]).transpose(1, 2)

            out = F.scaled_dot_product_attention(split(q), split(k), split(v))
            return out.transpose(1, 2).reshape(q.shape)
        out = torch.empty_like(q)
        for index in self.groups:
            def gather(t: torch.Tensor) -> torch.Tensor:
                return t[index].transpose(1, 2)  # [runs, heads, length, D]

            attended = F.scaled_dot_product_attention(gather(q), gather(k), gather(v))
            out[index] = attended.transpose(1, 2)
        return out


class GatedMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden)
        self.up_proj = nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LinearFcMLP(nn.Module):
    """Qwen3-VL's / Qwen3.5's names for the same MLP."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width, hidden)
        self.linear_fc2 = nn.Linear(hidden, width)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp: nn.Module, windowed: bool) -> None:
        super().__init__()
        self.norm1 = _norm(windowed, width)
        self.norm2 = _norm(windowed, width)
        self.attn = VisionAttention(width, heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, width: int, out_size: int, merge: int, windowed: bool) -> None:
        super().__init__()
        self.merged = width * merge * merge
        self.ln_q = _norm(windowed, width)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, out_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class LinearFcMerger(nn.Module):
    """Qwen3-VL's / Qwen3.5's merger: `norm` per patch (`after_shuffle`: over each merge block's
    concatenation, Qwen3-VL's DeepStack mergers), then linear_fc1 -> GELU -> linear_fc2 over
    each merge block."""

    def __init__(self, width: int, out_size: int, merge: int, after_shuffle: bool = False
                 ) -> None:
        super().__init__()
        self.merged = width * merge * merge
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.merged if after_shuffle else width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(-1, self.merged)
        normed = self.norm(blocks) if self.after_shuffle else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(normed)))


# the towers: Qwen2-VL's, Qwen2.5-VL's (windows, RMSNorms, a gated MLP), Qwen3.5's (learned
# position embeddings resampled to the image's grid, a patch conv with bias, linear_fc names)
# and Qwen3-VL's (Qwen3.5's with DeepStack: the outputs of `deepstack_visual_indexes` blocks
# merged by their own mergers, for the first decoder layers)
TOWER_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_vl")


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: Any, kind: str) -> None:
        super().__init__()
        assert kind in TOWER_KINDS, kind
        self.windowed = windowed = kind == "qwen2_5_vl"
        width = cfg.embed_dim if kind == "qwen2_vl" else cfg.hidden_size
        out_size = cfg.hidden_size if kind == "qwen2_vl" else cfg.out_hidden_size
        heads = cfg.num_heads
        self.merge = int(cfg.spatial_merge_size)
        self.patch_size = int(cfg.patch_size)
        self.window = int(getattr(cfg, "window_size", 0) or 0)
        self.full_blocks = set(getattr(cfg, "fullatt_block_indexes", None) or ())
        learned = kind in ("qwen3_5", "qwen3_vl")  # position table, conv bias, linear_fc names
        self.patch_embed = PatchEmbed(cfg, width, bias=learned)
        act = getattr(cfg, "hidden_act", "silu" if windowed else "quick_gelu")

        def mlp() -> nn.Module:
            if kind == "qwen2_5_vl":
                return GatedMLP(width, cfg.intermediate_size, act)
            if learned:
                return LinearFcMLP(width, cfg.intermediate_size, act)
            return PlainMLP(width, int(width * cfg.mlp_ratio), act)

        self.blocks = nn.ModuleList(VisionBlock(width, heads, mlp(), windowed)
                                    for _ in range(cfg.depth))
        self.merger: nn.Module
        self.deepstack_layers: list[int] = list(getattr(cfg, "deepstack_visual_indexes", None)
                                                or ()) if kind == "qwen3_vl" else []
        if self.deepstack_layers:
            self.deepstack_merger_list = nn.ModuleList(
                LinearFcMerger(width, out_size, self.merge, after_shuffle=True)
                for _ in self.deepstack_layers)
        if learned:
            self.merger = LinearFcMerger(width, out_size, self.merge)
            self.pos_embed: nn.Embedding | None = nn.Embedding(cfg.num_position_embeddings, width)
            self.grid_side = math.isqrt(cfg.num_position_embeddings)
        else:
            self.merger = PatchMerger(width, out_size, self.merge, windowed)
            self.pos_embed = None
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        quarter = (width // heads) // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32) / quarter), persistent=False)

    def in_blocks(self, grid: torch.Tensor) -> torch.Tensor:
        """[h, w, ...] -> [h * w, ...] in merge-block order (each merge x merge block's patches
        adjacent, row-major within it, blocks row-major), the processor's patch order."""
        h, w, m = grid.shape[0], grid.shape[1], self.merge
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2) \
            .reshape(h * w, *grid.shape[2:])

    def position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """Qwen3.5: the learned side x side table resampled to h x w (bilinear, corners
        aligned, as transformers' `get_vision_interpolation_indices_and_weights`), in float32,
        [h * w, width] in merge-block order."""
        assert self.pos_embed is not None
        table = self.pos_embed.weight.float().view(self.grid_side, self.grid_side, -1)
        resampled = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                                  align_corners=True)[0].permute(1, 2, 0)
        return self.in_blocks(resampled)

    def rope_tables(self, h: int, w: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h * w, head_dim] float32 of one frame's patches in merge-block order."""
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.cat((self.in_blocks(rows)[:, None].float() * inv_freq,
                           self.in_blocks(cols)[:, None].float() * inv_freq), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def window_order(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows of one image: the merge blocks' order window by window
        (`get_vision_window_index`) and each window's patch count."""
        side = self.window // self.merge // self.patch_size
        bh, bw = h // self.merge, w // self.merge
        index = torch.arange(t * bh * bw).reshape(t, bh, bw)
        pad_h, pad_w = (-bh) % side, (-bw) % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (bh + pad_h) // side, (bw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t * nh * nw, side * side)
        counts = (padded >= 0).sum(1)
        order = padded[padded >= 0]
        unit = self.merge * self.merge
        return order, [int(c) * unit for c in counts if c > 0]

    def forward(self, pixel_values: torch.Tensor, thw: tuple[int, int, int]) -> torch.Tensor:
        """[n, patches, 3 * t * p * p] pixels of n images with the patch grid `thw` ->
        [n, patches / merge², out_size], row-major over the image's token grid (Qwen3-VL:
        out_size x (1 + its DeepStack layers), the main features first)."""
        n, patches, _ = pixel_values.shape
        t, h, w = thw
        device = pixel_values.device
        x = self.patch_embed(pixel_values.reshape(n * patches, -1))
        if self.pos_embed is not None:
            x = x + self.position_embeddings(h, w).repeat(n * t, 1).to(x.dtype)
        cos, sin = self.rope_tables(h, w, device)
        cos, sin = cos.repeat(n * t, 1), sin.repeat(n * t, 1)
        full = Segments([patches] * n, device)
        windows = full
        unit = self.merge * self.merge
        reorder = None
        if self.windowed:
            order, lengths = self.window_order(t, h, w)
            blocks_per_image = patches // unit
            order = (order[None, :] + blocks_per_image * torch.arange(n)[:, None]).flatten()
            reorder = order.to(device)
            x = x.view(-1, unit, x.shape[-1])[reorder].reshape(x.shape)
            cos = cos.view(-1, unit, cos.shape[-1])[reorder].reshape(cos.shape)
            sin = sin.view(-1, unit, sin.shape[-1])[reorder].reshape(sin.shape)
            windows = Segments(lengths * n, device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            use_full = not self.windowed or i in self.full_blocks
            x = block(x, cos, sin, full if use_full else windows)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        merged = self.merger(x)
        if deepstack:  # Qwen3-VL: [main | DeepStack 0 | DeepStack 1 | ...] on the feature dim
            merged = torch.cat([merged, *deepstack], dim=-1)
        if reorder is not None:
            merged = merged[torch.argsort(reorder)]
        return merged.view(n, patches // unit, -1)
