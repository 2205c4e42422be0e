"""How many KV tokens and request slots the pools get."""
from __future__ import annotations

import logging

import torch

from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)


def max_kv_tokens(args: ServerArgs, bytes_per_token: int, device: torch.device,
                  activation_bytes: int = 0) -> int:
    """--max-total-tokens if given; else --mem-fraction-static of the GPU minus what is already
    taken (weights) and the activation peak of the largest prefill (measured by the caller);
    CUDA graphs and the sampler live in the fraction's slack. On CPU a byte budget.
    `bytes_per_token` comes from the KV pool class (KVPool.bytes_per_token)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        assert args.mem_fraction_static is not None
        budget = free - total * (1.0 - args.mem_fraction_static) - activation_bytes
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB; raise --mem-fraction-static")
        tokens = int(budget // bytes_per_token)
    else:
        tokens = int(args.cpu_kv_cache_bytes // bytes_per_token)
    if args.max_total_tokens is not None:
        tokens = min(tokens, args.max_total_tokens) if device.type == "cuda" \
            else args.max_total_tokens
    if tokens < 16:
        raise RuntimeError(f"KV cache too small: {tokens} tokens")
    return tokens


def max_request_slots(args: ServerArgs, max_total_tokens: int) -> int:
    if args.max_running_requests is not None:
        return args.max_running_requests
    return max(64, min(4096, max_total_tokens // 32))
