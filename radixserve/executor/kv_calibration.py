"""Per-layer scales for an FP8 KV cache whose checkpoint brings none: one calibration pass.

FP8 keeps a 3-bit (e4m3) or 2-bit (e5m2) mantissa only in its normal range: values much smaller
than 1 fall into subnormals and lose most of their precision, values past 448 (e4m3) saturate.
A scale of 1.0 therefore suits models whose K/V magnitudes sit around 1-400 (Llama-8B) and not
small models whose V lives around 0.02 (SmolLM2-135M's first layer). So, without checkpoint
scales, the runner prefills a calibration text once (the tokenizer's encoding of CALIBRATION_TEXT,
or seeded random ids for a model without one) with the pool recording each layer's K and V
absolute maximum, and sets scale = HEADROOM x amax / FP8 max: the largest value seen lands at
1 / HEADROOM of the FP8 range, so values a little larger than the calibration's still fit.
Under tensor parallelism each rank's pool holds its own KV heads; the ranks take the largest
of their maxima, so every rank and every --tp-size gets the scales of one rank's run.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.distributed.parallel_state import get_tp_group

if TYPE_CHECKING:
    from radixserve.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HEADROOM = 2.0
CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. Several members "
    "asked why the cost of repairs had doubled, and the treasurer explained that the old roof "
    "had failed during the winter storms. In other news, the school library will open late on "
    "weekdays, a new bus route connects the station to the hospital, and volunteers are needed "
    "for the spring festival.\n\ndef mean(values):\n    return sum(values) / len(values)\n\n"
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius.\n"
    "1, 2, 3, 5, 8, 13, 21, 34 -- each number is the sum of the two before it. ")


def calibration_ids(runner: "ModelRunner") -> list[int]:
    source = runner.source.tokenizer_source
    ids: list[int] = []
    if source is not None:
        try:
            from radixserve.loader.tokenizer import get_tokenizer
            tokenizer = get_tokenizer(source)
            while len(ids) < CALIBRATION_TOKENS:
                ids += tokenizer.encode(CALIBRATION_TEXT)
        except Exception as exc:  # a broken tokenizer must not stop the server here
            logger.warning("KV calibration: tokenizer failed (%s); random ids instead", exc)
            ids = []
    if not ids:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, runner.vocab_size, (CALIBRATION_TOKENS,),
                            generator=generator).tolist()
    return ids[:min(CALIBRATION_TOKENS, runner.model_config.context_length - 1)]


def calibrate_kv_scales(runner: "ModelRunner") -> list[tuple[float, float]]:
    """Run the calibration prefill on the runner's (empty) pools; returns and sets the
    per-layer (k_scale, v_scale). The pass's slots are freed again."""
    pool = runner.token_to_kv_pool
    ids = calibration_ids(runner)
    slots = pool.alloc(len(ids))
    row = runner.req_to_token_pool.alloc(1)
    assert slots is not None and row is not None, "the pools are empty at startup"
    runner.req_to_token_pool.write(row[0], 0, slots)
    batch = ModelWorkerBatch(ForwardMode.EXTEND, ids, [row[0]], [len(ids)], slots,
                             extend_seq_lens=[len(ids)], extend_prefix_lens=[0])
    pool.start_observing()
    try:
        runner.forward_logits(batch)
    finally:
        amax = pool.stop_observing()
        pool.free(slots)
        runner.req_to_token_pool.free(row[0])
    fp8_max = float(torch.finfo(pool.dtype).max)
    flat = get_tp_group().max_floats([value for pair in amax for value in pair])
    scales = []
    for layer, (k_max, v_max) in enumerate(zip(flat[0::2], flat[1::2])):
        k_scale = max(HEADROOM * k_max / fp8_max, 1e-8)
        v_scale = max(HEADROOM * v_max / fp8_max, 1e-8)
        pool.set_kv_scales(layer, k_scale, v_scale)
        scales.append((k_scale, v_scale))
    return scales
