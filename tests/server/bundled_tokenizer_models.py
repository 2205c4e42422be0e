"""Tiny random decoders that carry the bundled model's tokenizer, saved as HF folders, for
server tests that send text (2 layers, hidden 64, 4 heads, 2 KV heads, seed 0)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_tiny_model(folder: Path, config_cls: Any, auto_cls: Any, matrix_std: float | None = None,
                    **config: Any) -> Any:
    """Build `auto_cls.from_config(config_cls(...))` over the bundled tokenizer's vocabulary,
    its matrices redrawn from N(0, matrix_std) when given, and save it with the tokenizer in
    `folder`; returns the model."""
    from radixserve.loader.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(None)  # the bundled model's
    hf_config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, **config)
    torch.manual_seed(0)
    model = auto_cls.from_config(hf_config)
    if matrix_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0, matrix_std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
