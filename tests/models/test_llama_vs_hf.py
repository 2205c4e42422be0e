"""Our Llama-family model against transformers on the same tiny random checkpoints (fp32)."""
from __future__ import annotations

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from tests.models.runner_driver import RunnerDriver
from tests.models.tiny_checkpoints import CONFIGS, make_checkpoint

ATOL = 2e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(request.param, folder)
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=4096, max_running_requests=8))
    return hf_model, runner


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_match(pair):
    hf_model, runner = pair
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = {0: torch.randint(0, vocab, (13,), generator=gen).tolist(),
               1: torch.randint(0, vocab, (5,), generator=gen).tolist(),
               2: torch.randint(0, vocab, (80,), generator=gen).tolist()}  # past rope's 64
    driver = RunnerDriver(runner)
    ours = driver.extend(prompts)
    for i, key in enumerate(prompts):
        ref = hf_logits(hf_model, prompts[key])[-1]
        torch.testing.assert_close(ours[i], ref, atol=ATOL, rtol=1e-4)
    # three decode steps, all requests at once, each feeding a fixed token
    seqs = {k: list(v) for k, v in prompts.items()}
    for step in range(3):
        feed = {k: [(7 * step + k) % vocab] for k in seqs}
        ours = driver.extend(feed)
        for i, key in enumerate(seqs):
            seqs[key] += feed[key]
            ref = hf_logits(hf_model, seqs[key])[-1]
            torch.testing.assert_close(ours[i], ref, atol=ATOL, rtol=1e-4)


def test_extend_on_cached_prefix_matches(pair):
    """Prefill part of a prompt, then extend the rest on top of the cached prefix."""
    hf_model, runner = pair
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, hf_model.config.vocab_size, (40,), generator=gen).tolist()
    driver = RunnerDriver(runner)
    driver.extend({10: ids[:17]})
    ours = driver.extend({10: ids[17:]})
    torch.testing.assert_close(ours[0], hf_logits(hf_model, ids)[-1], atol=ATOL, rtol=1e-4)


def test_greedy_continuation_matches(pair):
    hf_model, runner = pair
    prompt = [3, 17, 42, 8, 99, 5]
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    driver = RunnerDriver(runner)
    logits = driver.extend({20: prompt})
    ours: list[int] = []
    for _ in range(24):
        token = int(logits[0].argmax())
        ours.append(token)
        logits = driver.extend({20: [token]})
    assert ours == hf_out


def test_mixed_batch_matches(pair):
    """A MIXED pass (a prompt chunk plus single decode tokens) equals transformers."""
    from radixserve.core.forward_batch import ForwardMode
    hf_model, runner = pair
    gen = torch.Generator().manual_seed(3)
    vocab = hf_model.config.vocab_size
    seqs = {k: torch.randint(0, vocab, (n,), generator=gen).tolist()
            for k, n in ((30, 9), (31, 21), (32, 50))}
    driver = RunnerDriver(runner)
    driver.extend({30: seqs[30], 31: seqs[31]})
    chunk = seqs[32][:20]
    feed = {32: chunk, 30: [5], 31: [6]}
    ours = driver.extend(feed, forward_mode=ForwardMode.MIXED)
    seqs[30] += [5]
    seqs[31] += [6]
    for i, key in enumerate(feed):
        ref_ids = chunk if key == 32 else seqs[key]
        torch.testing.assert_close(ours[i], hf_logits(hf_model, ref_ids)[-1], atol=ATOL,
                                   rtol=1e-4)


def test_a_longer_context_allowed_by_the_flag_runs_past_the_models_positions(
        tmp_path, monkeypatch) -> None:
    """RADIXSERVE_ALLOW_LONGER_CONTEXT=1 with --context-length past max_position_embeddings
    (512 here): the rope tables cover the context, so a 600-token prompt runs (it crashed
    the scheduler with an index error)."""
    monkeypatch.setenv("RADIXSERVE_ALLOW_LONGER_CONTEXT", "1")
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu",
                                    max_total_tokens=4096, max_running_requests=2,
                                    context_length=1024))
    ids = torch.randint(0, 160, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = RunnerDriver(runner).extend({0: ids})[0]
    assert bool(torch.isfinite(logits).all())
