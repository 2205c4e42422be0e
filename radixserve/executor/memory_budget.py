"""How many KV tokens and request slots the pools get."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)


# a hybrid model's recurrent states take at most this share of the cache memory unless
# --max-running-requests asks for more rows
STATE_SHARE = 0.5


def cache_budget_bytes(args: ServerArgs, device: torch.device, activation_bytes: int = 0
                       ) -> int:
    """The bytes the caches may take: --mem-fraction-static of the GPU minus what is already
    taken (weights) and the activation peak of the largest prefill (measured by the caller);
    CUDA graphs and the sampler live in the fraction's slack. On CPU --cpu-kv-cache-bytes."""
    if device.type != "cuda":
        return int(args.cpu_kv_cache_bytes)
    free, total = torch.cuda.mem_get_info(device)
    assert args.mem_fraction_static is not None
    budget = free - total * (1.0 - args.mem_fraction_static) - activation_bytes
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB; raise --mem-fraction-static")
    return int(budget)


def max_kv_tokens(args: ServerArgs, bytes_per_token: int, device: torch.device,
                  activation_bytes: int = 0, budget_bytes: int | None = None) -> int:
    """--max-total-tokens if given (on the GPU: at most what fits); else what fits the budget
    (`cache_budget_bytes` unless given). `bytes_per_token` comes from the KV pool class
    (KVPool.bytes_per_token)."""
    if budget_bytes is None:
        budget_bytes = cache_budget_bytes(args, device, activation_bytes)
    tokens = int(budget_bytes // bytes_per_token)
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


# prefix-cache snapshots a hybrid model keeps beyond one per request row, where the states'
# share of the budget has room for them (tiny models would otherwise get thousands)
MAX_EXTRA_SNAPSHOTS = 256


class HybridBudget(NamedTuple):
    kv_tokens: int
    rows: int  # request rows
    snapshots: int  # state rows for the prefix cache


def hybrid_budget(args: ServerArgs, kv_bytes_per_token: int, state_bytes_per_row: int,
                  device: torch.device, activation_bytes: int = 0,
                  prefix_cache: bool = False) -> HybridBudget:
    """The KV tokens, request rows and prefix-cache snapshots of a hybrid model, whose every
    request row also holds its recurrent states (`state_bytes_per_row`; the padding row too).
    Rows: --max-running-requests if given, else the usual count capped where the rows and as
    many snapshots would pass STATE_SHARE of the budget. Snapshots (with `prefix_cache`): one
    per row at least, more where the share has room (up to MAX_EXTRA_SNAPSHOTS more), so a
    small --max-running-requests still keeps many conversations' states. The KV pool gets
    the rest."""
    budget = cache_budget_bytes(args, device, activation_bytes)
    share = int(budget * STATE_SHARE)
    per_row = state_bytes_per_row * (2 if prefix_cache else 1)
    if args.max_running_requests is not None:
        rows = args.max_running_requests
    else:
        usual = max_request_slots(args, budget // kv_bytes_per_token)
        rows = min(usual, (share - state_bytes_per_row) // per_row)
    if rows < 1:
        raise RuntimeError(f"no room for one request's recurrent states "
                           f"({per_row / 2**20:.1f} MiB) in the cache budget of "
                           f"{budget / 2**30:.2f} GiB")
    snapshots = 0
    if prefix_cache:
        room = (share - (rows + 1) * state_bytes_per_row) // state_bytes_per_row
        snapshots = max(rows, min(room, rows + MAX_EXTRA_SNAPSHOTS))
    states = (rows + 1 + snapshots) * state_bytes_per_row
    tokens = max_kv_tokens(args, kv_bytes_per_token, device,
                           budget_bytes=max(0, budget - states))
    return HybridBudget(tokens, rows, snapshots)
