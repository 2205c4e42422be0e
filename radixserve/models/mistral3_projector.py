"""Mistral3's multi_modal_projector (transformers' Mistral3MultiModalProjector): a Pixtral
tower's patch grid to rows of the text width, one per spatial_merge_size x spatial_merge_size
patches.

  norm          RMSNorm over the vision hidden size, eps the language model's rms_norm_eps
  patch_merger  each merge x merge block of patches (torch's unfold order: channel-major, then
                the block's rows and columns) concatenated, `merging_layer` (no bias) back to
                the vision hidden size; blocks row-major over the image
  linear_1      to the text width, then projector_hidden_act, then linear_2 (biases per
                multimodal_projector_bias)

transformers' projector takes one feature layer (its norm and merger are sized for one)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.norm import RMSNorm
from radixserve.models.vision_towers import activation


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[n, rows * cols, hidden] (row-major) -> [n, rows / merge * cols / merge, hidden]."""
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, rows, cols)
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)
        return self.merging_layer(blocks.transpose(1, 2))


class Mistral3Projector(nn.Module):
    def __init__(self, top_config: Any, text_hidden: int, text_eps: float) -> None:
        super().__init__()
        hidden = top_config.vision_config.hidden_size
        self.merge = int(getattr(top_config, "spatial_merge_size", 2))
        bias = bool(getattr(top_config, "multimodal_projector_bias", False))
        self.norm = RMSNorm(hidden, text_eps)
        self.patch_merger = PatchMerger(hidden, self.merge)
        self.linear_1 = nn.Linear(hidden, text_hidden, bias=bias)
        self.act = activation(getattr(top_config, "projector_hidden_act", "gelu"))
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[n, rows * cols, vision hidden] of a rows x cols patch grid (multiples of the merge)
        -> [n, rows / merge * cols / merge, text hidden]."""
        merged = self.patch_merger(self.norm(patches), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))
