"""The fused-MoE kernels (alignment + grouped GEMMs, and moe_gemv.py's decode GEMVs) against a
per-pair PyTorch reference, and
the CPU expert loop against the same reference (Triton interpreter on CPU at small shapes)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels.fused_moe import (fused_experts,  # noqa: E402
                                                 fused_experts_reference,
                                                 moe_align_block_size)
from radixserve.layers.moe.experts import FusedMoE  # noqa: E402
from radixserve.layers.moe.router import RoutingConfig, select_experts  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["grouped", "gemv"])
def moe_path(request, monkeypatch):
    """Which of fused_experts' two paths runs: the grouped GEMMs, or (any token count) the
    decode GEMVs of moe_gemv.py; afterwards, that the path asked for is the one that ran."""
    from radixserve.layers.kernels import fused_moe, moe_gemv
    monkeypatch.setattr(moe_gemv, "ENABLED", request.param == "gemv")
    monkeypatch.setattr(moe_gemv, "default_takes", lambda *counts: True)
    calls = []
    gemv = fused_moe.moe_gemv_experts

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "moe_gemv_experts", recording)
    yield request.param
    assert bool(calls) == (request.param == "gemv")


def _problem(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
             dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk = select_experts(logits, RoutingConfig(num_experts, top_k, renormalize=True))
    return [t.to(DEVICE) for t in (x, w13, w2, topk.weights, topk.ids)]


def test_alignment_sorts_pairs_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 4, 5)
    flat = ids.reshape(-1)
    assert int(total) == 4 + 4 + 4 + 4  # experts 0,1,2,3 used; each padded to a block
    for block in range(int(total) // 4):
        rows = sorted_ids[block * 4:(block + 1) * 4]
        real = rows[rows < flat.numel()]
        assert real.numel() > 0 and all(int(flat[p]) == int(expert_ids[block]) for p in real)
    assert sorted(int(p) for p in sorted_ids if p < flat.numel()) == list(range(8))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,dtype", [
    (1, 4, 2, torch.float32), (5, 8, 2, torch.float32), (40, 6, 3, torch.float16)])
def test_fused_experts_match_reference(num_tokens, num_experts, top_k, dtype,
                                       moe_path) -> None:
    if moe_path == "gemv" and num_tokens > 16:  # the GEMVs serve decode's few tokens; 40
        num_tokens = 12  # tokens' 120 pairs took 26 s in the interpreter
    x, w13, w2, weights, ids = _problem(num_tokens, num_experts, top_k, 32, 48, dtype)
    got = fused_experts(x, w13, w2, weights, ids).float()
    ref = fused_experts_reference(x, w13, w2, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_fused_experts_with_biases_and_clamped_swiglu(num_tokens: int, moe_path) -> None:
    """gpt-oss's experts: biases in both products' epilogues (the down one before the routing
    weight), the clamped SwiGLU between them; the grouped kernels, the decode GEMVs, the CPU
    loop and the reference agree."""
    from radixserve.layers.moe.router import TopK
    x, w13, w2, weights, ids = _problem(num_tokens, 4, 2, 32, 48, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    biases = tuple((torch.randn(4, n, generator=gen) * 0.5).to(DEVICE) for n in (96, 32))
    swiglu = (1.702, 0.5)  # a limit low enough to clamp these values
    ref = fused_experts_reference(x, w13, w2, weights, ids, biases, swiglu)
    got = fused_experts(x, w13, w2, weights, ids, biases=biases, swiglu=swiglu).float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, fused_experts_reference(x, w13, w2, weights, ids), atol=1e-2)
    from radixserve.layers.moe.stacked_experts import StackedExperts
    moe = StackedExperts(4, 32, 48, "swigluoai", alpha=1.702, limit=0.5)
    for param, value in ((moe.w13_weight, w13), (moe.w2_weight, w2), (moe.w13_bias, biases[0]),
                         (moe.w2_bias, biases[1])):
        param.data.copy_(value.cpu())
    loop = moe.forward_native(x.cpu(), TopK(weights.cpu(), ids.cpu()))
    torch.testing.assert_close(loop, ref.cpu(), atol=1e-4, rtol=1e-4)


def test_cpu_expert_loop_matches_reference() -> None:
    x, w13, w2, weights, ids = [t.cpu() for t in _problem(9, 5, 2, 16, 24, torch.float32, 3)]
    moe = FusedMoE(5, 16, 24)
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    from radixserve.layers.moe.router import TopK
    got = moe.forward_native(x, TopK(weights, ids))
    torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_ungated_experts_match_their_loop(num_tokens: int, moe_path) -> None:
    """Nemotron-H's experts, down(relu(up x)^2): the fused kernels (grouped GEMMs with the
    activation between them, or the GEMVs' ungated form), and the expert loop, against a
    per-pair reference."""
    from radixserve.layers.activation import relu_squared
    from radixserve.layers.moe.router import TopK
    from radixserve.layers.moe.ungated_experts import UngatedExperts
    x, w13, w2, weights, ids = _problem(num_tokens, 5, 2, 16, 24, torch.float32, 5)
    up = w13[:, :24]
    expected = torch.zeros(num_tokens, 16)
    for t in range(num_tokens):
        for j in range(2):
            e = int(ids[t, j])
            expected[t] += float(weights[t, j]) * (
                w2[e].cpu() @ relu_squared(up[e].cpu() @ x[t].cpu()))
    fused = fused_experts(x, up.contiguous(), w2, weights, ids, activation="relu2")
    torch.testing.assert_close(fused.cpu(), expected, atol=1e-4, rtol=1e-4)
    moe = UngatedExperts(5, 16, 24, "relu2")
    moe.w13_weight.data.copy_(up.cpu())
    moe.w2_weight.data.copy_(w2.cpu())
    loop = moe.forward_native(x.cpu(), TopK(weights.cpu(), ids.cpu()))
    torch.testing.assert_close(loop, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 2, 8, 16), (5, 2, 8, 16), (70, 3, 6, 4), (33, 8, 128, 16), (1, 6, 64, 16),
    (8, 10, 512, 16)])  # Qwen3-Next's experts
def test_align_kernel_matches_torch_alignment(num_tokens, top_k, num_experts, block_m) -> None:
    from radixserve.layers.kernels.moe_align import moe_align_block_size_triton
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)]).to(torch.int32).to(DEVICE)
    got = moe_align_block_size_triton(ids, block_m, num_experts)
    want = moe_align_block_size(ids, block_m, num_experts)
    total = int(want[2])
    assert int(got[2]) == total
    assert torch.equal(got[0][:total], want[0][:total])  # same pairs, same order per expert
    assert torch.equal(got[1][:total // block_m], want[1][:total // block_m])


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,scale", [
    (1, 8, 2, True, 1.0), (7, 128, 8, True, 1.0), (5, 64, 6, False, 2.5), (3, 60, 2, False, 1.0)])
def test_softmax_topk_kernel_matches_torch_routing(num_tokens, num_experts, top_k, renormalize,
                                                   scale) -> None:
    from radixserve.layers.kernels.moe_router import softmax_topk
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(2))
    weights, ids = softmax_topk(logits.to(DEVICE), top_k, renormalize, scale)
    ref = select_experts(logits, RoutingConfig(num_experts, top_k, renormalize=renormalize,
                                               scaling_factor=scale))
    mine, theirs = torch.argsort(ids.cpu(), 1), torch.argsort(ref.ids, 1)
    assert torch.equal(ids.cpu().gather(1, mine), ref.ids.gather(1, theirs))
    torch.testing.assert_close(weights.cpu().gather(1, mine), ref.weights.gather(1, theirs))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,groups,topk_group,renormalize,bias", [
    (2, 256, 8, 8, 4, True, True),  # DeepSeek-V3 / R1
    (3, 384, 8, 1, 1, True, True),  # Kimi-K2: one group
    (5, 64, 6, 8, 3, False, True), (4, 16, 3, 4, 2, True, False),
    (3, 8, 2, 8, 2, True, True)])  # groups of one expert: a group scores its one best
def test_sigmoid_topk_kernel_matches_torch_routing(num_tokens, num_experts, top_k, groups,
                                                   topk_group, renormalize, bias) -> None:
    from radixserve.layers.kernels.moe_router import sigmoid_grouped_topk
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    correction = torch.randn(num_experts, generator=gen) * 0.5 if bias else None
    weights, ids = sigmoid_grouped_topk(
        logits.to(DEVICE), None if correction is None else correction.to(DEVICE), top_k,
        groups, topk_group, renormalize, 2.5)
    ref = select_experts(logits, RoutingConfig(
        num_experts, top_k, renormalize=renormalize, num_groups=groups, topk_group=topk_group,
        scaling_factor=2.5, scoring="sigmoid"), correction)
    mine, theirs = torch.argsort(ids.cpu(), 1), torch.argsort(ref.ids, 1)
    assert torch.equal(ids.cpu().gather(1, mine), ref.ids.gather(1, theirs))
    torch.testing.assert_close(weights.cpu().gather(1, mine), ref.weights.gather(1, theirs))


@pytest.mark.parametrize("block", [None, 16])
def test_fused_experts_with_fp8_weights_match_the_dequantised_experts(block, moe_path) -> None:
    from radixserve.layers.quantization.fp8 import dequantize_weight, quantize_per_channel
    x, w13, w2, weights, ids = _problem(6, 4, 2, 32, 48, torch.float16, seed=5)

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if block is None:
            codes, scales = zip(*(quantize_per_channel(e.float().cpu()) for e in w))
            return torch.stack(codes), torch.stack(scales)
        groups = -(-w.shape[2] // block)
        scales = torch.rand(w.shape[0], w.shape[1], groups) * 1e-3 + 1e-3
        codes = (w.float().cpu() / scales.repeat_interleave(block, 2)[..., :w.shape[2]]).clamp(
            -448, 448).to(torch.float8_e4m3fn)
        return codes, scales

    (c13, s13), (c2, s2) = quantize(w13), quantize(w2)
    got = fused_experts(x, c13.to(DEVICE), c2.to(DEVICE), weights, ids,
                        (s13.to(DEVICE), s2.to(DEVICE), block)).float()
    deq13 = torch.stack([dequantize_weight(c, s, block, torch.float32) for c, s in zip(c13, s13)])
    deq2 = torch.stack([dequantize_weight(c, s, block, torch.float32) for c, s in zip(c2, s2)])
    ref = fused_experts_reference(x.cpu().float(), deq13, deq2, weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.cpu(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_tokens,zeros,dtype", [(3, True, torch.float32),
                                                    (40, False, torch.float16),
                                                    (300, True, torch.float32)])
def test_fused_experts_with_int4_weights_match_the_dequantised_experts(num_tokens, zeros,
                                                                       dtype) -> None:
    """Packed int4 stacks (groups of 16, zero points or 8) through the grouped GEMMs."""
    from radixserve.layers.moe.int4_experts import Int4ExpertStacks
    from radixserve.layers.quantization.int4 import dequantize_int4, pack_int32
    x, w13, w2, weights, ids = _problem(num_tokens, 4, 2, 32, 48, dtype, seed=6)
    gen = torch.Generator().manual_seed(8)

    def stack(e: int, n: int, k: int):
        codes = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(e, n, k // 16, generator=gen) * 0.02 + 0.005).to(dtype)
        z = torch.randint(0, 16, (e, n, k // 16), generator=gen, dtype=torch.uint8) \
            if zeros else None
        dense = torch.stack([dequantize_int4(codes[i], scales[i], None if z is None else z[i],
                                             torch.arange(k) // 16, torch.float32)
                             for i in range(e)])
        packed = pack_int32(codes.reshape(e * n, k)).view(e, n, k // 8)
        return packed, scales, z, dense

    q13, s13, z13, d13 = stack(4, 96, 32)
    q2, s2, z2, d2 = stack(4, 32, 48)
    on = (lambda t: None if t is None else t.to(DEVICE))
    got = fused_experts(x, q13.to(DEVICE), q2.to(DEVICE), weights, ids,
                        int4=Int4ExpertStacks(on(s13), on(z13), on(s2), on(z2), 16, 16)).float()
    ref = fused_experts_reference(x.cpu().float(), d13, d2, weights.cpu(), ids.cpu())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind,num_experts", [("softmax", 64), ("sigmoid", 72),
                                              ("sigmoid", 384)])
def test_router_kernels_keep_ids_in_range_on_nan_logits(kind: str, num_experts: int) -> None:
    """A NaN hidden state (a broken request) must not route to an expert past the weights:
    ids index the experts' kernels' weights directly."""
    from radixserve.layers.kernels.moe_router import sigmoid_grouped_topk, softmax_topk
    logits = torch.randn(3, num_experts, generator=torch.Generator().manual_seed(5))
    logits[0] = float("nan")
    logits[1, : num_experts // 2] = float("nan")
    if kind == "softmax":
        _, ids = softmax_topk(logits.to(DEVICE), 4, True)
    else:
        _, ids = sigmoid_grouped_topk(logits.to(DEVICE), None, 4, 1, 1, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < num_experts
