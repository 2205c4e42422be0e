"""FP8 KV storage: the pool quantises with a per-layer scale and saturates, readers dequantise,
memory halves; a tiny Llama with an FP8 pool stays close to its bf16-free fp32 twin on the
torch-native backend and on the Triton kernels (interpreter on CPU), and the calibration pass
sets scales from what the layers store."""
from __future__ import annotations

import pytest
import torch


from radixserve.config import ServerArgs  # noqa: E402
from radixserve.executor.model_runner import ModelRunner  # noqa: E402
from radixserve.mem.kv_pool import KVCacheSpec, dequantize, make_kv_pool, spec_bytes_per_token  # noqa: E402
from tests.models.runner_driver import RunnerDriver  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_pool_quantises_with_its_scale_and_saturates(fp8) -> None:
    spec = KVCacheSpec("mha", 2, 2, 8, torch.float32, storage_dtype=fp8)
    pool = make_kv_pool(16, spec, "cpu")
    assert pool.quantized and spec_bytes_per_token(spec) * 4 == \
        spec_bytes_per_token(KVCacheSpec("mha", 2, 2, 8, torch.float32))
    pool.set_kv_scales(1, 0.01, 2.0)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(3, 16, generator=gen) * 2).clamp(-4, 4)  # inside 448 x 0.01
    v = torch.randn(3, 16, generator=gen) * 100
    v[0, 0] = 1e6  # far past the FP8 range: saturates, never NaN
    loc = torch.tensor([1, 5, 9])
    pool.store_kv(1, loc, k, v)
    k_buf, v_buf = pool.kv_buffers(1)
    assert k_buf.dtype == fp8
    k_back = dequantize(k_buf[loc], 0.01, torch.float32).view(3, 16)
    v_back = dequantize(v_buf[loc], 2.0, torch.float32).view(3, 16)
    rel = 0.07 if fp8 == torch.float8_e4m3fn else 0.13  # 3 / 2 mantissa bits
    assert torch.isfinite(v_back).all() and v_back[0, 0] == torch.finfo(fp8).max * 2.0
    torch.testing.assert_close(k_back, k, atol=0.01 * 0.02, rtol=rel)
    torch.testing.assert_close(v_back[1:], v[1:], atol=2.0 * 0.02, rtol=rel)
    assert pool.kv_scales(1) == (0.01, 2.0) and pool.kv_scales(0) == (1.0, 1.0)


def test_store_target_names_the_layer_buffers_and_scales_unless_observing() -> None:
    """Where a producer may write K/V itself (kernels/gemv_rope.py): the layer's buffers at
    the pass's slots with the layer's scales; none while calibrating (store_kv observes)."""
    pytest.importorskip("triton")  # the MHA pool offers its buffers to Triton producers only
    spec = KVCacheSpec("mha", 2, 2, 8, torch.float32, storage_dtype=torch.float8_e4m3fn)
    pool = make_kv_pool(16, spec, "cpu")
    pool.set_kv_scales(1, 0.5, 0.25)
    loc = torch.tensor([3])
    target = pool.store_target(1, loc)
    k_buf, v_buf = pool.kv_buffers(1)
    assert target is not None and target.k_cache is k_buf and target.v_cache is v_buf
    assert target.loc is loc and (target.k_scale, target.v_scale) == (0.5, 0.25)
    pool.start_observing()
    assert pool.store_target(1, loc) is None
    pool.stop_observing()
    mla = make_kv_pool(16, KVCacheSpec("mla", 2, 1, 24, torch.float32, v_head_dim=16), "cpu")
    assert mla.store_target(0, loc) is None  # a latent entry is no rope + store pair


def _runner(folder, device: str = "cpu", **kwargs) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device=device,
                                  max_total_tokens=1024, max_running_requests=4,
                                  disable_cuda_graph=True, **kwargs))


def _logits(runner: ModelRunner, ids: list[int]) -> list[torch.Tensor]:
    driver = RunnerDriver(runner)
    out = [driver.extend({0: ids[:20]})[0]]
    out.append(driver.extend({0: ids[20:30]})[0])  # extend over the FP8 prefix
    for token in ids[30:33]:
        out.append(driver.extend({0: [token]})[0])  # decode over it
    return out


@pytest.mark.parametrize("backend", ["torch_native",
                                     pytest.param("triton", marks=pytest.mark.slow_interpreted)])
def test_tiny_model_with_fp8_kv_stays_close(backend, tmp_path) -> None:
    device = "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        device = "cuda" if torch.cuda.is_available() else "cpu"  # else the interpreter
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    ids = torch.randint(0, 160, (33,), generator=torch.Generator().manual_seed(4)).tolist()
    exact = _logits(_runner(tmp_path, device, attention_backend=backend), ids)
    fp8_runner = _runner(tmp_path, device, attention_backend=backend, kv_cache_dtype="fp8_e4m3")
    scales = [fp8_runner.token_to_kv_pool.kv_scales(i) for i in range(2)]
    assert all(k != 1.0 and v != 1.0 for k, v in scales)  # calibrated, no checkpoint scales
    for ours, ref in zip(_logits(fp8_runner, ids), exact):
        probs, ref_probs = torch.softmax(ours.cpu(), -1), torch.softmax(ref.cpu(), -1)
        assert (probs - ref_probs).abs().sum() < 0.1  # total variation of the next-token law
        assert int(ours.argmax()) == int(ref.argmax()) or \
            float(ref_probs.max() - ref_probs[int(ours.argmax())]) < 0.05


def test_calibration_scales_follow_the_stored_magnitudes(tmp_path) -> None:
    from radixserve.executor.kv_calibration import HEADROOM
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    runner = _runner(tmp_path, kv_cache_dtype="fp8_e4m3", attention_backend="torch_native")
    pool = runner.token_to_kv_pool
    assert pool.available_size() == pool.size  # the calibration pass freed its slots
    pool.start_observing()
    RunnerDriver(runner).extend({0: list(range(100))})
    amax = pool.stop_observing()
    for layer, (k_max, v_max) in enumerate(amax):
        k_scale, v_scale = pool.kv_scales(layer)
        # same order of magnitude as HEADROOM x amax / 448 of another text
        assert 0.2 < k_scale / (HEADROOM * k_max / 448) < 5
        assert 0.2 < v_scale / (HEADROOM * v_max / 448) < 5
