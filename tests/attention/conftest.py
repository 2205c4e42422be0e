"""Triton kernels run under the CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports the kernel modules.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
