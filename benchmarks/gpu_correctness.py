"""Greedy outputs of tiny random checkpoints: radixserve's three GPU paths vs transformers.

  python benchmarks/gpu_correctness.py [--out DIR] [--dtypes bfloat16 float32]

For each checkpoint (made here with transformers: Llamas of head_dim 128 GQA 4, 64 MHA, 32 GQA 4;
a Mistral with a 32-token sliding window, decoded 64 tokens past prompts of 100 and 257; Qwen3
with q/k norms; Gemma-2 with soft-capping and a window on alternate layers) and each dtype, prompts of several lengths are decoded greedily for --new-tokens tokens through
radixserve.Engine with (torch_native, no graphs), (triton, no graphs) and (triton, CUDA graphs),
all prompts in one batch (so decode replays a padded graph), and once more the first prompt
alone (batch 1). Checks, one PASS/TIE/FAIL line each:
- "paths": batch-1 == batched, and the three paths give identical token ids;
- "vs HF": equal to transformers' greedy decoding in the same dtype: its full forward pass,
  argmax'ed one token at a time (its `generate` with a sliding-window cache drifts from its own
  full forward, so it is not the reference).
In fp32 any divergence fails. In bf16 rounding differs between kernels (and between batch
shapes), so a near tie can flip one argmax: a divergence is TIE when the fp32 transformers model,
given the common prefix, puts the two tokens closer together than twice the worst logit error of
transformers' own bf16 run at that step (each of the two runs may err that much; position, gap
and error are printed), else FAIL. A real bug shows as a large gap here and in fp32.
Writes DIR/correctness.json. Without a GPU it says so and exits 0 (--allow-cpu runs the
torch_native path on the CPU, to check the script itself).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

PROMPT_LENS = (1, 7, 33, 100, 257)
# name -> (transformers config class, its arguments, new tokens or None for --new-tokens)
# the MLA + MoE layout DeepSeek-V3 and Mistral-4 share here (q compression, layer 0 dense, one
# shared expert, 4 expert groups of which 2 are kept)
_MLA_MOE: dict[str, Any] = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                                kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64,
                                qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=256,
                                n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                                topk_group=2)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    # most important first (Llama-3 head layout)
    "hd128-gqa4": ("LlamaConfig", dict(hidden_size=512, num_attention_heads=8,
                                       num_key_value_heads=2, head_dim=128), None),
    "mistral-swa32": ("MistralConfig", dict(hidden_size=512, num_attention_heads=8,
                                            num_key_value_heads=2, head_dim=64,
                                            sliding_window=32), 64),
    "gemma2-hd64": ("Gemma2Config", dict(hidden_size=512, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=64, sliding_window=48,
                                         query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=3.0,
                                         tie_word_embeddings=True), None),
    "gemma3-hd64": ("Gemma3TextConfig", dict(hidden_size=512, num_attention_heads=8,
                                             num_key_value_heads=4, head_dim=64,
                                             sliding_window=48, query_pre_attn_scalar=64,
                                             layer_types=["sliding_attention",
                                                          "full_attention"] * 2,
                                             tie_word_embeddings=True), None),
    "qwen3-hd64": ("Qwen3Config", dict(hidden_size=512, num_attention_heads=8,
                                       num_key_value_heads=2, head_dim=64), None),
    "hd64-mha": ("LlamaConfig", dict(hidden_size=512, num_attention_heads=8,
                                     num_key_value_heads=8, head_dim=64), None),
    "hd32-gqa4": ("LlamaConfig", dict(hidden_size=256, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=32), None),
    # MoE and MLA (issue 12): routing ties in bf16 show up as TIE lines, like any near tie
    "mixtral-moe": ("MixtralConfig", dict(hidden_size=512, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=64,
                                          num_local_experts=8, num_experts_per_tok=2), None),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=512, num_attention_heads=8,
                                         num_key_value_heads=2, head_dim=64, num_experts=16,
                                         num_experts_per_tok=4, moe_intermediate_size=256,
                                         norm_topk_prob=True), None),
    "deepseek-mla": ("DeepseekV2Config", dict(hidden_size=512, num_attention_heads=8,
                                              num_key_value_heads=8, kv_lora_rank=128,
                                              q_lora_rank=None, qk_nope_head_dim=64,
                                              qk_rope_head_dim=32, v_head_dim=64,
                                              n_routed_experts=16, num_experts_per_tok=4,
                                              moe_intermediate_size=256, n_shared_experts=2,
                                              first_k_dense_replace=1,
                                              topk_method="group_limited_greedy", n_group=4,
                                              topk_group=2, routed_scaling_factor=1.5), None),
    # DeepSeek-V3: MLA with q compression, sigmoid routing with a (randomised) correction bias.
    # In bf16 its expert choices flip under rounding about one step in ten (transformers' own
    # bf16 run included), which the tie rule cannot see: bf16 FAIL lines of this checkpoint are
    # judged with benchmarks/gpu_logit_drift.py (session 41: the Triton path drifts as
    # transformers' bf16 does); fp32 must PASS
    "deepseek-v3": ("DeepseekV3Config", dict(_MLA_MOE, n_routed_experts=32, num_experts_per_tok=4,
                                             norm_topk_prob=True, routed_scaling_factor=2.5),
                    None),
    # GLM-4.5: q/k/v bias, per-head q/k norms, rope over half of each head (the rope + store
    # kernel's partial path, the norms outside it), V3's routing with one group
    "glm4-moe": ("Glm4MoeConfig", dict(hidden_size=512, num_attention_heads=8,
                                       num_key_value_heads=2, head_dim=64,
                                       moe_intermediate_size=256, n_routed_experts=32,
                                       n_shared_experts=1, num_experts_per_tok=4,
                                       first_k_dense_replace=1, n_group=1, topk_group=1,
                                       use_qk_norm=True, attention_bias=True,
                                       norm_topk_prob=True, routed_scaling_factor=2.5), None),
    # gpt-oss: attention sinks (decode split + merge, extend), a 128-token window on every
    # other layer, yarn rope, biases everywhere, experts with biases and the clamped SwiGLU
    # (the fused MoE kernels' bias epilogues)
    "gpt-oss": ("GptOssConfig", dict(hidden_size=512, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=64, intermediate_size=256,
                                     num_local_experts=16, num_experts_per_tok=4,
                                     sliding_window=128,
                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                     rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "truncate": False,
                                                   "original_max_position_embeddings": 64,
                                                   "rope_theta": 150000.0}), None),
    # Mistral-4: MLA with rope over the halves (the torch rope path on CUDA), Llama-4's query
    # scaling past an original context of 64 (the prompts run past it), softmax routing with
    # groups ranked by their two best scores, all experts in one tensor per projection
    "mistral4": ("Mistral4Config", dict(_MLA_MOE, n_routed_experts=16, num_experts_per_tok=4,
                                        rope_interleave=False,
                                        rope_parameters={
                                            "rope_type": "yarn", "rope_theta": 10000.0,
                                            "factor": 32.0,
                                            "original_max_position_embeddings": 64,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                            "mscale_all_dim": 1.0,
                                            "llama_4_scaling_beta": 0.1}), None),
    # Qwen3-Next: Gated DeltaNet layers (the recurrent states through CUDA graphs and overlap)
    # beside gated attention of head_dim 256 with rope over a quarter of each head, experts
    # with a sigmoid-gated shared expert
    "qwen3-next": ("Qwen3NextConfig", dict(hidden_size=512, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=256,
                                           linear_num_key_heads=4, linear_num_value_heads=8,
                                           linear_key_head_dim=128, linear_value_head_dim=64,
                                           linear_conv_kernel_dim=4, num_experts=16,
                                           num_experts_per_tok=4, moe_intermediate_size=256,
                                           shared_expert_intermediate_size=256,
                                           norm_topk_prob=True,
                                           layer_types=["linear_attention"] * 3 +
                                           ["full_attention"]), None),
    # Nemotron-H / Nemotron-3-Nano: Mamba-2 mixers (16 heads of 64 in 2 groups of B/C,
    # state 128, the conv with a bias) beside rope-less attention, a ReLU-squared MLP and
    # ungated ReLU-squared experts (sigmoid routing in groups) through the fused-MoE kernels
    "nemotron-h": ("NemotronHConfig", dict(hidden_size=512, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=128,
                                           mamba_num_heads=16, mamba_head_dim=64,
                                           ssm_state_size=128, n_groups=2, conv_kernel=4,
                                           chunk_size=64, n_routed_experts=16,
                                           num_experts_per_tok=4, moe_intermediate_size=256,
                                           moe_shared_expert_intermediate_size=256, n_group=4,
                                           topk_group=2, layers_block_type=[
                                               "linear_attention", "moe", "full_attention",
                                               "mlp", "linear_attention", "moe"]), None),
    # Granite-4.0-H: Mamba-2 (one group of B/C) and rope-less attention layers, each with top-2
    # experts beside a shared MLP, Granite's multipliers
    "granite-h": ("GraniteMoeHybridConfig", dict(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        shared_intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
        mamba_n_heads=16, mamba_n_groups=1, mamba_d_state=64, mamba_d_head=64,
        mamba_chunk_size=64, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=4.0, position_embedding_type="nope"),
        None),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (the mixer's norm
    # before its gate), its µP multipliers away from 1 (folded into the weights at load)
    "falcon-h1": ("FalconH1Config", dict(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=1024,
        mamba_n_heads=16, mamba_n_groups=2, mamba_d_state=64, mamba_chunk_size=64,
        mamba_rms_norm=True, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        key_multiplier=0.7, attention_out_multiplier=0.8, ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.2, 0.8, 1.3, 0.7], mlp_multipliers=[1.4, 0.6]), None),
    # Bamba: Granite-H-Micro's layout under Bamba's names, rope over half of each head
    "bamba": ("BambaConfig", dict(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
        num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=16, mamba_n_groups=1,
        mamba_d_state=64, mamba_d_head=64, mamba_chunk_size=64), None),
}
DEFAULT_CHECKPOINTS = ["hd128-gqa4", "mistral-swa32", "gemma2-hd64", "gemma3-hd64", "qwen3-hd64"]
MOE_CHECKPOINTS = ["mixtral-moe", "qwen3-moe", "deepseek-mla", "deepseek-v3", "glm4-moe",
                   "gpt-oss", "mistral4", "qwen3-next", "nemotron-h", "granite-h", "falcon-h1",
                   "bamba"]
PATHS = (("torch_native", False, 1), ("triton", False, 1), ("triton", True, 1))


def tp_paths(tp_size: int) -> tuple[tuple[str, bool, int], ...]:
    """--tp-size N: one rank against N ranks, both Triton + CUDA graphs."""
    return (("triton", True, 1), ("triton", True, tp_size))


@dataclass
class Check:
    checkpoint: str
    dtype: str
    what: str  # "paths" | "vs HF"
    status: str  # PASS | TIE | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.checkpoint:<10} {self.dtype:<8} {self.what:<6} {self.detail}"


def make_checkpoint(name: str, folder: Path, seed: int = 0) -> None:
    import transformers
    torch.manual_seed(seed)
    config_cls, extra, _ = CHECKPOINTS[name]
    kwargs = dict(vocab_size=1024, intermediate_size=768, num_hidden_layers=4,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = getattr(transformers, config_cls)(**{**kwargs, **extra})
    model_cls = _model_class(config)
    make = model_cls.from_config if model_cls is transformers.AutoModelForCausalLM else \
        model_cls._from_config  # a model class's own, where the auto class maps none
    model = make(config, dtype=torch.float32)
    with torch.no_grad():  # transformers' init is tiny; larger weights make attention matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("A_log"):  # linear attention: a decay that keeps ~50 tokens
                param.uniform_(-5.0, -3.0)
            elif param.dim() >= 2:  # matrices and stacked experts
                param.normal_(0, 0.06)
            else:
                param.uniform_(0.8, 1.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: zeros at init
                buffer.normal_(0, 0.3)
    model.save_pretrained(folder)


def make_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _model_class(config: Any) -> Any:
    """transformers' class for a config: the causal-LM auto class, or Mistral-4's own (the
    auto class does not map it)."""
    import transformers
    if getattr(config, "model_type", None) == "mistral4":
        return transformers.Mistral4ForCausalLM
    return transformers.AutoModelForCausalLM


def load_hf(folder: Path, dtype: torch.dtype, device: str) -> Any:
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    model = _model_class(config).from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int, device: str
              ) -> list[list[int]]:
    """transformers' full forward, argmax'ed one token at a time (no cache, no padding)."""
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(new_tokens):
                logits = model(torch.tensor([seq], device=device)).logits[0, -1]
                seq.append(int(logits.argmax()))
            outputs.append(seq[len(prompt):])
    return outputs


def radixserve_greedy(folder: Path, dtype: str, device: str, backend: str, graphs: bool,
                      prompts: list[list[int]], new_tokens: int, tp_size: int = 1
                      ) -> list[list[int]]:
    """All prompts in one generate() call, then the first prompt alone (appended last)."""
    from radixserve.engine import Engine
    engine = Engine(model_path=str(folder), dtype=dtype, device=device, attention_backend=backend,
                    disable_cuda_graph=not graphs, cuda_graph_max_bs=16, max_total_tokens=32768,
                    max_running_requests=32, skip_tokenizer_init=True, random_seed=0,
                    tp_size=tp_size)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        batched = engine.generate(input_ids=prompts, sampling_params=params)
        alone = engine.generate(input_ids=[prompts[0]], sampling_params=params)
        return [list(o["output_ids"]) for o in batched] + [list(alone[0]["output_ids"])]
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class TieJudge:
    """Decides whether a divergence is a near tie: the fp32 transformers model puts the two tokens
    closer than twice the worst logit error of transformers' own bf16/fp16 run at that step."""

    def __init__(self, model32: Any, model_lowp: Any, device: str) -> None:
        self.model32, self.model_lowp, self.device = model32, model_lowp, device

    def gap_and_noise(self, context: list[int], token_a: int, token_b: int
                      ) -> tuple[float, float]:
        ids = torch.tensor([context], device=self.device)
        with torch.no_grad():
            exact = self.model32(ids).logits[0, -1].float()
            noise = 0.0 if self.model_lowp is self.model32 else float(
                (self.model_lowp(ids).logits[0, -1].float() - exact).abs().max())
        return abs(float(exact[token_a] - exact[token_b])), noise

    def compare(self, prompts: list[list[int]], ref: list[list[int]], got: list[list[int]],
                strict: bool, names: tuple[str, str]) -> tuple[str, str]:
        """(PASS | TIE | FAIL, detail) for two runs' outputs over the same prompts."""
        worst: tuple[float, str] | None = None
        for i, (prompt, a, b) in enumerate(zip(prompts, ref, got)):
            pos = first_divergence(a, b)
            if pos is None:
                continue
            if pos >= min(len(a), len(b)):
                return "FAIL", f"prompt {i}: {len(a)} vs {len(b)} tokens"
            gap, noise = self.gap_and_noise(prompt + a[:pos], a[pos], b[pos])
            where = (f"prompt {i} (len {len(prompt)}) diverges at new token {pos}: "
                     f"{names[0]} {a[pos]} vs {names[1]} {b[pos]}, fp32 logit gap {gap:.4f}, "
                     f"HF low-precision logit error {noise:.4f}")
            if strict or gap > 2 * noise:  # both runs err by about HF's low-precision error
                return "FAIL", where
            if worst is None or gap > worst[0]:
                worst = (gap, where)
        if worst is None:
            return "PASS", f"{len(prompts)} prompts x {len(ref[0])} tokens identical"
        return "TIE", worst[1]


def check_dtype(name: str, dtype: str, device: str, new_tokens: int, folder: Path,
                model32: Any, tp_size: int = 1) -> list[Check]:
    prompts = make_prompts(1024)
    strict = dtype == "float32"
    judge = TieJudge(model32, model32 if strict else load_hf(folder, getattr(torch, dtype), device),
                     device)
    paths = (tp_paths(tp_size) if tp_size > 1 else PATHS) if device == "cuda" else PATHS[:1]
    results: dict[str, list[list[int]]] = {}
    checks: list[Check] = []
    for backend, graphs, tp in paths:
        label = backend + ("+graphs" if graphs else "") + (f"+tp{tp}" if tp_size > 1 else "")
        try:
            results[label] = radixserve_greedy(folder, dtype, device, backend, graphs, prompts,
                                               new_tokens, tp)
        except Exception as exc:  # report and go on with the other paths
            checks.append(Check(name, dtype, "paths", "FAIL", f"{label} raised {exc!r:.300}"))
    labels = list(results)
    if labels:
        base = labels[0]
        status, detail = judge.compare(prompts[:1], results[base][:1], results[base][-1:],
                                       strict, (f"{base} batched", "batch 1"))
        checks.append(Check(name, dtype, "paths", status, f"[{base} batched vs batch 1] {detail}"))
    for label in labels[1:]:
        status, detail = judge.compare(prompts + prompts[:1], results[labels[0]], results[label],
                                       strict, (labels[0], label))
        checks.append(Check(name, dtype, "paths", status, f"[{labels[0]} vs {label}] {detail}"))
    hf = hf_greedy(judge.model_lowp, prompts, new_tokens, device)
    for label in labels:
        status, detail = judge.compare(prompts, hf, results[label][:-1], strict, ("HF", "ours"))
        checks.append(Check(name, dtype, "vs HF", status, f"[{label}] {detail}"))
    return checks


def check_checkpoint(name: str, dtypes: list[str], device: str, new_tokens: int, root: Path,
                     deadline: float, tp_size: int = 1) -> list[Check]:
    folder = root / name
    make_checkpoint(name, folder)
    new_tokens = CHECKPOINTS[name][2] or new_tokens
    model32 = load_hf(folder, torch.float32, device)
    checks: list[Check] = []
    for dtype in dtypes:
        if time.perf_counter() > deadline:
            checks.append(Check(name, dtype, "all", "SKIP", "time budget spent"))
            print(checks[-1].line(), flush=True)
            continue
        for check in check_dtype(name, dtype, device, new_tokens, folder, model32, tp_size):
            print(check.line(), flush=True)
            checks.append(check)
    del model32
    gc.collect()
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for correctness.json")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--checkpoints", nargs="+", default=DEFAULT_CHECKPOINTS,
                        choices=list(CHECKPOINTS))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--time-budget", type=float, default=float("inf"),
                        help="seconds; checkpoint/dtype pairs not started by then are skipped")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="N > 1: compare triton + graphs at tp 1 and tp N (N GPUs)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a GPU, check the torch_native path on the CPU")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        print("gpu_correctness: no CUDA device; skipped (use --allow-cpu to check on the CPU)")
        return 0
    checks: list[Check] = []
    deadline = time.perf_counter() + args.time_budget
    with tempfile.TemporaryDirectory(prefix="rs-tiny-") as tmp:
        for name in args.checkpoints:
            checks += check_checkpoint(name, args.dtypes, device, args.new_tokens, Path(tmp),
                                       deadline, args.tp_size)
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "TIE", "FAIL", "SKIP")}
    print(f"correctness: {counts['PASS']} pass, {counts['TIE']} tie, {counts['FAIL']} fail, "
          f"{counts['SKIP']} skipped")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "correctness.json").write_text(
            json.dumps({"counts": counts, "checks": [asdict(c) for c in checks]}, indent=1))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
