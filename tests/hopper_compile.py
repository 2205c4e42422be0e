"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, with its arguments
specialised as the GPU launcher specialises them, so CI catches what only the compiler sees: the
interpreter runs the kernels' Python, but never turns an integer argument equal to 1 into a
compile-time constant (a Python int, without the tensor methods a kernel may call on it) and
never type-checks the kernel for the GPU.

Kernels decorated while TRITON_INTERPRET=1 is set (tests/conftest.py sets it without a GPU)
are interpreted functions, which cannot be compiled: `compile_in_fresh_process` runs a snippet
calling `compile_for_hopper` in a child Python without that variable.
benchmarks/cpu_ptx_decode.py compiles the decode-attention kernel through it too.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def compile_for_hopper(kernel: Any, args: dict[str, Any], num_warps: int = 4,
                       num_stages: int = 3, **options: Any) -> Any:
    """`kernel` (a triton.jit function) compiled for sm_90, PTX and cubin. `args` gives every
    argument: a pointer as its Triton type ("*bf16"), an int or a float as the value the launch
    passes, a tl.constexpr parameter as its value. As the launcher does, an int equal to 1
    becomes a constant and a multiple of 16 is marked divisible by 16, unless the kernel lists it
    in do_not_specialize; pointers are taken as 16-byte aligned. `options` go to the compiler
    with the warps and stages (e.g. maxnreg)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    unspecialised = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    constexpr_params = {names[i] for i in kernel.constexprs}
    missing = set(names) - set(args)
    assert not missing, f"no value for {sorted(missing)}"
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(names):
        value = args[name]
        if name in constexpr_params:
            signature[name], constexprs[(index,)] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: give a pointer type, an int or a float, not {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and name not in unspecialised:
            signature[name], constexprs[(index,)] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in unspecialised:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def compile_in_fresh_process(snippet: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `snippet` (Python that imports the kernel and calls compile_for_hopper) in a child
    without TRITON_INTERPRET, from the repository root; its output is captured."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", snippet], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
