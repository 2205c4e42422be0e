"""Qwen3's per-head q/k RMSNorms inside the rope + KV store kernel (mem/kernels/rope_kv_store.py,
`qk_norm`): through the Engine on a tiny Qwen3 checkpoint, decode on the Triton backend (the
interpreter on CPU) gives transformers' greedy tokens in float32, and the tokens and
log-probabilities of the unfused path (RADIXSERVE_FUSE_QK_NORM=0: RMSNorm kernels, then rope)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import radixserve  # noqa: E402
from radixserve.mem import mha_pool  # noqa: E402
from radixserve.mem.kernels import rope_kv_store  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernel

NEW_TOKENS = 4  # the interpreter is slow


def _greedy(checkpoint: str, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    engine = radixserve.Engine(checkpoint, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2000, prefill_attention_backend="torch_native",
                               decode_attention_backend="triton", disable_cuda_graph=True)
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        return_logprob=True)
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    engine.shutdown()
    return ([out["output_ids"] for out in outs],
            [[lp for lp, _ in out["meta_info"]["output_token_logprobs"]] for out in outs])


@pytest.mark.slow_interpreted  # 19 s interpreted; the fused kernel alone:
# tests/attention/test_rope_through_backend.py, in CI
def test_fused_qk_norms_decode_as_transformers_and_the_unfused_path(tmp_path,
                                                                     monkeypatch) -> None:
    hf_model = make_checkpoint("qwen3_qk_norm", tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (23, 9)]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(NEW_TOKENS):
                seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
            expected.append(seq[len(ids):])
    fused_calls = []
    kernel = rope_kv_store.apply_rotary_and_store_kv

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        fused_calls.append(kwargs.get("qk_norm") is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rope_kv_store, "apply_rotary_and_store_kv", recording)
    monkeypatch.setattr(mha_pool, "FUSE_QK_NORM", False)
    unfused = _greedy(str(tmp_path), prompts)
    assert fused_calls and not any(fused_calls)
    fused_calls.clear()
    monkeypatch.setattr(mha_pool, "FUSE_QK_NORM", True)
    fused = _greedy(str(tmp_path), prompts)
    assert fused_calls and all(fused_calls)  # every decode layer call took the norms
    assert fused[0] == unfused[0] == expected
    torch.testing.assert_close(fused[1], unfused[1], atol=1e-5, rtol=0.0)
