"""Attention backends by name, imported on first use; all share one constructor signature,
`Backend(context: AttentionContext)`. A prefill backend and a different decode backend make a
HybridAttnBackend (--prefill-attention-backend / --decode-attention-backend)."""
from __future__ import annotations

import importlib

from radixserve.attention.base import AttentionBackend, AttentionContext

# name -> (module under radixserve.attention, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("torch_native", "TorchNativeAttnBackend"),
    "cpu": ("cpu_backend", "CPUAttnBackend"),
    "triton": ("triton_backend", "TritonAttnBackend"),
}


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"choose from {', '.join(attention_backend_names())}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(f"radixserve.attention.{module}"), cls)


def create_attention_backend(prefill: str, decode: str,
                             context: AttentionContext) -> AttentionBackend:
    """One backend when both phases use the same one; else a hybrid of the two (which share
    the context's pools)."""
    if prefill == decode:
        return get_attention_backend_class(prefill)(context)
    from radixserve.attention.hybrid import HybridAttnBackend
    return HybridAttnBackend(get_attention_backend_class(prefill)(context),
                             get_attention_backend_class(decode)(context))
