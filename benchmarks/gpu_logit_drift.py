"""How far each path's low-precision logits drift from transformers' float32 ones, teacher
forced, at every step of a greedy continuation: transformers in bf16, and radixserve in bf16
on each attention backend (prefill of the prompt, then one decode step per token). A greedy
divergence that gpu_correctness.py calls a FAIL is a precision defect when one path's drift is
well above transformers' own bf16 drift at most steps, and a routing flip (a top-k choice of
an MoE layer that a rounding changed) when the drift is the same at most steps and large at a
few. Usage (checkpoints from gpu_correctness.CHECKPOINTS):

  python benchmarks/gpu_logit_drift.py --checkpoints deepseek-mla deepseek-v3 [--no-router-kernel]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.gpu_correctness import (hf_greedy, load_hf,  # noqa: E402
                                        make_checkpoint, make_prompts)
from tests.models.runner_driver import RunnerDriver  # noqa: E402


DEVICE = "cuda"


def hf_logits(model, seq: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq], device=DEVICE)).logits[0, start - 1:-1].float()


def ours_logits(folder: Path, backend: str, seq: list[int], start: int) -> torch.Tensor:
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="bfloat16", device=DEVICE,
                                    attention_backend=backend, disable_cuda_graph=True,
                                    max_total_tokens=8192, max_running_requests=4))
    driver = RunnerDriver(runner)
    rows = [driver.extend({0: seq[:start]})[0]]
    rows += [driver.extend({0: [t]})[0] for t in seq[start:-1]]
    out = torch.stack(rows).float()
    del runner, driver
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def summary(label: str, drift: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> str:
    per_step = drift.amax(dim=-1)
    flips = int((want.argmax(-1) != got.argmax(-1)).sum())
    return (f"  {label:<22} median {per_step.median():.4f}  p90 {per_step.quantile(0.9):.4f}  "
            f"max {per_step.max():.4f}  steps > 0.5: {int((per_step > 0.5).sum())}/"
            f"{len(per_step)}  argmax flips {flips}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", default=["deepseek-mla", "deepseek-v3"])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--no-router-kernel", action="store_true",
                        help="also run radixserve's triton path with torch routing")
    parser.add_argument("--cpu", action="store_true", help="torch_native on the CPU (a check "
                        "of the script itself)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    for name in args.checkpoints:
        with tempfile.TemporaryDirectory(prefix="rs-drift-") as tmp:
            folder = Path(tmp)
            make_checkpoint(name, folder)
            ref = load_hf(folder, torch.float32, DEVICE)
            low = load_hf(folder, torch.bfloat16, DEVICE)
            prompts = make_prompts(ref.config.vocab_size)[1:]
            seqs = [p + o for p, o in zip(prompts, hf_greedy(ref, prompts, args.new_tokens,
                                                              DEVICE))]
            print(f"{name}: {len(seqs)} prompts x {args.new_tokens} teacher-forced steps, "
                  "max |logit - fp32 logit| per step", flush=True)
            want = torch.cat([hf_logits(ref, s, len(p)) for s, p in zip(seqs, prompts)])
            got = torch.cat([hf_logits(low, s, len(p)) for s, p in zip(seqs, prompts)])
            print(summary("transformers bf16", (got - want).abs(), want, got), flush=True)
            variants = [("torch_native", True)] + ([] if args.cpu else [("triton", True)])
            if args.no_router_kernel:
                variants.append(("triton", False))
            from radixserve.layers.moe import router
            for backend, kernel in variants:
                router.ROUTER_KERNEL = kernel
                got = torch.cat([ours_logits(folder, backend, s, len(p))
                                 for s, p in zip(seqs, prompts)])
                label = f"ours {backend}" + ("" if kernel else " torch-route")
                print(summary(label, (got - want).abs(), want, got), flush=True)
            router.ROUTER_KERNEL = True
            del ref, low
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
