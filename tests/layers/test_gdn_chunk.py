"""kernels/gdn_chunk.py: the chunk-to-chunk scan of the chunked gated delta rule against the
torch loop of layers/gated_delta_rule.py, on terms built from random sequences (several chunks,
padded tails, key and value widths below and above the kernel's blocks), and the whole chunked
rule through it against the token-by-token recurrence."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.gated_delta_rule import (CHUNK, chunk_terms, chunked,  # noqa: E402
                                                prepare_qk, recurrent_step, scan_chunks)
from radixserve.layers.kernels.gdn_chunk import scan_chunks_triton  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sequences(batch: int, chunks: int, key_heads: int, heads: int, key_dim: int,
               value_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Prepared q, k [R, L, H, Dk], v, g, beta, with the last 10 tokens of sequence 0 padding
    (k = v = g = beta = 0), and a random start state."""
    gen = torch.Generator().manual_seed(seed)
    length = chunks * CHUNK
    q, k = prepare_qk(torch.randn(batch, length, key_heads, key_dim, generator=gen),
                      torch.randn(batch, length, key_heads, key_dim, generator=gen),
                      heads // key_heads)
    v = torch.randn(batch, length, heads, value_dim, generator=gen)
    g = -torch.rand(batch, length, heads, generator=gen) * 0.3
    beta = torch.rand(batch, length, heads, generator=gen)
    for x in (k, v, g, beta):
        x[0, length - 10:] = 0
    start = torch.randn(batch, heads, key_dim, value_dim, generator=gen) * 0.5
    return q, k, v, g, beta, start


@pytest.mark.parametrize("batch,chunks,key_heads,heads,key_dim,value_dim", [
    (2, 3, 2, 4, 16, 8),  # widths below the kernel's 16
    (1, 2, 1, 2, 32, 48),  # a masked value tail
    (1, 2, 1, 1, 128, 128)])  # Qwen3-Next's head widths, two value blocks
@pytest.mark.parametrize("precise", [True, False])
def test_scan_matches_the_torch_loop(batch, chunks, key_heads, heads, key_dim, value_dim,
                                     precise) -> None:
    q, k, v, g, beta, start = _sequences(batch, chunks, key_heads, heads, key_dim,
                                         value_dim, seed=chunks)
    terms = chunk_terms(q, k, v, g, beta)
    ref_out, ref_state = scan_chunks(terms, start)
    out, state = scan_chunks_triton(type(terms)(*(t.to(DEVICE) for t in terms)),
                                    start.to(DEVICE), precise)
    # TF32 products (bf16 models on a GPU) keep 10 mantissa bits
    tol = 1e-4 if precise or DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(state.cpu(), ref_state, atol=tol, rtol=tol)


def test_chunked_through_the_kernel_equals_the_recurrence() -> None:
    q, k, v, g, beta, start = _sequences(1, 2, 2, 4, 16, 8, seed=5)
    length = q.shape[1] - 10  # sequence 0's real tokens
    state, steps = start, []
    for t in range(length):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        steps.append(o)
    to = {"device": DEVICE}
    out, final = chunked(q.to(**to), k.to(**to), v.to(**to), g.to(**to), beta.to(**to),
                         start.to(**to),
                         scan=lambda terms, s: scan_chunks_triton(terms, s, precise=True))
    torch.testing.assert_close(out[:, :length].cpu(), torch.stack(steps, 1), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(final.cpu(), state, atol=1e-4, rtol=1e-4)
