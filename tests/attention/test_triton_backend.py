"""TritonAttnBackend through real pools, ForwardBatch and RadixAttention layers.

A small driver plays the scheduler: it allocates request rows and KV slots, writes req_to_token,
and runs EXTEND (with a shared cached prefix), DECODE and MIXED passes over two layers. Every
output is checked against attention computed directly from the pool after the pass.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import (DEVICE, PoolDriver, gpu, make_context, needs_cuda,  # noqa: E402
                          tolerance)
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, default_decode_config)
from radixserve.attention.kernels.extend_attention import ExtendKernelConfig  # noqa: E402
from radixserve.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 1, 64, 2


class Driver(PoolDriver):
    """PoolDriver over a TritonAttnBackend, with the layers and q/k/v of each pass."""

    def __init__(self, dtype: torch.dtype, device: torch.device, max_bs: int = 4,
                 small_blocks: bool = True) -> None:
        configs = dict(decode_config=DecodeKernelConfig(16, 2, 1),
                       extend_config=ExtendKernelConfig(16, 16, 2, 1)) if small_blocks else {}
        super().__init__(lambda context: TritonAttnBackend(context, num_kv_splits=4, num_sms=2,
                                                           **configs),
                         dtype, device, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, num_heads=NUM_HEADS,
                         max_bs=max_bs)
        self.layers = [RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, i)
                       for i in range(NUM_LAYERS)]
        self.gen = torch.Generator().manual_seed(0)

    def qkv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as views into one projection output, the way a model hands them over."""
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        qkv = torch.randn(num_tokens, width, generator=self.gen).to(self.dtype).to(self.device)
        return qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                          NUM_KV_HEADS * HEAD_DIM], dim=-1)

    def run(self, fb: ForwardBatch, check_eager: bool = True) -> list[torch.Tensor]:
        """Run every layer; check each output against attention read back from the pool."""
        self.backend.init_forward_metadata(fb)
        outputs = []
        for layer in self.layers:
            q, k, v = self.qkv(fb.num_tokens)
            out = layer(q, k, v, fb)
            k_buf, v_buf = self.kv_pool.kv_buffers(layer.layer_id)
            torch.testing.assert_close(k_buf[fb.out_cache_loc], k.view(-1, NUM_KV_HEADS,
                                                                       HEAD_DIM))
            if check_eager:
                ref = pool_attention(q, fb, k_buf, v_buf, layer.scaling)
                torch.testing.assert_close(out, ref, **tolerance(self.dtype))
            outputs.append(out)
        return outputs


def pool_attention(q: torch.Tensor, fb: ForwardBatch, k_buf: torch.Tensor,
                   v_buf: torch.Tensor, scale: float) -> torch.Tensor:
    """Each request's new tokens (the last q_len positions) attend causally to the whole pool
    (the table is the backend's: fb.attn_backend.req_to_token_pool)."""
    q = q.view(-1, NUM_HEADS, HEAD_DIM).float()
    q_lens = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu else [1] * fb.batch_size
    out, start = [], 0
    for i, (seq_len, q_len) in enumerate(zip(fb.seq_lens_cpu, q_lens)):
        table = fb.attn_backend.req_to_token_pool.req_to_token
        slots = table[int(fb.req_pool_indices[i]), :seq_len].long()
        k = k_buf[slots].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = v_buf[slots].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len], k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        causal = (torch.arange(seq_len)[None, :] <= q_pos).to(scores.device)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    return torch.cat(out).reshape(-1, NUM_HEADS * HEAD_DIM).to(k_buf.dtype)


def play_session(driver: Driver) -> list[int]:
    """Extend with a cached prefix, decode, a mixed chunk + decode pass. Returns live rows."""
    a = driver.new_request()
    driver.run(driver.batch(ForwardMode.EXTEND, [a], [20]))
    b = driver.new_request(shared_prefix_from=a, prefix_len=13)
    c = driver.new_request()
    driver.run(driver.batch(ForwardMode.EXTEND, [b, c], [6, 1]))
    for _ in range(2):
        driver.run(driver.batch(ForwardMode.DECODE, [a, b, c], [1, 1, 1]))
    d = driver.new_request(shared_prefix_from=a, prefix_len=21)
    driver.run(driver.batch(ForwardMode.MIXED, [d, a, c], [17, 1, 1]))
    return [a, b, c, d]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_backend_extend_decode_mixed(dtype: torch.dtype) -> None:
    play_session(Driver(dtype, DEVICE))


def test_decode_beyond_max_bs_grows_eager_workspace() -> None:
    driver = Driver(torch.float32, DEVICE, max_bs=1)
    rows = [driver.new_request() for _ in range(3)]
    driver.run(driver.batch(ForwardMode.EXTEND, rows, [5, 30, 2]))
    driver.run(driver.batch(ForwardMode.DECODE, rows, [1, 1, 1]))


def test_split_plan_depends_only_on_batch_size() -> None:
    backend = TritonAttnBackend(make_context(32, 8, 128, DEVICE, max_bs=256, max_context_len=8,
                                             num_slots=16), num_kv_splits=16, num_sms=132)
    splits = [backend.num_kv_splits_for(bs) for bs in (1, 2, 4, 32, 64, 256)]
    assert splits == sorted(splits, reverse=True) and splits[0] == 16 and splits[-1] == 1
    assert all(s & (s - 1) == 0 for s in splits)


def test_fp8_pool_runs_two_splits_at_middle_batches() -> None:
    """Over an FP8 pool, batches that would run one split with up to 10 programs per SM run two
    splits of the one-split (one-warp) programs; small batches and bf16 pools keep the plain
    plan and its configs."""
    batches = (8, 17, 32, 33, 64, 128, 165, 166, 256)

    def backend_over(dtype: torch.dtype) -> TritonAttnBackend:
        return TritonAttnBackend(make_context(32, 8, 128, DEVICE, dtype=dtype, max_bs=256,
                                              max_context_len=8, num_slots=16),
                                 num_kv_splits=16, num_sms=132)
    bf16, fp8 = backend_over(torch.bfloat16), backend_over(torch.float8_e4m3fn)
    assert [bf16.num_kv_splits_for(bs) for bs in batches] == [8, 2, 2, 1, 1, 1, 1, 1, 1]
    # 32 x 8 programs fill the SMs twice already; 165 x 8 <= 1,320 < 166 x 8
    assert [fp8.num_kv_splits_for(bs) for bs in batches] == [8, 2, 2, 2, 2, 2, 2, 1, 1]
    one_split = default_decode_config(torch.float8_e4m3fn, 1)
    assert [fp8.decode_config_for(bs) == one_split for bs in batches] == \
        [False, False, False, True, True, True, True, True, True]
    assert all(bf16.decode_config_for(bs) == default_decode_config(torch.bfloat16,
                                                                   bf16.num_kv_splits_for(bs))
               for bs in batches)


def test_cuda_graph_metadata_reads_fixed_buffers() -> None:
    """Capture records the runner's buffers; replay refills them; padding rows are harmless.
    (Kernels run eagerly here: this checks the plumbing a CUDA graph relies on.)"""
    driver = Driver(torch.float32, DEVICE)
    rows = play_session(driver)[:3]
    backend, graph_bs = driver.backend, 4
    backend.init_cuda_graph_state(max_bs=graph_bs)
    fixed_rows = torch.zeros(graph_bs, dtype=torch.int64, device=DEVICE)
    fixed_lens = torch.ones(graph_bs, dtype=torch.int64, device=DEVICE)
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, fixed_rows, fixed_lens)
    captured = backend.decode_metadata

    fb = driver.batch(ForwardMode.DECODE, rows, [1, 1, 1])
    fill = backend.get_cuda_graph_seq_len_fill_value()
    new_rows = torch.tensor(rows + [0], device=DEVICE)
    new_lens = torch.tensor(fb.seq_lens_cpu + [fill], device=DEVICE)
    backend.init_forward_metadata_replay_cuda_graph(graph_bs, new_rows, new_lens,
                                                    sum(fb.seq_lens_cpu) + fill)
    assert torch.equal(fixed_rows, new_rows) and torch.equal(fixed_lens, new_lens)

    backend.decode_metadata = captured  # what the captured kernels read
    padded = ForwardBatch(**{**fb.__dict__, "batch_size": graph_bs,
                             "out_cache_loc": torch.cat((fb.out_cache_loc,
                                                         fb.out_cache_loc.new_zeros(1)))})
    q, k, v = driver.qkv(graph_bs)
    layer = driver.layers[0]
    out = backend.forward_decode(q, k, v, layer, padded)
    k_buf, v_buf = driver.kv_pool.kv_buffers(0)
    ref = pool_attention(q[:3], fb, k_buf, v_buf, layer.scaling)
    torch.testing.assert_close(out[:3], ref, **tolerance(torch.float32))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_on_gpu_default_blocks(dtype: torch.dtype) -> None:
    play_session(Driver(dtype, torch.device("cuda"), small_blocks=False))


@gpu
@needs_cuda
def test_real_cuda_graph_replay_tracks_new_lengths() -> None:
    driver = Driver(torch.bfloat16, torch.device("cuda"), small_blocks=False)
    rows = play_session(driver)
    backend, layer, bs = driver.backend, driver.layers[0], len(rows)
    backend.init_cuda_graph_state(max_bs=bs)
    fixed_rows = torch.zeros(bs, dtype=torch.int64, device="cuda")
    fixed_lens = torch.ones(bs, dtype=torch.int64, device="cuda")
    fixed_loc = torch.zeros(bs, dtype=torch.int64, device="cuda")
    q, k, v = (t.clone() for t in driver.qkv(bs))
    fb = driver.batch(ForwardMode.DECODE, rows, [1] * bs)
    static = ForwardBatch(**{**fb.__dict__, "req_pool_indices": fixed_rows,
                             "seq_lens": fixed_lens, "out_cache_loc": fixed_loc})
    backend.init_forward_metadata_capture_cuda_graph(bs, fixed_rows, fixed_lens)
    backend.forward_decode(q, k, v, layer, static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(q, k, v, layer, static)
    for _ in range(3):  # replay on growing sequences
        fb = driver.batch(ForwardMode.DECODE, rows, [1] * bs)
        new_q, new_k, new_v = driver.qkv(bs)
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        fixed_loc.copy_(fb.out_cache_loc)
        backend.init_forward_metadata_replay_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens,
                                                        sum(fb.seq_lens_cpu))
        graph.replay()
        k_buf, v_buf = driver.kv_pool.kv_buffers(layer.layer_id)
        ref = pool_attention(q, fb, k_buf, v_buf, layer.scaling)
        torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


def _route_long_runs(monkeypatch: pytest.MonkeyPatch, driver: Driver, attend: object) -> list[int]:
    """Send extend runs of >= 20 tokens (prefix included; >= 4 new) down the cuDNN path with
    `attend` (a decode tail of a long request stays with the kernel);
    returns a list that grows by one per long run served."""
    import functools

    import radixserve.attention.triton_backend as triton_backend
    from radixserve.attention.kernels.long_extend import long_extend_attention
    served: list[int] = []

    def counted(*args: object, **kwargs: object) -> None:
        served.append(1)
        functools.partial(long_extend_attention, attend=attend)(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "LONG_EXTEND_MIN_TOKENS", 20)
    monkeypatch.setattr(triton_backend, "LONG_EXTEND_MIN_NEW_TOKENS", 4)
    monkeypatch.setattr(triton_backend, "long_extend_attention", counted)
    driver.backend.long_extend_enabled = True
    return served


def test_long_runs_split_between_cudnn_path_and_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long runs (a 20-token prompt, a 17-token chunk on a 21-token prefix in a MIXED pass) take
    the cuDNN path's layout and merge (with its plain-PyTorch stand-in), the other requests of
    the same passes the Triton kernel; every output matches attention read from the pool."""
    from radixserve.attention.kernels.long_extend import reference_attend
    driver = Driver(torch.float16, DEVICE)
    served = _route_long_runs(monkeypatch, driver, reference_attend)
    play_session(driver)
    assert len(served) == 2 * NUM_LAYERS


@gpu
@needs_cuda
def test_long_runs_through_cudnn_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.attention.kernels.long_extend import cudnn_attend, cudnn_usable
    if not cudnn_usable(torch.device("cuda")):
        pytest.skip("cuDNN attention does not run here")
    driver = Driver(torch.bfloat16, torch.device("cuda"), small_blocks=False)
    served = _route_long_runs(monkeypatch, driver, cudnn_attend)
    play_session(driver)
    assert len(served) == 2 * NUM_LAYERS


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn])
def test_fp8_pools_decode_with_v_gathered_early(storage: torch.dtype | None) -> None:
    """FP8 pools default to the decode variants that load V with K (one warp per program when a
    batch runs one split); others keep the old order, with a lazily rescaled max where requests
    split."""
    from radixserve.attention.base import AttentionContext
    from radixserve.mem.kv_pool import KVCacheSpec, make_kv_pool
    from radixserve.mem.req_to_token_pool import ReqToTokenPool
    spec = KVCacheSpec("mha", 1, NUM_KV_HEADS, HEAD_DIM, torch.float16, storage_dtype=storage)
    context = AttentionContext(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DEVICE, 4,
                               ReqToTokenPool(4, 32, DEVICE), make_kv_pool(64, spec, DEVICE))
    backend = TritonAttnBackend(context, num_kv_splits=4, num_sms=2)
    for bs, splits in ((21, 1), (1, 4)):  # one KV head, 2 SMs: 21 > 10 programs per SM
        config = backend.decode_config_for(bs)
        assert backend.num_kv_splits_for(bs) == splits
        assert config.early_v == (storage is not None)
        assert config.num_warps == (1 if storage is not None and splits == 1 else 2)
        assert config.lazy_rescale == (storage is None and splits > 1)
