"""What LoRA adapters cost (--lora-paths): decode throughput of one batch through the Engine
with no request on an adapter, with every request on one adapter, and with the requests spread
over several, on random weights of a model config (default: SmolLM2-135M's shapes, small
enough for a CPU) and random rank-r adapters on all seven projections.

    python3 benchmarks/lora_overhead.py                       # CPU, SmolLM2-135M shapes
    python3 benchmarks/lora_overhead.py --model-path benchmarks/configs/llama-3.1-8b \\
        --dtype bfloat16 --batch-size 32                      # a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import radixserve  # noqa: E402

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> None:
    """A random PEFT adapter of rank `rank` on every projection of every layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden),
              "o_proj": (hidden, q_out), "gate_proj": (inter, hidden),
              "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in MODULES:
            part = "self_attn" if module in MODULES[:4] else "mlp"
            out_f, in_f = shapes[module]
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="a config folder (dummy weights)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora_overhead_"))
    model_path = args.model_path
    if model_path is None:
        model_path = str(work / "model")
        Path(model_path).mkdir()
        (Path(model_path) / "config.json").write_text(json.dumps(SMOLLM2_135M))
    config = json.loads((Path(model_path) / "config.json").read_text())
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_adapter(work / name, config, args.rank, seed=i)
    engine = radixserve.Engine(model_path, load_format="dummy", dtype=args.dtype,
                               skip_tokenizer_init=True, disable_radix_cache=True,
                               lora_paths=[f"{name}={work / name}" for name in names])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (args.input_len,), generator=gen).tolist()
               for _ in range(args.batch_size)]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    plans = {"base model only": [None] * args.batch_size,
             "all on one adapter": [names[0]] * args.batch_size,
             f"spread over {len(names)} adapters": [names[i % len(names)]
                                                    for i in range(args.batch_size)]}
    engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
    results = {}
    for label, loras in plans.items():
        start = time.perf_counter()
        engine.generate(input_ids=prompts, lora_path=loras, sampling_params=params)
        wall = time.perf_counter() - start
        results[label] = args.batch_size * args.output_len / wall
    engine.shutdown()
    base = results["base model only"]
    for label, tok_s in results.items():
        print(f"{label:28s} {tok_s:9.1f} out tok/s  ({tok_s / base:.2f}x the base model's)")
    print(json.dumps({"batch_size": args.batch_size, "input_len": args.input_len,
                      "output_len": args.output_len, "rank": args.rank,
                      "out_tok_per_s": {k: round(v, 1) for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
