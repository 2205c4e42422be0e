"""Whole-tensor dequantisation of GGUF's plain block formats (Q4_0, Q4_1, Q8_0) in torch.

gguf-py's `dequantize` runs numpy over row groups of a few thousand values at a time: on a
2-core CPU the bundled SmolLM2-135M (Q4_1 with a Q8_0 embedding) took ~2.5 s of its ~3.5 s load
in those calls. These take each tensor as one array of blocks and give the same floats bit for
bit (the same float32 products and sums, in the same order: tests/loader/test_gguf_dequant.py).
Other types (the K-quants, Q5_*, IQ*) go through gguf-py as before.

Block layouts (ggml): Q8_0 = fp16 scale d + 32 int8 codes, x = d * q. Q4_0 = d + 16 bytes of
nibbles, the low nibbles the block's first 16 values and the high nibbles its last 16,
x = d * (q - 8). Q4_1 = d + fp16 minimum m + the same nibbles, x = d * q + m.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_PLAIN = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def supports(ggml_type: GGMLQuantizationType) -> bool:
    return ggml_type in _PLAIN


def _fp16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as a float32 column."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] packed bytes -> [blocks, 32] values: low nibbles first, then high."""
    return torch.cat((codes & 0x0F, codes >> 4), dim=1)


def dequantize_plain(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The float32 values (flat) of a Q4_0 / Q4_1 / Q8_0 tensor's raw bytes."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    data = np.asarray(raw).reshape(-1)
    blocks = torch.from_numpy(np.array(data.view(np.uint8), copy=True)).view(-1, type_size)
    d = _fp16_column(blocks, 0)
    if ggml_type == GGMLQuantizationType.Q8_0:
        codes = blocks[:, 2:].contiguous().view(torch.int8).float()
        values = codes * d
    elif ggml_type == GGMLQuantizationType.Q4_0:
        values = d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    elif ggml_type == GGMLQuantizationType.Q4_1:
        values = d * _nibbles(blocks[:, 4:]).float() + _fp16_column(blocks, 2)
    else:
        raise ValueError(f"not a plain block type: {ggml_type!r}")
    assert values.shape[1] == block_size
    return values.reshape(-1)
