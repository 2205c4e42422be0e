"""MLA on the Triton path: the MLA decode kernel against plain PyTorch, and a tiny DeepSeek-V2
run end to end on the Triton backend (extend over decompressed prefixes, absorbed decode)
against transformers (fp32; the Triton interpreter on CPU, the real kernels on a GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.attention.kernels.mla_decode import (mla_decode_attention_fwd,  # noqa: E402
                                                     mla_decode_reference)
from radixserve.config import ServerArgs  # noqa: E402
from radixserve.core.forward_batch import ForwardMode  # noqa: E402
from radixserve.executor.model_runner import ModelRunner  # noqa: E402
from tests.models.runner_driver import RunnerDriver  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_heads,num_splits,dtype", [
    (4, 1, torch.float32), (20, 4, torch.float32), (16, 3, torch.float16)])
def test_mla_decode_kernel_matches_reference(num_heads, num_splits, dtype) -> None:
    latent, rope = 32, 8
    gen = torch.Generator().manual_seed(num_heads)
    seq_lens = torch.tensor([1, 37, 70], dtype=torch.int32)
    slots_total = int(seq_lens.sum()) + 1
    kv = torch.randn(slots_total, 1, latent + rope, generator=gen).to(dtype).to(DEVICE)
    perm = torch.randperm(slots_total - 1, generator=gen) + 1
    req_to_token = torch.zeros(4, 80, dtype=torch.int32)
    start = 0
    for row, n in zip((2, 0, 3), seq_lens.tolist()):
        req_to_token[row, :n] = perm[start:start + n].to(torch.int32)
        start += n
    req_to_token = req_to_token.to(DEVICE)
    rows = torch.tensor([2, 0, 3], dtype=torch.int64, device=DEVICE)
    seq_lens = seq_lens.to(DEVICE)
    q = torch.randn(3, num_heads, latent + rope, generator=gen).to(dtype).to(DEVICE)
    out = torch.empty(3, num_heads, latent, dtype=dtype, device=DEVICE)
    mid_out = torch.empty(3, num_heads, num_splits, latent, dtype=torch.float32, device=DEVICE)
    mid_lse = torch.empty(3, num_heads, num_splits, dtype=torch.float32, device=DEVICE)
    scale = (latent + rope) ** -0.5
    mla_decode_attention_fwd(q, kv, out, req_to_token, rows, seq_lens, mid_out, mid_lse, scale,
                             latent, block_n=16)
    ref = mla_decode_reference(q, kv, req_to_token, rows, seq_lens, scale, latent)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["deepseek_v2_lite_mla"])
def test_deepseek_on_triton_backend_matches_transformers(name: str, tmp_path) -> None:
    hf_model = make_checkpoint(name, tmp_path)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device=DEVICE,
                                    max_total_tokens=1024, max_running_requests=4,
                                    attention_backend="triton", disable_cuda_graph=True))
    gen = torch.Generator().manual_seed(5)
    vocab = hf_model.config.vocab_size
    seqs = {0: torch.randint(0, vocab, (30,), generator=gen).tolist(),
            1: torch.randint(0, vocab, (9,), generator=gen).tolist()}
    driver = RunnerDriver(runner)

    def check(ours: torch.Tensor, keys: list[int]) -> None:
        for i, key in enumerate(keys):
            with torch.no_grad():
                ref = hf_model(torch.tensor([seqs[key]])).logits[0, -1]
            torch.testing.assert_close(ours[i].cpu(), ref, atol=2e-4, rtol=1e-4)

    check(driver.extend({0: seqs[0][:18], 1: seqs[1]}), [])  # prefill (no check: partial)
    check(driver.extend({0: seqs[0][18:]}), [0])  # extend on a cached prefix
    for step in range(2):  # decode, both requests
        feed = {k: [(11 * step + k) % vocab] for k in seqs}
        for k in seqs:
            seqs[k] += feed[k]
        check(driver.extend(feed), [0, 1])
    seqs[2] = torch.randint(0, vocab, (12,), generator=gen).tolist()
    feed = {2: seqs[2], 0: [3], 1: [4]}  # a MIXED pass: a new prompt plus two decodes
    seqs[0] += [3]
    seqs[1] += [4]
    check(driver.extend(feed, forward_mode=ForwardMode.MIXED), [2, 0, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_rope_kernel_matches_pytorch(dtype) -> None:
    from radixserve.layers.kernels.mla_rope import mla_rope_and_entries
    from radixserve.layers.rotary import RotaryEmbedding, default_inv_freq
    from radixserve.models.deepseek_v2 import rotate_interleaved
    rotary = RotaryEmbedding(8, 64, default_inv_freq(8, 10000.0), attention_factor=1.3)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 16 + 8, generator=gen).to(dtype)
    kv = torch.randn(5, 32 + 8, generator=gen).to(dtype)
    latent, k_pe = kv.split([32, 8], dim=-1)
    positions = torch.tensor([0, 3, 17, 40, 63])
    want_q = torch.cat((q[..., :16], rotate_interleaved(q[..., 16:], positions, rotary)), -1)
    want_entries = torch.cat((latent, rotate_interleaved(k_pe, positions, rotary)), -1)
    q_dev = q.to(DEVICE)
    entries = mla_rope_and_entries(q_dev, latent.contiguous().to(DEVICE), k_pe.to(DEVICE),
                                   positions.to(DEVICE), rotary.cos_cache.to(DEVICE),
                                   rotary.sin_cache.to(DEVICE), 16)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(q_dev.cpu(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(entries.cpu(), want_entries, atol=tol, rtol=tol)
