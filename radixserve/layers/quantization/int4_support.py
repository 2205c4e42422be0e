"""Which models int4 (W4A16) checkpoints serve: dense decoders, and MoE models whose routed
experts are FusedMoE's per-expert stacks (Mixtral, Qwen2/3-MoE, DeepSeek, GLM, MiniMax:
moe/int4_experts.py). gpt-oss's stacked experts and the recurrent mixers of hybrid models would
need int4 forms of their own kernels; a checkpoint of those is refused at start-up with the
reason, not with a missing-tensor error mid-load."""
from __future__ import annotations

from torch import nn

from radixserve.layers.moe.stacked_experts import StackedExperts
from radixserve.layers.moe.ungated_experts import UngatedExperts
from radixserve.layers.quantization.int4 import Int4Config
from radixserve.layers.recurrent_mixer import RecurrentMixer


def check_int4_support(model: nn.Module, config: Int4Config | None) -> None:
    if config is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, (StackedExperts, UngatedExperts)):
            raise ValueError(f"int4 ({config.method}) checkpoints of this model's experts "
                             f"({type(module).__name__} at {name}) are not supported yet")
        if isinstance(module, RecurrentMixer):
            raise ValueError(f"int4 ({config.method}) checkpoints of hybrid recurrent models "
                             f"are not supported yet ({name} is a {type(module).__name__})")
