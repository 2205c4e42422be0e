"""The torch dequantisation of GGUF's plain block types gives gguf-py's floats bit for bit:
on random blocks (every nibble and int8 code, fp16 scales of both signs, subnormal, zero and
large) and on every tensor of the bundled SmolLM2 file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from radixserve.loader import gguf_dequant
from radixserve.loader.gguf_loader import dequantize_tensor

PLAIN = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _random_blocks(ggml_type: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scales = np.concatenate([
        rng.normal(0, 0.05, n_blocks - 4), [0.0, -0.0, 6e-8, -65504.0]]).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLQuantizationType.Q4_1:  # the minimum, also fp16
        mins = rng.normal(0, 0.1, n_blocks).astype(np.float16)
        blocks[:, 2:4] = mins.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("ggml_type", PLAIN, ids=lambda t: t.name)
def test_random_blocks_match_gguf_bitwise(ggml_type: GGMLQuantizationType) -> None:
    raw = _random_blocks(ggml_type, 1000, seed=int(ggml_type))
    want = torch.from_numpy(np.ascontiguousarray(dequantize(raw, ggml_type), np.float32))
    got = gguf_dequant.dequantize_plain(raw, ggml_type)
    assert got.dtype == torch.float32 and got.shape == want.reshape(-1).shape
    assert torch.equal(got.view(torch.int32), want.reshape(-1).view(torch.int32))


def test_other_types_are_left_to_gguf() -> None:
    assert not gguf_dequant.supports(GGMLQuantizationType.Q4_K)
    assert not gguf_dequant.supports(GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match="plain block"):
        gguf_dequant.dequantize_plain(np.zeros(144, np.uint8), GGMLQuantizationType.Q4_K)


def test_bundled_model_tensors_match_gguf_bitwise() -> None:
    from radixserve.loader.gguf_file import read_gguf
    from radixserve.loader.model_source import load_model_source
    gguf = read_gguf(load_model_source(None, "auto").model_path)
    seen = set()
    for info in gguf.tensors.values():
        if not gguf_dequant.supports(info.ggml_type) or info.ggml_type in seen:
            continue
        seen.add(info.ggml_type)
        raw = gguf.raw_tensor_bytes(info)
        want = np.ascontiguousarray(dequantize(np.asarray(raw), info.ggml_type), np.float32)
        got = dequantize_tensor(gguf, info)
        assert tuple(got.shape) == tuple(info.shape)
        assert torch.equal(got.reshape(-1).view(torch.int32),
                           torch.from_numpy(want.reshape(-1)).view(torch.int32)), info.ggml_type
    assert seen == {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
