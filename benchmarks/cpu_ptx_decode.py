"""Compile the decode-attention split kernel for Hopper (sm_90) on a machine without a GPU and
count what its PTX does: tensor-core instructions (wgmma, and of which operand type; mma.sync),
e4m3 -> fp16 conversions, asynchronous copies (the pipelined K/V loads), shared memory, and the
registers and stack (spills) of the cubin. A check of a kernel change before device time is spent.

    python3 benchmarks/cpu_ptx_decode.py [--kv fp8|bf16] [--single-split] [--out DIR] \
        CONFIG [CONFIG ...]

CONFIG is RADIXSERVE_DECODE_CONFIG's spelling ("32,1,5,1" or "64,2,3,1,0,1"), or
"default" for the pool's default at the split plan. Integer arguments get the divisibility by
16 that Triton's launcher gives them on the GPU (every stride of the pools and workspaces is a
multiple of 16 there): without it the K/V loads are not vectorised and not pipelined, and the
PTX is not the one the GPU runs.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.decode_config_pick import config_label  # noqa: E402
from radixserve.attention.kernels import decode_attention  # noqa: E402
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, default_decode_config)
from tests.hopper_compile import compile_for_hopper  # noqa: E402

POINTERS = {"Q": "*bf16", "Req_to_token": "*i32", "Req_pool_indices": "*i64", "Seq_lens": "*i64",
            "Mid_out": "*fp32", "Mid_lse": "*fp32", "O": "*bf16"}
# values of the launch's scalars: their types as the launcher infers them (a float is fp32; a
# split count that is neither 1 nor a multiple of 16 stays a plain i32)
SCALAR_VALUES = {"sm_scale_log2e": 0.125, "num_kv_splits": 3, "v_scale": 1.0}
STRIDE = 128  # any multiple of 16: the launcher marks it divisible by 16
# Llama-3.1-8B's attention: 32 query heads over 8 KV heads of 128
SHAPE = {"GROUP_SIZE": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 16}


def parse_config(spec: str, kv_fp8: bool, single_split: bool) -> DecodeKernelConfig:
    if spec == "default":
        return default_decode_config(torch.float8_e4m3fn if kv_fp8 else torch.bfloat16,
                                     1 if single_split else 4)
    return DecodeKernelConfig.from_spec(spec)


def compile_kernel(config: DecodeKernelConfig, kv_fp8: bool,
                   single_split: bool) -> tuple[str, bytes, int]:
    """The kernel's sm_90 PTX, cubin and shared memory in bytes, as the GPU's launcher compiles it
    for a bf16 query (the half-precision path of FP8 pools)."""
    kernel = decode_attention._decode_split_kernel
    constants = dict(SHAPE, BLOCK_N=config.block_n, DOT_PRECISION="tf32",
                     SINGLE_SPLIT=single_split, SLIDING_WINDOW=-1, LOGIT_CAP=0.0, USE_PDL=True,
                     KV_FP8=kv_fp8, FP8_AS_FP16=True, EARLY_V=config.early_v,
                     LAZY_RESCALE=config.lazy_rescale, LAZY_BITS=decode_attention.LAZY_MAX_BITS,
                     EARLY_KV=config.early_kv)
    missing = set(constants) - set(kernel.arg_names)
    if missing:
        sys.exit(f"the kernel no longer takes {sorted(missing)}: update cpu_ptx_decode.py")
    args: dict[str, object] = dict(constants)
    for name in kernel.arg_names:
        if name in constants:
            continue
        if name in ("K_Buffer", "V_Buffer"):
            args[name] = "*fp8e4nv" if kv_fp8 else "*bf16"
        elif name in POINTERS or name in SCALAR_VALUES:
            args[name] = POINTERS.get(name) or SCALAR_VALUES[name]
        elif name.startswith("stride_"):
            # Llama-3.1-8B with the backend's 16-split workspaces: every stride is a multiple of
            # 16 (the smallest, stride_lse_h, is the 16 splits)
            args[name] = STRIDE
        else:
            sys.exit(f"cpu_ptx_decode.py does not know the kernel argument {name!r}: update it")
    options = {"maxnreg": config.max_registers} if config.max_registers else {}
    compiled = compile_for_hopper(kernel, args, num_warps=config.num_warps,
                                  num_stages=config.num_stages, **options)
    return compiled.asm["ptx"], compiled.asm["cubin"], compiled.metadata.shared


def resource_usage(cubin: bytes) -> str:
    """Registers and spills of the cubin Triton built (cuobjdump, which Triton ships)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        result = subprocess.run([str(tool), "--dump-resource-usage", path],
                                capture_output=True, text=True, check=False)
    registers = re.search(r"REG:(\d+)", result.stdout)
    stack = re.search(r"STACK:(\d+)", result.stdout)
    if not registers:
        return f"cuobjdump failed: {(result.stderr or result.stdout).strip()[-200:]}"
    return f"{registers.group(1)} regs, stack {stack.group(1) if stack else '?'} B"


def summary(ptx: str) -> str:
    wgmma = re.findall(r"wgmma\.mma_async\S*", ptx)
    copies = len(re.findall(r"cp\.async\.c[ag]", ptx))
    types = sorted({name.split(".")[-2] + "." + name.split(".")[-1] for name in wgmma})
    return (f"wgmma {len(wgmma)} {','.join(types)}  mma.sync {ptx.count('mma.sync')}  "
            f"cvt e4m3->f16 {ptx.count('cvt.rn.f16x2.e4m3x2')}  "
            f"cp.async {copies}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--single-split", action="store_true",
                        help="the one-split kernel (batches of 33 and up); default: split")
    parser.add_argument("--out", type=Path, help="write each config's PTX here")
    args = parser.parse_args()
    kv_fp8 = args.kv == "fp8"
    print(f"triton {triton.__version__}, sm_90, {args.kv} KV, "
          f"{'one split' if args.single_split else 'split'}")
    for spec in args.configs:
        config = parse_config(spec, kv_fp8, args.single_split)
        ptx, cubin, shared = compile_kernel(config, kv_fp8, args.single_split)
        label = config_label(config)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{label}.ptx").write_text(ptx)
        print(f"{label:<14} shared {shared:6d} B  {resource_usage(cubin)}  {summary(ptx)}")


if __name__ == "__main__":
    main()
