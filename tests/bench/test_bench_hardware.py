"""Roofline arithmetic checked against real transformers models and torch's FLOP counter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PretrainedConfig,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          MiniMaxM2Config, MiniMaxM2ForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, OlmoHybridConfig,
                          OlmoHybridForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Qwen3NextConfig, Qwen3NextForCausalLM, NemotronHConfig,
                          NemotronHForCausalLM, GraniteMoeHybridConfig,
                          GraniteMoeHybridForCausalLM, BambaConfig, BambaForCausalLM,
                          FalconH1Config, FalconH1ForCausalLM, Llama4TextConfig,
                          Llama4ForCausalLM, MistralConfig)

from radixserve.bench import hardware
from radixserve.core.model_config import ModelConfig
from radixserve.mem.kv_pool import KVCacheSpec
from radixserve.mem.mha_pool import MHATokenToKVPool

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _models() -> list[tuple[str, PretrainedConfig, type]]:
    return [("llama", LlamaConfig(**SHAPE, tie_word_embeddings=False), LlamaForCausalLM),
            ("llama-tied", LlamaConfig(**SHAPE, tie_word_embeddings=True), LlamaForCausalLM),
            ("llama-bias", LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True,
                                       head_dim=24), LlamaForCausalLM),
            ("qwen2", Qwen2Config(**SHAPE, tie_word_embeddings=False), Qwen2ForCausalLM),
            ("mixtral", MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False), MixtralForCausalLM),
            ("qwen2-moe", Qwen2MoeConfig(**SHAPE, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         mlp_only_layers=[1], tie_word_embeddings=False),
             Qwen2MoeForCausalLM),
            ("qwen3-moe", Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, tie_word_embeddings=False),
             Qwen3MoeForCausalLM),
            ("deepseek-v2", DeepseekV2Config(**SHAPE, kv_lora_rank=32, q_lora_rank=24,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=12, n_routed_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=24,
                                             n_shared_experts=2, first_k_dense_replace=1,
                                             tie_word_embeddings=False),
             DeepseekV2ForCausalLM),
            # hybrid: Gated DeltaNet layers (2 key heads for 4 value heads) and gated attention
            ("qwen3-next", Qwen3NextConfig(**SHAPE, head_dim=16, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=8, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=32,
                                           mlp_only_layers=[1], tie_word_embeddings=False,
                                           layer_types=["linear_attention", "full_attention",
                                                        "linear_attention"]),
             Qwen3NextForCausalLM),
            ("olmo2", Olmo2Config(**SHAPE, tie_word_embeddings=False, pad_token_id=0,
                                  eos_token_id=1, bos_token_id=None), Olmo2ForCausalLM),
            ("olmo-hybrid", OlmoHybridConfig(**SHAPE, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=16,
                                             linear_value_head_dim=8, tie_word_embeddings=False,
                                             layer_types=["linear_attention", "full_attention",
                                                          "linear_attention"],
                                             pad_token_id=0, eos_token_id=1,
                                             bos_token_id=None), OlmoHybridForCausalLM),
            # every layer MoE, q/k norms over the whole projections (the router's correction
            # bias is a buffer, not a parameter)
            ("minimax-m2", MiniMaxM2Config(**SHAPE, head_dim=16,
                                           num_local_experts=4, num_experts_per_tok=2,
                                           tie_word_embeddings=False, pad_token_id=0,
                                           eos_token_id=1, bos_token_id=None),
             MiniMaxM2ForCausalLM),
            # Mamba-2 hybrids: one mixer per layer (Mamba-2, attention, ReLU-squared MLP, MoE
            # of ungated experts in a latent width), and Granite's mixer + experts and shared MLP
            ("nemotron-h", NemotronHConfig(
                vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                moe_shared_expert_intermediate_size=32, moe_latent_size=40,
                tie_word_embeddings=False), NemotronHForCausalLM),
            ("granite-h", GraniteMoeHybridConfig(
                **SHAPE, shared_intermediate_size=48, num_local_experts=4,
                num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
                mamba_d_head=16, layer_types=["linear_attention", "attention",
                                              "linear_attention"], tie_word_embeddings=True),
             GraniteMoeHybridForCausalLM),
            ("bamba", BambaConfig(**SHAPE, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                                  mamba_d_head=16, attn_layer_indices=[1],
                                  tie_word_embeddings=False), BambaForCausalLM),
            # MoE on every other layer (a shared expert beside top-1 routing), wider dense
            # layers between, weightless q/k norms
            ("llama4", Llama4TextConfig(**SHAPE, head_dim=16, intermediate_size_mlp=128,
                                        num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2,
                                        tie_word_embeddings=False), Llama4ForCausalLM),
            ("falcon-h1", FalconH1Config(**SHAPE, mamba_d_ssm=96, mamba_n_heads=6,
                                         mamba_n_groups=2, mamba_d_state=16,
                                         mamba_rms_norm=True, projectors_bias=True,
                                         tie_word_embeddings=False), FalconH1ForCausalLM)]


def _pair(hf_cfg: PretrainedConfig, cls: type) -> tuple[ModelConfig, torch.nn.Module]:
    torch.manual_seed(0)
    model = cls(hf_cfg).eval()
    d = hf_cfg.to_dict()
    d["architectures"] = [cls.__name__]
    return ModelConfig.from_hf_dict(d), model


@pytest.mark.parametrize("name,hf_cfg,cls", _models(), ids=[m[0] for m in _models()])
def test_param_counts_match_transformers(name: str, hf_cfg: PretrainedConfig, cls: type) -> None:
    cfg, model = _pair(hf_cfg, cls)
    counts = hardware.param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # read per step: everything but the gathered embedding table, the LM head always
    expected_read = counts.total - (0 if tied else embed)
    assert hardware.weight_bytes_per_forward(cfg, torch.float32) == expected_read * 4
    assert hardware.weight_bytes_per_forward(cfg, "bfloat16") == expected_read * 2


@pytest.mark.parametrize("name,hf_cfg,cls", _models()[:3], ids=[m[0] for m in _models()[:3]])
def test_forward_flops_match_flop_counter(name: str, hf_cfg: PretrainedConfig,
                                          cls: type) -> None:
    """FlopCounterMode counts every matmul, with eager attention over the full (masked, not
    skipped) seq x seq scores, and logits for every token."""
    hf_cfg._attn_implementation = "eager"  # plain matmuls the counter sees
    cfg, model = _pair(hf_cfg, cls)
    batch, seq = 2, 10
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    ours = hardware.forward_flops(cfg, num_tokens=batch * seq, context=seq)
    assert ours == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_prefill_and_decode_arithmetic_by_hand() -> None:
    cfg = ModelConfig.from_hf_dict(LlamaConfig(**SHAPE).to_dict())
    counts = hardware.param_counts(cfg)
    n_attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    # a 3-token causal prompt attends to 1 + 2 + 3 = 6 keys in all
    assert hardware.prefill_flops(cfg, batch=1, input_len=3) == pytest.approx(
        2 * counts.linear * 3 + 2 * counts.lm_head * 1 + n_attn * 6)
    kv = hardware.kv_bytes_per_token(cfg, torch.bfloat16)
    assert kv == MHATokenToKVPool.bytes_per_token(KVCacheSpec(
        "mha", cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16))
    assert kv == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    weights = hardware.weight_bytes_per_forward(cfg, torch.bfloat16)
    assert hardware.decode_step_bytes(cfg, batch=4, context=100, dtype=torch.bfloat16) == \
        weights + 4 * 100 * kv + 4 * kv


def test_moe_reads_only_the_experts_a_batch_uses() -> None:
    hf_cfg = MixtralConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2)
    cfg = ModelConfig.from_hf_dict(dict(hf_cfg.to_dict(), architectures=["MixtralForCausalLM"]))
    counts = hardware.param_counts(cfg)
    everything = hardware.weight_bytes_per_forward(cfg, torch.bfloat16)
    one_token = hardware.weight_bytes_per_forward(cfg, torch.bfloat16, num_tokens=1)
    # one token reads 2 of 8 experts per layer
    assert everything - one_token == 6 * counts.moe_layers * counts.routed_expert * 2
    assert counts.active_linear == counts.linear - 6 * counts.moe_layers * counts.routed_expert
    assert hardware.weight_bytes_per_forward(cfg, torch.bfloat16, num_tokens=4096) == \
        pytest.approx(everything, rel=1e-6)


def test_decode_reads_only_the_keys_windows_and_chunks_leave() -> None:
    """Llama-4's chunked layers see the positions of the query's own chunk (its NoPE layers
    the whole context); a sliding window at most W keys."""
    llama4 = ModelConfig.from_hf_dict({**Llama4TextConfig(
        **{**SHAPE, "num_hidden_layers": 4}, attention_chunk_size=8).to_dict(),
        "architectures": ["Llama4ForCausalLM"]})
    assert hardware.attended_keys(llama4, 20) == (3 * 4 + 20) / 4  # 16..19 of 20
    assert hardware.attended_keys(llama4, 16) == (3 * 8 + 16) / 4
    mistral = ModelConfig.from_hf_dict({**MistralConfig(**SHAPE, sliding_window=5).to_dict(),
                                        "architectures": ["MistralForCausalLM"]})
    assert (hardware.attended_keys(mistral, 20), hardware.attended_keys(mistral, 3)) == (5, 3)
    kv = hardware.kv_bytes_per_token(mistral, "bfloat16")
    weights = hardware.weight_bytes_per_forward(mistral, "bfloat16", 2)
    assert hardware.decode_step_bytes(mistral, 2, 20, "bfloat16") == weights + 2 * 5 * kv + 2 * kv


def test_roofline_picks_the_slower_side() -> None:
    peak = hardware.DevicePeak("x", mem_bandwidth=100.0, peak_flops=1000.0, source="test")
    assert hardware.roofline(200.0, 1000.0, peak) == (2.0, "memory")
    assert hardware.roofline(50.0, 3000.0, peak) == (3.0, "compute")


def test_device_peak_flags_win_and_cpu_is_measured() -> None:
    peak = hardware.device_peak("cpu", "float32", bandwidth=1e9, peak_flops=2e9)
    assert (peak.mem_bandwidth, peak.peak_flops) == (1e9, 2e9) and "flag" in peak.source
    measured = hardware.device_peak("cpu", "float32")
    assert measured.mem_bandwidth > 0 and measured.peak_flops > 0
    assert "measured" in measured.source


def _small_llama() -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))


def test_workload_limit_sums_compute_and_kv_reads() -> None:
    """Against an explicit step-by-step sum: each prompt's prefill FLOPs, then one forward token
    per decode step attending to the prompt plus the tokens so far, and that step's KV read."""
    cfg = _small_llama()
    peak = hardware.DevicePeak("test", mem_bandwidth=1e9, peak_flops=1e12, source="flag")
    prompts, outputs = [5, 9], [4, 1]
    flops = kv_bytes = 0.0
    kv = hardware.kv_bytes_per_token(cfg, "bfloat16")
    for n_in, n_out in zip(prompts, outputs):
        flops += hardware.prefill_flops(cfg, 1, n_in)
        for step in range(n_out - 1):
            context = n_in + step + 1
            flops += hardware.forward_flops(cfg, 1, context)
            kv_bytes += context * kv
    expected = flops / 1e12 + kv_bytes / 1e9
    got = hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16", peak)
    assert got == pytest.approx(expected, rel=1e-12)


def test_workload_limit_runs_fp8_linears_at_the_fp8_peak() -> None:
    """With FP8 weights the decoder's linear FLOPs take the FP8 peak; the LM head, attention
    and the KV reads are unchanged. Without an FP8 peak everything takes the dtype's peak."""
    cfg = _small_llama()
    prompts, outputs = [7, 3], [5, 2]
    peak = hardware.DevicePeak("test", mem_bandwidth=1e9, peak_flops=1e12, source="flag",
                               fp8_flops=2e12)
    bf16 = hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16", peak)
    fp8 = hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16", peak,
                                          fp8_linears=True)
    linear = sum(hardware.prefill_flops_split(cfg, 1, n)[0] for n in prompts)
    for n_in, n_out in zip(prompts, outputs):
        steps = n_out - 1
        linear += hardware.forward_flops_split(cfg, steps, n_in + (steps + 1) / 2, decode=True)[0]
    assert bf16 - fp8 == pytest.approx(linear / 1e12 - linear / 2e12, rel=1e-9)
    no_fp8_peak = hardware.DevicePeak("test", 1e9, 1e12, "flag")
    assert hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16", no_fp8_peak,
                                           fp8_linears=True) == pytest.approx(bf16)
    assert peak.times(2).fp8_flops == 4e12 and no_fp8_peak.times(2).fp8_flops is None


def test_sustained_peaks_give_a_longer_limit_and_scale_with_tensor_parallelism() -> None:
    """The limit at the power limit replaces the burst FLOP/s (the FP8 one too when known) and
    keeps the bandwidth; without a sustained rate there is no second limit."""
    cfg = _small_llama()
    prompts, outputs = [7, 3], [5, 2]
    peak = hardware.DevicePeak("test", mem_bandwidth=1e9, peak_flops=1e12, source="flag",
                               fp8_flops=2e12, sustained_flops=0.5e12)
    at_cap = peak.sustained()
    assert at_cap is not None
    assert (at_cap.peak_flops, at_cap.mem_bandwidth, at_cap.fp8_flops) == (0.5e12, 1e9, 2e12)
    flops_only = hardware.DevicePeak("test", mem_bandwidth=float("inf"), peak_flops=1e12,
                                     source="flag", sustained_flops=0.5e12)
    burst = hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16", flops_only)
    sustained = hardware.workload_limit_seconds(cfg, prompts, outputs, "bfloat16",
                                                flops_only.sustained())
    assert sustained == pytest.approx(2 * burst, rel=1e-12)  # half the FLOP/s, no KV term
    both = hardware.DevicePeak("test", 1e9, 1e12, "flag", 2e12, 0.5e12, 1.5e12)
    assert both.sustained().fp8_flops == 1.5e12
    assert both.times(4).sustained_flops == 2e12 and both.times(4).sustained_fp8_flops == 6e12
    assert hardware.DevicePeak("test", 1e9, 1e12, "flag").sustained() is None
    flagged = hardware.device_peak("cpu", "float32", bandwidth=1e9, peak_flops=2e9,
                                   sustained_flops=1e9)
    assert flagged.sustained_flops == 1e9
    assert hardware.device_peak("cpu", "float32", bandwidth=1e9, peak_flops=2e9).sustained() \
        is None  # only the H200's rate at its power limit is known without the flag


def test_h200_rates_at_the_power_limit_go_with_its_own_burst_figures(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = hardware.device_peak("cuda", "bfloat16")
    assert (peak.peak_flops, peak.sustained_flops) == (
        hardware.H200_BF16_FLOPS, hardware.H200_BF16_FLOPS_AT_POWER_LIMIT)
    assert peak.sustained().fp8_flops == hardware.H200_FP8_FLOPS_AT_POWER_LIMIT
    flagged = hardware.device_peak("cuda", "bfloat16", peak_flops=1e15, fp8_flops=2e15)
    assert flagged.sustained() is None  # another device's figures: no H200 rate beside them
    both = hardware.device_peak("cuda", "bfloat16", peak_flops=1e15, fp8_flops=2e15,
                                sustained_flops=8e14)
    assert (both.sustained().peak_flops, both.sustained().fp8_flops) == (8e14, 2e15)


@pytest.mark.parametrize("argv", [["--dtype", "fp8"], ["--device", "cuda"],
                                  ["--device", "nodevice"]])
def test_hardware_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        hardware.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"radixserve bench hardware: error: argument {argv[0]}")


def test_hardware_cli_names_a_missing_model_path(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    assert hardware.main(["--device", "cpu", "--bandwidth", "1e10", "--peak-flops", "1e12",
                          "--model-path", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err.strip() == \
        f"error: --model-path {tmp_path / 'absent'}: no such directory"


def test_the_usage_line_names_a_command_that_exists(capsys: pytest.CaptureFixture) -> None:
    """The usage line says `radixserve bench hardware`, and the CLI runs that command."""
    from radixserve.cli import main as cli_main

    with pytest.raises(SystemExit):
        hardware.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: radixserve bench hardware ")
    with pytest.raises(SystemExit) as exited:
        cli_main(["bench", "hardware", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: radixserve bench hardware ")
