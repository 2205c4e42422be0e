"""The compiled CPU kernels for RMSNorm (+ residual), SiLU-and-mul and rope (core/cpu_kernels)
against the PyTorch code they replace (layers/norm.py, activation.py, rotary.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.core.cpu_kernels import cpu_ops
from radixserve.layers.rotary import RotaryEmbedding, default_inv_freq

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels did not build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(dtype: torch.dtype) -> dict[str, float]:
    """One unit in the last place at ~4 (reductions in another order may round differently)."""
    eps = torch.finfo(dtype).eps
    return dict(atol=8 * eps, rtol=2 * eps)


def _rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype), x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=gen) * 3).to(dtype)
    w = torch.randn(200, generator=gen).to(dtype)
    residual = torch.randn(37, 200, generator=gen).to(dtype) if with_residual else None
    got = ops.rms_norm(x, w, 1e-5, residual)
    ref, ref_sum = _rmsnorm_torch(x, w, 1e-5, residual)
    torch.testing.assert_close(got[0], ref, **_ulps(dtype))
    if with_residual:
        assert torch.equal(got[1], ref_sum)


def test_rms_norm_module_uses_the_kernel_and_matches() -> None:
    from radixserve.layers.norm import RMSNorm
    norm = RMSNorm(64).to(torch.bfloat16)
    norm.weight.data.normal_()
    x, r = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    out, new_residual = norm(x, r)
    ref, ref_sum = _rmsnorm_torch(x, norm.weight.data, norm.variance_epsilon, r)
    torch.testing.assert_close(out, ref, **_ulps(torch.bfloat16))
    assert torch.equal(new_residual, ref_sum)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (torch.randn(19, 2 * 150) * 4).to(dtype)
    half = x.shape[1] // 2
    ref = F.silu(x[:, :half]) * x[:, half:]
    torch.testing.assert_close(ops.silu_and_mul(x), ref, **_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store(dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, tokens = 6, 2, 64, 11
    rotary = RotaryEmbedding(head_dim, 512, default_inv_freq(head_dim, 10000.0))
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    ref_q, ref_k = rotary(positions, q.clone(), k.clone())
    k_buf = torch.zeros(40, kv_heads, head_dim, dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(39, generator=gen)[:tokens] + 1
    ops.rope_store(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, head_dim, k_buf,
                   v_buf, loc, True)
    # the same roundings in the same order as the PyTorch path: equal, not just close
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(k_buf[loc], ref_k.view(tokens, kv_heads, head_dim))
    assert torch.equal(v_buf[loc], v.reshape(tokens, kv_heads, head_dim))


def test_a_killed_builds_lock_file_is_removed(tmp_path, monkeypatch) -> None:
    """torch's `lock` file of a killed build, however young, goes once our OS lock is held
    (a start right after a killed build hung in torch's wait for it)."""
    from radixserve.core import cpu_kernels
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "killed_build"
    folder.mkdir()
    (folder / "lock").touch()  # left a second ago by a build that was killed
    with cpu_kernels._build_lock("killed_build"):
        assert not (folder / "lock").exists()


@pytest.mark.slow  # two spawned interpreters importing torch: ~30 s on 2 cores
def test_builds_take_turns_and_a_dead_builder_lets_the_next_go(tmp_path, monkeypatch) -> None:
    """A second process waits on the OS lock while the first holds it, and not after the
    first has died (the kernel releases a dead holder's lock)."""
    import multiprocessing
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=_hold_build_lock, args=(str(tmp_path), "turns", 60.0))
    holder.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "turns" / "held").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    waiter = ctx.Process(target=_hold_build_lock, args=(str(tmp_path), "turns", 0.0))
    waiter.start()
    waiter.join(timeout=2.0)
    assert waiter.is_alive()  # waiting for the live holder
    holder.kill()  # a build killed mid-way: its OS lock goes with it
    holder.join()
    waiter.join(timeout=30)
    assert waiter.exitcode == 0


def _hold_build_lock(extensions_dir: str, name: str, seconds: float) -> None:
    import os
    import time
    from pathlib import Path
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    from radixserve.core import cpu_kernels
    with cpu_kernels._build_lock(name):
        (Path(extensions_dir) / name / "held").touch()
        time.sleep(seconds)


def test_each_checkout_names_its_own_build(tmp_path) -> None:
    """The same source in two places gets two build names (torch would otherwise rebuild one
    module back and forth between them); the same file keeps its name."""
    from radixserve.core.cpu_kernels import _SOURCE, module_name
    first, second = tmp_path / "a" / "cpu_ops.cpp", tmp_path / "b" / "cpu_ops.cpp"
    for copy in (first, second):
        copy.parent.mkdir()
        copy.write_bytes(_SOURCE.read_bytes())
    assert module_name(first) != module_name(second)
    assert module_name(first) == module_name(tmp_path / "a" / ".." / "a" / "cpu_ops.cpp")
    assert module_name() == module_name(_SOURCE) != module_name(first)
