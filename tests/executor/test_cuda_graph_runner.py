"""Decode CUDA graphs: the pure planning logic on the CPU; replay == eager on a GPU.

The GPU tests build a tiny Llama (dummy weights scaled up so attention matters), prefill requests
of ragged lengths eagerly, then run decode batches of several sizes (exact captured sizes and
padded ones) both eagerly and by graph replay, and compare the logits. They also check that a
padded replay writes K/V only to the batch's own slots and the padding sink (slot 0).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixserve.attention.torch_native import TorchNativeAttnBackend
from radixserve.executor.cuda_graph_runner import (INPUT_IDS, LOGITS_IN_MODEL_DTYPE,
                                                   NUM_INPUT_ROWS, OUT_CACHE_LOC, POSITIONS,
                                                   REQ_POOL_INDICES, SEQ_LENS, CudaGraphRunner,
                                                   capture_batch_sizes, fill_padded_inputs,
                                                   pick_graph_batch_size)
from radixserve.attention.base import AttentionContext
from radixserve.core.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.mem.kv_pool import KVCacheSpec, make_kv_pool
from radixserve.mem.req_to_token_pool import ReqToTokenPool

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# ---- CPU: batch sizes and padding ----
def test_capture_sizes_default_list() -> None:
    sizes = capture_batch_sizes(256, 4096)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_batch_sizes(512, 4096)[-17:] == [256] + list(range(272, 513, 16))


@pytest.mark.parametrize("flag,max_reqs", [(256, 64), (20, 4096), (3, 100), (1, 1), (8, 5),
                                           (100, 100), (512, 300), (512, 4096)])
def test_capture_sizes_capped(flag: int, max_reqs: int) -> None:
    sizes = capture_batch_sizes(flag, max_reqs)
    cap = min(flag, max_reqs)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == cap  # every batch up to the cap has a graph
    assert all(1 <= s <= cap for s in sizes)
    standard = {1, 2, 4, 8} | set(range(16, 257, 8)) | set(range(272, 4097, 16))
    assert set(sizes) - standard <= {cap}
    assert {s for s in standard if s <= cap} <= set(sizes)


def test_capture_sizes_empty_when_no_room() -> None:
    assert capture_batch_sizes(0, 64) == []


def test_pick_graph_batch_size_is_smallest_fit() -> None:
    sizes = capture_batch_sizes(64, 4096)
    for bs in range(1, 65):
        picked = pick_graph_batch_size(sizes, bs)
        assert picked >= bs and picked in sizes
        assert all(s < bs for s in sizes if s < picked)
    with pytest.raises(ValueError):
        pick_graph_batch_size(sizes, 65)
    with pytest.raises(ValueError):
        pick_graph_batch_size(sizes, 0)


def decode_batch(input_ids: list[int], rows: list[int], seq_lens: list[int],
                 out_cache_loc: list[int]) -> ModelWorkerBatch:
    return ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=input_ids,
                            req_pool_indices=rows, seq_lens=seq_lens,
                            out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64))


def test_fill_padded_inputs_real_and_padding_rows() -> None:
    batch = decode_batch([11, 12, 13], [5, 2, 7], [9, 1, 30], [101, 55, 77])
    staging = torch.full((NUM_INPUT_ROWS, 8), -99, dtype=torch.int64)
    plan = fill_padded_inputs(batch, 4, seq_len_fill=1, padding_row=31, out=staging)
    assert plan.graph_bs == 4 and plan.num_padding == 1
    assert plan.seq_lens_sum == 9 + 1 + 30 + 1
    assert staging[INPUT_IDS, :4].tolist() == [11, 12, 13, 0]
    assert staging[POSITIONS, :4].tolist() == [8, 0, 29, 0]
    assert staging[REQ_POOL_INDICES, :4].tolist() == [5, 2, 7, 31]  # the pool's padding row
    assert staging[SEQ_LENS, :4].tolist() == [9, 1, 30, 1]
    assert staging[OUT_CACHE_LOC, :4].tolist() == [101, 55, 77, 0]
    assert (staging[:, 4:] == -99).all()  # columns past graph_bs untouched


def test_fill_padded_inputs_carry_the_position_offsets() -> None:
    """M-RoPE requests decode at their length - 1 plus their images' shift (as
    ForwardBatch.from_worker_batch places them without a graph)."""
    batch = decode_batch([11, 12], [5, 2], [90, 30], [101, 55])
    batch.position_offsets = [-40, 0]
    staging = torch.zeros((NUM_INPUT_ROWS, 4), dtype=torch.int64)
    fill_padded_inputs(batch, 4, seq_len_fill=1, padding_row=31, out=staging)
    assert staging[POSITIONS, :4].tolist() == [49, 29, 0, 0]
    eager = ForwardBatch.from_worker_batch(batch, torch.device("cpu"), None)
    assert eager.positions.tolist() == [49, 29]


def test_fill_padded_inputs_fill_value_and_exact_fit() -> None:
    batch = decode_batch([3, 4], [0, 1], [2, 3], [9, 10])
    staging = torch.zeros((NUM_INPUT_ROWS, 4), dtype=torch.int64)
    plan = fill_padded_inputs(batch, 4, seq_len_fill=7, padding_row=9, out=staging)
    assert staging[SEQ_LENS].tolist() == [2, 3, 7, 7]
    assert plan.seq_lens_sum == 2 + 3 + 7 + 7
    plan = fill_padded_inputs(batch, 2, seq_len_fill=7, padding_row=9, out=staging)
    assert plan.num_padding == 0 and plan.seq_lens_sum == 5
    with pytest.raises(ValueError):
        fill_padded_inputs(batch, 1, seq_len_fill=1, padding_row=9, out=staging)


def _cpu_context() -> AttentionContext:
    return AttentionContext(4, 2, 8, torch.device("cpu"), 4, ReqToTokenPool(4, 16, "cpu"),
                            make_kv_pool(16, KVCacheSpec("mha", 1, 2, 8, torch.float32), "cpu"))


def test_backend_without_graphs_disables_runner() -> None:
    """torch_native raises NotImplementedError: the runner captures nothing and never runs."""
    stand_in = SimpleNamespace(attn_backend=TorchNativeAttnBackend(_cpu_context()),
                               device=torch.device("cpu"),
                               server_args=SimpleNamespace(cuda_graph_max_bs=16,
                                                           speculative_algorithm=None),
                               max_num_reqs=32)
    graphs = CudaGraphRunner(stand_in)  # type: ignore[arg-type]
    assert graphs.batch_sizes == []
    assert not graphs.can_run(decode_batch([1], [0], [3], [5]))


# ---- GPU: replay against eager ----
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                  hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
GRAPH_MAX_BS = 24
NUM_REQS = 28


def make_runner(folder: Path, dtype: str, backend: str) -> object:
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner

    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    runner = ModelRunner(ServerArgs(model_path=str(folder), load_format="dummy", dtype=dtype,
                                    device="cuda", attention_backend=backend,
                                    cuda_graph_max_bs=GRAPH_MAX_BS, max_total_tokens=16384,
                                    max_running_requests=32, skip_tokenizer_init=True))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # in place: captured graphs keep pointing at the same storage
        for name, param in runner.model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen, device="cuda") * 0.08)
    return runner


class Requests:
    """Rows and KV slots of NUM_REQS requests, prefilled eagerly with ragged prompts."""

    def __init__(self, runner: object) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(1)
        lens = torch.randint(1, 120, (NUM_REQS,), generator=gen).tolist()
        self.rows = runner.req_to_token_pool.alloc(NUM_REQS)
        self.seq_lens = list(lens)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (sum(lens),), generator=gen).tolist()
        slots = runner.token_to_kv_pool.alloc(sum(lens))
        offset = 0
        for row, n in zip(self.rows, lens):
            runner.req_to_token_pool.req_to_token[row, :n] = slots[offset:offset + n].to(
                device="cuda", dtype=torch.int32)
            offset += n
        runner.forward_logits(ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=ids, req_pool_indices=self.rows,
            seq_lens=lens, out_cache_loc=slots, extend_seq_lens=lens,
            extend_prefix_lens=[0] * NUM_REQS))

    def decode(self, bs: int, step: int) -> ModelWorkerBatch:
        """The next decode step of the first `bs` requests (new KV slot each)."""
        slots = self.runner.token_to_kv_pool.alloc(bs)
        table = self.runner.req_to_token_pool.req_to_token
        for i in range(bs):
            table[self.rows[i], self.seq_lens[i]] = int(slots[i])
            self.seq_lens[i] += 1
        ids = [(37 * i + 11 * step) % TINY_LLAMA["vocab_size"] for i in range(bs)]
        return decode_batch(ids, self.rows[:bs], self.seq_lens[:bs], slots.tolist())


def _all_greedy_info(bs: int) -> object:
    from radixserve.core.req import Req
    from radixserve.core.sampling_params import SamplingParams
    from radixserve.executor.sampling_info import SamplingBatchInfo
    reqs = []
    for i in range(bs):
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        params.verify()
        params.normalize()
        reqs.append(Req(str(i), [1], params))
    return SamplingBatchInfo.from_reqs(reqs, TINY_LLAMA["vocab_size"], "cuda")


def eager_logits(runner: object, batch: ModelWorkerBatch) -> torch.Tensor:
    graphs, runner.cuda_graph_runner = runner.cuda_graph_runner, None
    try:
        return runner.forward_logits(batch).next_token_logits.clone()
    finally:
        runner.cuda_graph_runner = graphs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_matches_eager(tmp_path: Path, dtype: str) -> None:
    runner = make_runner(tmp_path, dtype, "triton")
    graphs = runner.cuda_graph_runner
    assert graphs.batch_sizes == capture_batch_sizes(GRAPH_MAX_BS, runner.max_num_reqs)
    reqs = Requests(runner)
    # fp32 is the strict check; in bf16 a padded graph runs its matmuls at another M, whose
    # rounding differs by bf16 noise (a wrong row or a stale buffer would be off by ~1)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == "float32" else dict(atol=0.15, rtol=0.05)
    k_cache = runner.token_to_kv_pool.k_buffer[0]
    table = runner.req_to_token_pool.req_to_token
    # every size's logits are the first rows of one buffer (one size's own output would stay
    # allocated for the graph's life); a smaller batch after a larger one reads its own rows
    assert {graphs.outputs[bs, False][0].data_ptr() for bs in graphs.batch_sizes} == \
        {graphs.logits_out.data_ptr()}
    # RADIXSERVE_GRAPH_BF16_LOGITS=1: in the compute dtype (forward_logits converts)
    assert graphs.logits_out.dtype == (getattr(torch, dtype) if LOGITS_IN_MODEL_DTYPE
                                       else torch.float32)
    for step, bs in enumerate([1, 2, 3, 8, 13, 16, 24, 5]):  # 3, 13, 5: padded to 4, 16, 8
        batch = reqs.decode(bs, step)
        assert graphs.can_run(batch)
        eager = eager_logits(runner, batch)
        k_before = k_cache.clone()
        real_rows_before = table[:runner.req_to_token_pool.size].clone()
        replayed = runner.forward_logits(batch).next_token_logits.clone()
        # the in-graph table write rewrote the real rows' new slots (same values) and the
        # padding rows wrote only into the padding row
        assert torch.equal(table[:runner.req_to_token_pool.size], real_rows_before)
        if step == 0:  # the greedy path returns the graph's own argmax
            batch.sampling_info = _all_greedy_info(bs)
            assert runner.forward(batch).next_token_ids == replayed.argmax(-1).tolist()
        assert replayed.shape == (bs, TINY_LLAMA["vocab_size"]) and replayed.dtype == torch.float32
        torch.testing.assert_close(replayed, eager, **tol)
        assert (replayed - eager).abs().mean() < (1e-5 if dtype == "float32" else 3e-2)
        if dtype == "float32":
            assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        changed = (k_cache != k_before).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(batch.out_cache_loc.tolist()) | {0}


@pytest.mark.gpu
@needs_cuda
def test_replay_is_repeatable_and_larger_batches_run_eagerly(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "float32", "triton")
    graphs = runner.cuda_graph_runner
    reqs = Requests(runner)
    batch = reqs.decode(5, 0)  # padded to 8
    first = runner.forward_logits(batch).next_token_logits.clone()
    again = runner.forward_logits(batch).next_token_logits.clone()  # same slots, same inputs
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    big = reqs.decode(NUM_REQS, 1)
    assert not graphs.can_run(big)
    assert runner.forward_logits(big).next_token_logits.shape[0] == NUM_REQS


@pytest.mark.gpu
@needs_cuda
def test_torch_native_backend_falls_back_to_eager(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "float32", "torch_native")
    assert runner.cuda_graph_runner is not None
    reqs = Requests(runner)
    batch = reqs.decode(3, 0)
    assert not runner.cuda_graph_runner.can_run(batch)
    assert runner.forward_logits(batch).next_token_logits.shape == (3, TINY_LLAMA["vocab_size"])
