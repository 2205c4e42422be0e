"""The new_token_ratio estimate and the choice of requests to retract when decode runs short.

new_token_ratio guesses what fraction of their remaining max_new_tokens running requests will
still generate (most stop early on EOS). It starts at 0.7, decays by 0.001 per decode step to a
floor of 0.2 x --schedule-conservativeness, is raised after a retraction to what the survivors
need, and is reset when the scheduler goes idle.
"""
from __future__ import annotations

from typing import Callable

from radixserve.core.req import Req

INIT_NEW_TOKEN_RATIO = 0.7
BASE_MIN_NEW_TOKEN_RATIO = 0.2
NEW_TOKEN_RATIO_DECAY = 0.001
# after a retraction, keep room for this many decode steps of every survivor
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    def __init__(self, conservativeness: float) -> None:
        self.init_value = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        self.min_value = min(1.0, BASE_MIN_NEW_TOKEN_RATIO * conservativeness)
        self.value = self.init_value

    def decay(self) -> None:
        self.value = max(self.value - NEW_TOKEN_RATIO_DECAY, self.min_value)

    def reset(self) -> None:
        self.value = self.init_value

    def after_retraction(self, survivors: list[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in survivors)
        max_new = sum(r.sampling_params.max_new_tokens for r in survivors)
        if max_new:
            estimate = (decoded + RETRACT_DECODE_STEPS * len(survivors)) / max_new
            self.value = min(1.0, max(self.value, estimate))


def pick_retractions(running: list[Req], free_after: Callable[[list[Req]], int],
                     extra_tokens: int = 0, rank: Callable[[Req], int] | None = None
                     ) -> tuple[list[Req], list[Req]]:
    """Retract requests with the fewest output tokens (longest prompt first among equals) until
    the rest have room for RETRACT_DECODE_STEPS steps plus `extra_tokens` (a prefill chunk
    sharing the pass). Without extra tokens at least one request is kept; with them, all may
    go, since the chunk's own memory was promised at its admission. With priority scheduling
    (`rank`: smaller is more important) the least important go first."""
    order = sorted(running, key=lambda r: (-rank(r) if rank else 0, len(r.output_ids),
                                           -len(r.origin_input_ids)))
    retract: list[Req] = []
    min_keep = 0 if extra_tokens else 1
    while len(retract) < len(running) - min_keep:
        survivors = len(running) - len(retract)
        if free_after(retract) >= survivors * RETRACT_DECODE_STEPS + extra_tokens:
            break
        retract.append(order[len(retract)])
    retracted_ids = {id(r) for r in retract}
    return [r for r in running if id(r) not in retracted_ids], retract
