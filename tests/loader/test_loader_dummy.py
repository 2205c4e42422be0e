"""Dummy (random) weights: reproducible, small, norms near 1, buffers untouched."""
from __future__ import annotations

import torch

from radixserve.loader.dummy_loader import DUMMY_WEIGHT_RANGE, init_dummy_weights

from loader_test_utils import TINY_LLAMA, make_tiny_llama


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_same_seed_same_weights_other_seed_differs() -> None:
    first, second, third = make_tiny_llama(seed=1), make_tiny_llama(seed=2), make_tiny_llama(seed=3)
    init_dummy_weights(first, seed=7)
    init_dummy_weights(second, seed=7)
    init_dummy_weights(third, seed=8)
    a, b, c = _params(first), _params(second), _params(third)
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), name


def test_ranges_norms_and_buffers() -> None:
    model = make_tiny_llama(seed=0)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    init_dummy_weights(model, seed=0)
    for name, param in model.named_parameters():
        center = 1.0 if "norm" in name else 0.0
        assert (param - center).abs().max().item() <= DUMMY_WEIGHT_RANGE, name
        assert param.std().item() > DUMMY_WEIGHT_RANGE / 4, name  # really random, not constant
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 3]])).logits
    assert torch.isfinite(logits).all()


def test_values_do_not_depend_on_parameter_order() -> None:
    full = make_tiny_llama(seed=0)
    init_dummy_weights(full, seed=3)
    # a module holding only some of the same-named parameters gets the same values
    partial = torch.nn.Module()
    partial.model = torch.nn.Module()
    partial.model.norm = torch.nn.Module()
    partial.model.norm.weight = torch.nn.Parameter(torch.zeros(TINY_LLAMA["hidden_size"]))
    init_dummy_weights(partial, seed=3)
    assert torch.equal(partial.model.norm.weight, full.model.norm.weight)

