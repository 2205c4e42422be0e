"""Our Engine beside HF transformers in the same run: batch-1 greedy decode tok/s, and a batch of
requests (default 64 x 128 prompt x 128 output, ignore_eos) total output tok/s.

    python -m radixserve.bench.engine_vs_hf --dtype bfloat16 --dtype float32

transformers runs the same weights (the model our loader produced, copied into its own
LlamaForCausalLM) with `generate` on one static batch. Figures print as a table and append to
--output-file as JSON lines.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from radixserve.bench.report import append_jsonl, format_table
from radixserve.engine import Engine


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def hf_model_from_engine(engine: Engine, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    source = engine.scheduler.runner.source
    cfg = {k: v for k, v in source.hf_config.items() if k not in ("torch_dtype", "dtype")}
    config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
    device = engine.scheduler.runner.device
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if source.weights is not None:
        model.load_state_dict(dict(source.weights()), strict=False)
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def ours_batch1_decode(engine: Engine, prompt_ids: list[int], n: int) -> float:
    engine.generate(input_ids=prompt_ids, sampling_params=_greedy(4))  # warm-up
    first = None
    for chunk in engine.generate_stream(input_ids=prompt_ids, sampling_params=_greedy(n)):
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (n - 1) / (time.perf_counter() - first)


def ours_batch(engine: Engine, prompts: list[list[int]], n: int) -> float:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=_greedy(n))
    elapsed = time.perf_counter() - start
    total = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert total == n * len(prompts)
    return total / elapsed


def hf_generate_time(model: torch.nn.Module, prompts: list[list[int]], n: int) -> float:
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
    _sync(device)
    assert out.shape[1] == ids.shape[1] + n
    return time.perf_counter() - start


def hf_batch1_decode(model: torch.nn.Module, prompt: list[int], n: int) -> float:
    hf_generate_time(model, [prompt], 2)  # warm-up
    t_short = hf_generate_time(model, [prompt], 1)
    t_long = hf_generate_time(model, [prompt], n)
    return (n - 1) / (t_long - t_short)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", action="append", default=None)
    parser.add_argument("--batch1-prompt-len", type=int, default=16)
    parser.add_argument("--batch1-output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=0,
                        help="static batch for transformers (0: all prompts at once)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtype or ["bfloat16"]:
        engine = Engine(model_path=args.model_path, load_format=args.load_format,
                        device=args.device, dtype=dtype_name)
        runner = engine.scheduler.runner
        gen = torch.Generator().manual_seed(0)
        vocab = min(runner.vocab_size, 30000)
        batch1 = torch.randint(100, vocab, (args.batch1_prompt_len,), generator=gen).tolist()
        prompts = torch.randint(100, vocab, (args.num_prompts, args.input_len),
                                generator=gen).tolist()
        row: dict[str, Any] = {"dtype": dtype_name, "device": str(runner.device),
                               "model": runner.source.served_model_name}
        row["ours_batch1_decode_tok_s"] = ours_batch1_decode(engine, batch1,
                                                             args.batch1_output_len)
        ours_batch(engine, prompts[:2], 4)  # warm-up
        row["ours_batch_output_tok_s"] = ours_batch(engine, prompts, args.output_len)
        if not args.skip_hf:
            model = hf_model_from_engine(engine, runner.dtype)
            row["hf_batch1_decode_tok_s"] = hf_batch1_decode(model, batch1,
                                                             args.batch1_output_len)
            bs = args.hf_batch_size or len(prompts)
            elapsed = sum(hf_generate_time(model, prompts[i:i + bs], args.output_len)
                          for i in range(0, len(prompts), bs))
            row["hf_batch_output_tok_s"] = len(prompts) * args.output_len / elapsed
            row["hf_batch_size"] = bs
            del model
        rows.append(row)
        del engine
    print(format_table(rows, [("dtype", "dtype", ""),
                              ("ours_batch1_decode_tok_s", "ours b1 tok/s", ".1f"),
                              ("hf_batch1_decode_tok_s", "HF b1 tok/s", ".1f"),
                              ("ours_batch_output_tok_s", "ours batch tok/s", ".1f"),
                              ("hf_batch_output_tok_s", "HF batch tok/s", ".1f")]))
    append_jsonl(args.output_file, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
