"""Which weights a decode layer asks L2 for before its attention (kernels/l2_prefetch.py).

RADIXSERVE_L2_PREFETCH names the weights and the share of each, e.g. "o=1" (all of o_proj) or
"o=1,gu=0.25" (and the first quarter of gate|up); empty or "0" is off, the default until
measured. The prefetch runs right before attention, in steps of at most
RADIXSERVE_L2_PREFETCH_MAX_ROWS rows (default 16): small decode batches, whose products
stream weights at HBM bandwidth and whose attention is latency-bound.
RADIXSERVE_L2_PREFETCH_IN=attention (the default) has the decode attention kernel's programs
issue the prefetches (at most two weights; no launch of its own, Triton backend only);
=kernel launches kernels/l2_prefetch.py's kernel before attention, one per weight, with
RADIXSERVE_L2_PREFETCH_CHUNK bytes per instruction. RADIXSERVE_L2_PREFETCH_EARLY=1 issues them
before the kernel's PDL wait.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# the weights a plan may name: o_proj, gate|up, down
PREFETCH_TARGETS = ("o", "gu", "down")


@dataclass(frozen=True)
class PrefetchPlan:
    shares: tuple[tuple[str, float], ...]  # (target, share of its bytes), in prefetch order
    max_rows: int = 16
    chunk: int = 1 << 16
    before_wait: bool = False
    in_attention: bool = True

    @classmethod
    def parse(cls, spec: str, max_rows: int = 16, chunk: int = 1 << 16,
              before_wait: bool = False, in_attention: bool = True) -> "PrefetchPlan | None":
        """The plan "target=share,..." spells; None when it names nothing."""
        shares = []
        for item in spec.replace(" ", "").split(","):
            if not item or item == "0":
                continue
            target, _, share = item.partition("=")
            if target not in PREFETCH_TARGETS:
                raise ValueError(f"RADIXSERVE_L2_PREFETCH: unknown weight {target!r} "
                                 f"(known: {', '.join(PREFETCH_TARGETS)})")
            value = float(share) if share else 1.0
            if not 0.0 < value <= 1.0:
                raise ValueError(f"RADIXSERVE_L2_PREFETCH: share of {target} must be in (0, 1]")
            shares.append((target, value))
        if in_attention and len(shares) > 2:
            raise ValueError("RADIXSERVE_L2_PREFETCH: the attention kernel prefetches at most "
                             "two weights")
        return cls(tuple(shares), max_rows, chunk, before_wait, in_attention) \
            if shares else None


@functools.lru_cache(maxsize=None)
def env_plan() -> PrefetchPlan | None:
    return PrefetchPlan.parse(os.environ.get("RADIXSERVE_L2_PREFETCH", ""),
                              int(os.environ.get("RADIXSERVE_L2_PREFETCH_MAX_ROWS", "16")),
                              int(os.environ.get("RADIXSERVE_L2_PREFETCH_CHUNK", str(1 << 16))),
                              os.environ.get("RADIXSERVE_L2_PREFETCH_EARLY", "0") == "1",
                              os.environ.get("RADIXSERVE_L2_PREFETCH_IN", "attention")
                              != "kernel")


@dataclass(frozen=True)
class PrefetchTargets:
    """What a decode attention kernel asks L2 for: (weight, leading bytes), in order."""
    weights: tuple[tuple[torch.Tensor, int], ...]
    before_wait: bool


def targets(plan: PrefetchPlan, weights: dict[str, torch.Tensor]) -> PrefetchTargets:
    """The plan's share of each weight it names that the layer has, as bytes."""
    from radixserve.layers.kernels.l2_prefetch import prefetch_bytes
    chosen = tuple((weights[name], prefetch_bytes(weights[name], share))
                   for name, share in plan.shares
                   if name in weights and weights[name].is_contiguous())
    return PrefetchTargets(chosen, plan.before_wait)


def prefetch_weights(plan: PrefetchPlan, weights: dict[str, torch.Tensor]) -> None:
    """Prefetch the plan's share of each weight it names that the layer has (one launch
    each; an MoE layer has no gate|up or down of its own)."""
    from radixserve.layers.kernels.l2_prefetch import prefetch_to_l2
    for weight, nbytes in targets(plan, weights).weights:
        prefetch_to_l2(weight, nbytes, plan.chunk, plan.before_wait)


def applies(plan: PrefetchPlan | None, rows: torch.Tensor) -> bool:
    """A CUDA decode batch small enough for the plan on a board with the instruction."""
    if plan is None or not rows.is_cuda or rows.dim() != 2 or rows.shape[0] > plan.max_rows:
        return False
    from radixserve.layers.kernels.l2_prefetch import prefetch_supported
    return prefetch_supported(rows)
