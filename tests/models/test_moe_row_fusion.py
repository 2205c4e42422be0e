"""One-row decode of MoE layers (DecoderLayer.forward_fused with SparseMoeBlock
.forward_normed_row): the input norm in q|k|v, the residual add in o, the post-attention norm in
the router's and the experts' gate|up GEMVs, the residual add in the experts' down GEMV. The
greedy tokens of tiny Qwen3-MoE and Mixtral checkpoints (fp16; the Triton interpreter on CPU)
are those of the unfused layers, and the layers that cannot fuse say so."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # read when a kernel is decorated: before the imports below
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import radixserve  # noqa: E402
from radixserve.models import blocks, moe_blocks  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernel


def _greedy(checkpoint: str) -> tuple[list[int], list[float]]:
    engine = radixserve.Engine(checkpoint, dtype="float16", skip_tokenizer_init=True,
                               max_total_tokens=2000, disable_cuda_graph=True)
    prompt = torch.randint(0, 160, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    out = engine.generate(input_ids=[prompt], sampling_params={
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, return_logprob=True)
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    engine.shutdown()
    return out[0]["output_ids"], [lp for lp, _ in out[0]["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_moe"])
def test_fused_moe_rows_keep_the_greedy_tokens(name: str, tmp_path, monkeypatch) -> None:
    make_checkpoint(name, tmp_path)
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    monkeypatch.setattr(moe_blocks, "ROW_FUSION", False)
    reference, reference_logprobs = _greedy(str(tmp_path))
    monkeypatch.setattr(moe_blocks, "ROW_FUSION", True)
    rows = []
    normed_row = moe_blocks.SparseMoeBlock.forward_normed_row

    def counting(self, *args):  # type: ignore[no-untyped-def]
        rows.append(1)
        return normed_row(self, *args)

    monkeypatch.setattr(moe_blocks.SparseMoeBlock, "forward_normed_row", counting)
    tokens, logprobs = _greedy(str(tmp_path))
    assert tokens == reference
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference_logprobs),
                               atol=2e-2, rtol=0)
    # every layer at each decode step after the first token (with CUDA graphs: at capture)
    assert len(rows) == 2 * 3 or (torch.cuda.is_available() and rows)


def test_moe_layers_that_do_not_fuse(tmp_path, monkeypatch) -> None:
    """A shared expert (Qwen2-MoE) or MLA attention (DeepSeek-V2) keep the unfused layer
    (Qwen3-MoE's layers fuse, to show the check can say yes)."""
    monkeypatch.setattr(moe_blocks, "ROW_FUSION", True)
    for name in ("qwen3_moe", "qwen2_moe_shared", "deepseek_v2_lite_mla"):
        folder = tmp_path / name
        make_checkpoint(name, folder)
        engine = radixserve.Engine(str(folder), dtype="float16", skip_tokenizer_init=True,
                                   max_total_tokens=512, disable_cuda_graph=True)
        model = engine.scheduler.runner.model if hasattr(engine, "scheduler") else None
        layers = [m for m in model.modules() if isinstance(m, blocks.DecoderLayer)] \
            if model is not None else []
        fused = [layer.fuses_sparse_row(torch.float16) for layer in layers]
        assert layers and fused == [name == "qwen3_moe"] * len(layers), (name, fused)
        engine.shutdown()
