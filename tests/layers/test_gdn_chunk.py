"""kernels/gdn_chunk.py: the chunked gated delta rule in two launches against the torch form of
layers/gated_delta_rule.py on random sequences (several chunks, padded tails, start states, key
and value widths below and above the kernels' blocks), and against the token-by-token
recurrence; kernels/causal_conv.py: the extend's conv + SiLU read from packed tokens and written
padded, and the conv states after it, against the torch form."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.gated_delta_rule import (CHUNK, chunked, conv_extend,  # noqa: E402
                                                prepare_qk, recurrent_step)
from radixserve.layers.kernels.causal_conv import (conv_extend_padded,  # noqa: E402
                                                   conv_states_after)
from radixserve.layers.kernels.gdn_chunk import chunked_triton  # noqa: E402

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
    (2, 3, 2, 4, 16, 8),  # widths below the kernels' 16
    (1, 2, 1, 2, 32, 48),  # a masked value tail
    (1, 2, 1, 1, 128, 128)])  # Qwen3-Next's head widths, two value blocks
def test_kernels_match_the_torch_form(batch, chunks, key_heads, heads, key_dim,
                                      value_dim) -> None:
    q, k, v, g, beta, start = _sequences(batch, chunks, key_heads, heads, key_dim,
                                         value_dim, seed=chunks)
    ref_out, ref_state = chunked(q, k, v, g, beta, start)
    out, state = chunked_triton(*(x.to(DEVICE) for x in (q, k, v, g, beta, start)))
    # TF32 products on a GPU keep 10 mantissa bits; the interpreter's are float32
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(state.cpu(), ref_state, atol=tol, rtol=tol)


def _assert_kernels_equal_the_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         g: torch.Tensor, beta: torch.Tensor,
                                         start: torch.Tensor, length: int) -> None:
    """chunked_triton's outputs over the first `length` tokens and its final state against
    the token-by-token recurrence (the tokens past `length` are padding)."""
    state, steps = start, []
    for t in range(length):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        steps.append(o)
    out, final = chunked_triton(*(x.to(DEVICE) for x in (q, k, v, g, beta, start)))
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(out[:, :length].cpu(), torch.stack(steps, 1), atol=tol,
                               rtol=tol)
    torch.testing.assert_close(final.cpu(), state, atol=tol, rtol=tol)


def test_kernels_equal_the_recurrence() -> None:
    q, k, v, g, beta, start = _sequences(1, 2, 2, 4, 16, 8, seed=5)
    _assert_kernels_equal_the_recurrence(q, k, v, g, beta, start, q.shape[1] - 10)


def test_kernels_stay_exact_on_a_run_of_one_token() -> None:
    """One key repeated over a whole chunk (a run of spaces or newlines after the conv) with
    slow decay: A's powers grow like binomial coefficients (~1e17) before they cancel, which
    an inverse by repeated squaring lost entirely; forward substitution keeps it."""
    gen = torch.Generator().manual_seed(3)
    length, key_dim, value_dim = 2 * CHUNK, 32, 16
    q, k = prepare_qk(torch.randn(1, length, 1, key_dim, generator=gen),
                      torch.randn(1, 1, 1, key_dim, generator=gen).expand(
                          1, length, 1, key_dim).contiguous(), 1)
    v = torch.randn(1, length, 1, value_dim, generator=gen)
    g, beta = torch.full((1, length, 1), -0.001), torch.full((1, length, 1), 0.9)
    start = torch.zeros(1, 1, key_dim, value_dim)
    _assert_kernels_equal_the_recurrence(q, k, v, g, beta, start, length)


@pytest.mark.parametrize("width,bias", [(3, False), (1, False), (3, True)])
def test_conv_kernel_matches_the_torch_form(width: int, bias: bool) -> None:
    """Three packed sequences (one shorter than the conv's reach, continuing its row's
    inputs; one from position 0; one of 70 tokens continuing), 200 channels in a wider
    row, state rows picked out of order; with a bias (Mamba-2's conv) or without."""
    gen = torch.Generator().manual_seed(width)
    lens, starts, keep = [2, 70, 9], [3, 5, 75], [True, False, True]
    channels, padded_len = 200, 128
    mixed = torch.randn(90, channels + 40, generator=gen)[:, :channels]  # a strided view
    weight = torch.randn(channels, width + 1, generator=gen) * 0.5
    conv_states = torch.randn(5, width, channels, generator=gen)
    conv_bias = torch.randn(channels, generator=gen) if bias else None
    rows = torch.tensor([4, 1, 2])
    expected_out = torch.zeros(3, padded_len, channels)
    expected_states = []
    for r, (s, n, k) in enumerate(zip(starts, lens, keep)):
        start = conv_states[rows[r]] if k else torch.zeros(width, channels)
        out, full = conv_extend(mixed[None, s:s + n], weight, start[None], conv_bias)
        expected_out[r, :n] = out[0]
        expected_states.append(full[0, n:])
    to = {"device": DEVICE}
    args = (conv_states.to(**to), rows.to(**to), torch.tensor(starts, **to),
            torch.tensor(lens, **to), torch.tensor(keep, **to))
    out = conv_extend_padded(mixed.to(**to), weight.to(**to), *args, padded_len,
                             None if conv_bias is None else conv_bias.to(**to))
    torch.testing.assert_close(out.cpu(), expected_out, atol=1e-5, rtol=1e-5)
    states = conv_states_after(mixed.to(**to), *args)
    torch.testing.assert_close(states.cpu(), torch.stack(expected_states))


def test_a_failing_extend_kernel_hands_over_to_the_torch_form(caplog) -> None:
    from radixserve.layers.recurrent_mixer import KernelGuard
    guard = KernelGuard()
    guard.usable = True

    def broken(x: int) -> int:
        raise RuntimeError("out of resource: shared memory")

    assert guard.run(lambda x: x + 1, 1) == 2 and guard.usable
    assert guard.run(broken, 1) is None and not guard.usable
    assert "broken failed (RuntimeError" in caplog.text
