"""A hybrid backend (--prefill-attention-backend triton, --decode-attention-backend
torch_native) runs each phase on its own backend over shared pools and matches transformers
(fp32, the Triton interpreter on CPU), through the registry's one constructor signature."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.attention.hybrid import HybridAttnBackend  # noqa: E402
from radixserve.attention.registry import get_attention_backend_class  # noqa: E402
from radixserve.config import ServerArgs  # noqa: E402
from radixserve.executor.model_runner import ModelRunner  # noqa: E402
from tests.models.runner_driver import RunnerDriver  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402


def test_registry_refuses_unknown_backends() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flashinfer'"):
        get_attention_backend_class("flashinfer")


def test_hybrid_prefill_triton_decode_torch_native_matches_hf(tmp_path, monkeypatch) -> None:
    hf_model = make_checkpoint("mistral_window32", tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # else the Triton interpreter
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device=device,
                                    max_total_tokens=512, max_running_requests=4,
                                    disable_cuda_graph=True,
                                    prefill_attention_backend="triton",
                                    decode_attention_backend="torch_native"))
    backend = runner.attn_backend
    assert isinstance(backend, HybridAttnBackend)
    assert type(backend.prefill_backend).__name__ == "TritonAttnBackend"
    assert type(backend.decode_backend).__name__ == "TorchNativeAttnBackend"
    assert backend.decode_backend.kv_pool is backend.prefill_backend.kv_pool
    used: list[str] = []
    for name, part in (("prefill", backend.prefill_backend), ("decode", backend.decode_backend)):
        original = type(part).forward
        monkeypatch.setattr(part, "forward", lambda *a, _n=name, _f=original, _p=part, **k:
                            (used.append(_n), _f(_p, *a, **k))[1])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, hf_model.config.vocab_size, (40,), generator=gen).tolist()
    driver = RunnerDriver(runner)
    driver.extend({0: ids[:38]})  # prefill past the 32-token window
    for i in (38, 39):  # two decode steps
        ours = driver.extend({0: [ids[i]]})
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids[:i + 1]])).logits[0, -1]
        torch.testing.assert_close(ours[0].cpu(), ref, atol=2e-4, rtol=1e-4)
    assert set(used) == {"prefill", "decode"}
    assert used.count("prefill") == 2 and used.count("decode") == 4  # 2 layers x passes
