"""The per-row LoRA kernels (layers/kernels/lora_rows.py) against the definition: each row plus
its own slot's (x A_s^T) B_s^T, rows without a slot untouched (Triton interpreter on the CPU)."""
from __future__ import annotations

import pytest
import torch

from radixserve.layers.kernels.lora_rows import K_CHUNK, add_lora_rows

# the Triton interpreter on the CPU (conftest), the compiled kernels on a GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, a, b, slots, width, out):
    want = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            cols = slice(s * width, (s + 1) * width)
            want[t] += (x[t].double() @ a[cols].double().t()) @ b[:, cols].double().t()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,in_features,out_features,width,num_slots", [
    (1, 64, 48, 8, 1),          # one row, one K split, fewer outputs than a block
    (5, 1100, 200, 24, 3),      # three K splits (the last partial), width not a power of 2
    (3, 96, 300, 48, 2),        # width over one row block of A (MAX_BLOCK_R)
])
def test_each_row_gets_its_own_slots_delta(dtype, tokens, in_features, out_features, width,
                                           num_slots) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + width)
    x = torch.randn(tokens, in_features, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(num_slots * width, in_features, generator=gen) * 0.1).to(DEVICE, dtype)
    b = (torch.randn(out_features, num_slots * width, generator=gen) * 0.1).to(DEVICE, dtype)
    slots = torch.tensor([(t % (num_slots + 1)) - 1 for t in range(tokens)], dtype=torch.int64)
    if tokens == 1:
        slots[0] = 0
    slots = slots.to(DEVICE)
    out = torch.randn(tokens, out_features, generator=gen).to(DEVICE, dtype)
    want = reference(x, a, b, slots, width, out)
    before = out.clone()
    add_lora_rows(x, a, b, slots, width, out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    untouched = slots < 0
    assert torch.equal(out[untouched], before[untouched])
    assert not torch.equal(out[~untouched], before[~untouched]), "no row changed"


def test_rows_of_a_wider_tensor_and_int32_slots() -> None:
    """x and out as column slices of wider buffers (row strides past their widths), slots in
    int32 as a graph's input row may hold them."""
    gen = torch.Generator().manual_seed(3)
    width, in_features, out_features = 16, K_CHUNK + 40, 70
    x = torch.randn(4, in_features + 30, generator=gen).to(DEVICE)[:, :in_features]
    a = (torch.randn(2 * width, in_features, generator=gen) * 0.1).to(DEVICE)
    b = (torch.randn(out_features, 2 * width, generator=gen) * 0.1).to(DEVICE)
    out_buffer = torch.randn(4, out_features + 10, generator=gen).to(DEVICE)
    out = out_buffer[:, :out_features]
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32, device=DEVICE)
    want = reference(x, a, b, slots, width, out)
    tail = out_buffer[:, out_features:].clone()
    add_lora_rows(x, a, b, slots, width, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(out_buffer[:, out_features:], tail)


def test_every_form_of_a_pass_adds_the_same_deltas() -> None:
    """layers/lora.add_lora on one layer: the rows of three adapters and of the base model, as
    gathered groups, as masked slot products and through the per-row kernels, each equal to
    the definition; and one adapter for all rows as its single product."""
    from radixserve.layers.linear import ReplicatedLinear
    from radixserve.layers.lora import LoRABatch, add_lora, attach_lora

    gen = torch.Generator().manual_seed(11)
    layer = ReplicatedLinear(40, 24).to(DEVICE)
    batch = LoRABatch()
    stacks = attach_lora(layer, 3, 4, (None,), batch, torch.float32, torch.device(DEVICE))
    stacks.a.copy_(torch.randn(stacks.a.shape, generator=gen))
    stacks.b.copy_(torch.randn(stacks.b.shape, generator=gen))
    x = torch.randn(9, 40, generator=gen).to(DEVICE)
    out = torch.randn(9, 24, generator=gen).to(DEVICE)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, 0], device=DEVICE)
    want = reference(x, stacks.a, stacks.b, slots, 4, out)
    groups = [(s, (slots == s).nonzero().flatten()) for s in range(3)]
    for use in (lambda: batch.use_groups(groups),
                lambda: batch.use_token_slots(slots, rows_kernel=False),
                lambda: batch.use_token_slots(slots, rows_kernel=True)):
        use()
        got = add_lora(layer, x, out.clone())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    batch.use_single(1)
    want = reference(x, stacks.a, stacks.b, torch.ones(9, dtype=torch.int64), 4, out)
    torch.testing.assert_close(add_lora(layer, x, out.clone()).double(), want,
                               rtol=1e-5, atol=1e-5)
    batch.clear()
    assert torch.equal(add_lora(layer, x, out.clone()), out)
