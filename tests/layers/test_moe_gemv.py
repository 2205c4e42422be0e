"""moe_gemv.py: the decode GEMVs of routed experts (layouts fused_moe's tests do not reach:
vec > 1 tiles, a token choosing an expert twice across tokens, scale groups narrower than a
step), and which path fused_experts takes at a token count (table, default rule, off)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels import moe_gemv  # noqa: E402
from radixserve.layers.kernels.fused_moe import fused_experts_reference  # noqa: E402
from radixserve.layers.kernels.gemv import GemvConfig  # noqa: E402
from radixserve.layers.kernels.moe_gemv import (MoeGemvConfigs, moe_gemv_configs,  # noqa: E402
                                                moe_gemv_experts)

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    return w13.to(DEVICE), w2.to(DEVICE)


@pytest.mark.parametrize("configs,hidden,inter", [
    (MoeGemvConfigs(GemvConfig(4, 32, 4, 1), GemvConfig(8, 16, 4, 2)), 64, 48),
    (MoeGemvConfigs(GemvConfig(2, 32, 2, 1, vec=8), GemvConfig(4, 32, 4, 1, vec=4)), 64, 48),
    # K tails: 72 = 2 x 32 + 8 and 40 = 32 + 8 columns (masked last steps)
    pytest.param(MoeGemvConfigs(GemvConfig(4, 32, 4, 1), GemvConfig(2, 32, 4, 2, vec=4)), 72, 40,
                 marks=pytest.mark.slow_interpreted)])  # 9 s interpreted
def test_gemv_experts_match_the_reference_with_shared_experts(configs, hidden, inter) -> None:
    """Three tokens, top 3 of 5 experts, two tokens sharing experts; weights not renormalised
    (the routing weight is the down kernel's per-choice scale)."""
    w13, w2 = _weights(5, hidden, inter, torch.float32)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids = torch.tensor([[4, 0, 2], [2, 4, 1], [3, 1, 0]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.5, 0.3, 0.1], [0.7, 0.2, 0.05], [0.2, 0.2, 0.2]], device=DEVICE)
    fitted = moe_gemv.fit_block_k(configs.gate_up, hidden, None), \
        moe_gemv.fit_block_k(configs.down, inter, None)
    got = moe_gemv_experts(x, w13, w2, weights, ids, MoeGemvConfigs(*fitted))
    ref = fused_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block,hidden,inter,configs", [
    # 16-column groups (a tensor-parallel rank's split inside 128-column blocks): the steps cut
    # to the group
    (16, 64, 32, None),
    # 64-column groups over 32-column steps (two steps a group), K tails (200 = 3 x 64 + 8,
    # 72 = 64 + 8), vec 1 and 16
    pytest.param(64, 200, 72, MoeGemvConfigs(GemvConfig(4, 32, 4, 1), GemvConfig(2, 32, 4, 1)),
                 marks=pytest.mark.slow),  # the vec-16 case below takes the same steps
    pytest.param(64, 200, 72, MoeGemvConfigs(GemvConfig(4, 32, 4, 1, vec=16),
                                             GemvConfig(2, 32, 4, 1, vec=16)),
                 marks=pytest.mark.slow_interpreted),  # 24 s interpreted
    # steps over 2 and 4 whole groups (a 128-column block's checkpoint has 128-wide ones),
    # the last step's groups past K scaled by 0 (10 s in the interpreter; the GPU runs it)
    pytest.param(64, 200, 72, MoeGemvConfigs(GemvConfig(4, 128, 4, 1),
                                             GemvConfig(2, 128, 4, 1)),
                 marks=pytest.mark.slow),
    pytest.param(64, 448, 200, MoeGemvConfigs(GemvConfig(4, 256, 4, 1, vec=16),
                                              GemvConfig(2, 256, 4, 1, vec=16)),
                 marks=pytest.mark.slow)])  # 10 s in the interpreter
def test_block_scaled_experts(block: int, hidden: int, inter: int,
                              configs: MoeGemvConfigs | None) -> None:
    """FP8 codes with a scale per row and K group: each step stays inside one group or spans
    whole groups, each column scaled by its group's scale, so the result is the dequantised
    product's."""
    from radixserve.layers.quantization.fp8 import dequantize_weight
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _weights(4, hidden, inter, torch.float32, seed=2)
    quantized = []
    for w in (w13, w2):
        groups = -(-w.shape[2] // block)
        scales = torch.rand(w.shape[0], w.shape[1], groups, generator=gen) * 1e-3 + 1e-3
        expanded = scales.repeat_interleave(block, 2)[..., :w.shape[2]]
        codes = (w.cpu() / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
        quantized.append((codes, scales))
    (c13, s13), (c2, s2) = quantized
    x = torch.randn(2, hidden, generator=gen).to(torch.float16).to(DEVICE)
    ids = torch.tensor([[1, 3], [3, 0]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1]], device=DEVICE)
    if configs is None:
        configs = moe_gemv_configs(1, 2, c13, c2, block)  # the configs, for any token count
        assert configs is not None and configs.gate_up.block_k == block == configs.down.block_k
    else:
        wanted = configs.gate_up.block_k
        configs = MoeGemvConfigs(moe_gemv.fit_block_k(configs.gate_up, hidden, block),
                                 moe_gemv.fit_block_k(configs.down, inter, block))
        assert configs.gate_up.block_k == wanted
    got = moe_gemv_experts(x, c13.to(DEVICE), c2.to(DEVICE), weights, ids, configs,
                           (s13.to(DEVICE), s2.to(DEVICE), block))
    deq = [torch.stack([dequantize_weight(c, s, block, torch.float32) for c, s in zip(cs, ss)])
           for cs, ss in ((c13, s13), (c2, s2))]
    ref = fused_experts_reference(x.cpu().float(), deq[0], deq[1], weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)


def test_default_rule_and_switch(monkeypatch) -> None:
    # the rule's token counts, its limit on rereads left aside (8 experts are reread at once)
    monkeypatch.setattr(moe_gemv, "MAX_REREAD", 100.0)
    w13, w2 = _weights(8, 64, 32, torch.float32)
    assert moe_gemv_configs(1, 2, w13, w2, None) is not None
    assert moe_gemv_configs(2, 2, w13, w2, None) is None  # top 2: one token only
    assert moe_gemv_configs(4, 4, w13, w2, None) is not None  # 4+ choices: up to 4 tokens
    assert moe_gemv_configs(5, 4, w13, w2, None) is None
    assert moe_gemv_configs(0, 2, w13, w2, None) is None
    monkeypatch.undo()
    # rereads: (experts, top-k) -> the token counts the GEMVs take; Qwen3-30B-A3B and
    # DeepSeek-V2-Lite won at 4 tokens, gpt-oss-20b lost there, Mixtral from 2
    for shape, most in (((128, 8), 4), ((64, 6), 4), ((32, 4), 3), ((8, 2), 1), ((8, 8), 1)):
        taken = [t for t in range(1, 6) if moe_gemv.default_takes(t, shape[1], shape[0])]
        assert taken == list(range(1, most + 1)), shape
    # a K the default steps do not divide: the last step masks its tail
    odd13, odd2 = _weights(8, 40, 24, torch.float32)
    odd = moe_gemv_configs(1, 2, odd13, odd2, None)
    assert odd is not None and (odd.gate_up.block_k, odd.down.block_k) == (64, 32)
    # steps inside the scale groups; none where a group is narrower than 16 columns
    assert moe_gemv.fit_block_k(GemvConfig(4, 256, 4, 3), 1408, 48).block_k == 16
    assert moe_gemv.fit_block_k(GemvConfig(4, 256, 4, 3), 1408, 8) is None
    monkeypatch.setattr(moe_gemv, "ENABLED", False)
    assert moe_gemv_configs(1, 2, w13, w2, None) is None


def test_swept_table_decides_per_token_count(monkeypatch, tmp_path) -> None:
    """The entry of the smallest swept count >= T; null (the grouped path won) and counts past
    the table's largest take the grouped path."""
    from radixserve.layers.kernels import fused_moe
    w13, w2 = _weights(8, 64, 32, torch.float32)
    entry = {"gate_up": dict(block_n=2, block_k=32, num_warps=2, num_stages=1, vec=4),
             "down": dict(block_n=4, block_k=16, num_warps=4, num_stages=2)}
    (tmp_path / moe_gemv.table_name("bf16", 8, 64, 64)).write_text(
        json.dumps({"1": entry, "2": None, "4": entry}))
    monkeypatch.setattr(fused_moe, "CONFIG_DIR", tmp_path)
    moe_gemv._swept_table.cache_clear()
    try:
        one = moe_gemv_configs(1, 8, w13, w2, None)
        assert one == MoeGemvConfigs(GemvConfig(2, 32, 2, 1, 4), GemvConfig(4, 16, 4, 2))
        assert moe_gemv_configs(2, 8, w13, w2, None) is None
        assert moe_gemv_configs(3, 8, w13, w2, None) == one
        assert moe_gemv_configs(5, 2, w13, w2, None) is None
        # block-scaled FP8 (a scale group): the per-row tables do not apply, the default does
        assert moe_gemv_configs(1, 8, w13, w2, 16) not in (None, one)
    finally:
        moe_gemv._swept_table.cache_clear()


def test_half_precision_rows_round_as_the_grouped_path_rounds_them() -> None:
    """fp16 (bf16 on a GPU alike): each choice's weighted row rounded, the k rows summed in
    float32 and rounded once, as the grouped path and torch's sum do; a single rounding of the
    float32 sum (more exact, but not what models decoded with before) differs in many places."""
    torch.manual_seed(0)
    w13, w2 = _weights(6, 64, 64, torch.float16, seed=4)
    x = torch.randn(2, 64).to(torch.float16).to(DEVICE)
    ids = torch.tensor([[0, 1, 2, 3], [5, 4, 1, 0]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], device=DEVICE)
    configs = moe_gemv.default_configs(False)
    got = moe_gemv_experts(x, w13, w2, weights, ids, configs).cpu()
    rows = torch.zeros(2, 4, 64, dtype=torch.float64)
    for t in range(2):
        for j in range(4):
            e = int(ids[t, j])
            gate_up = (w13[e].double().cpu() @ x[t].double().cpu()).to(torch.float16).double()
            act = (torch.nn.functional.silu(gate_up[:64]).to(torch.float16).double()
                   * gate_up[64:]).to(torch.float16).double()
            rows[t, j] = float(weights[t, j]) * (w2[e].double().cpu() @ act)
    per_row = rows.to(torch.float16).double().sum(dim=1).to(torch.float16)
    once = rows.sum(dim=1).to(torch.float16)
    assert (got == per_row).float().mean() > 0.95
    assert (once == per_row).float().mean() < 0.9  # the two roundings do differ here
