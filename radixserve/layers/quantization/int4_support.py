"""Which models int4 (W4A16) checkpoints serve: dense decoders, and MoE models whose routed
experts are FusedMoE's per-expert stacks (Mixtral, Qwen2/3-MoE, DeepSeek, GLM, MiniMax:
moe/int4_experts.py). The recurrent mixers of hybrid models would need int4 forms of their own
kernels; such a checkpoint is refused once the model is built, with the reason, not with a
missing-tensor error mid-load (gpt-oss's and Nemotron-H's experts refuse as they are built:
`FusedMoE.supports_int4`)."""
from __future__ import annotations

from torch import nn

from radixserve.layers.quantization.int4 import Int4Config
from radixserve.layers.recurrent_mixer import RecurrentMixer


def check_int4_support(model: nn.Module, config: Int4Config | None) -> None:
    if config is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, RecurrentMixer):
            raise ValueError(f"int4 ({config.method}) checkpoints of hybrid recurrent models "
                             f"are not supported yet ({name} is a {type(module).__name__})")
