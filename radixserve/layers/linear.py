"""Linear layers whose parameters load themselves from checkpoint tensors.

Every parameter carries `weight_loader(param, loaded, shard_id=None)` (the generic loader in
loader/weight_loading.py calls it): a column-parallel layer keeps its rank's rows, a
row-parallel one its rank's columns, and merged layers (q|k|v, gate|up) place each checkpoint
tensor (`shard_id`) at its offset. Rank and size default to this process's tensor-parallel group
(distributed/parallel_state.py), so model files never name them; with one rank the shards are
the whole tensors. A row-parallel layer sums its ranks' partial products with an all-reduce
before adding its bias.
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.cpu_linear import packed_linear
from radixserve.layers.quantization.fp8 import (FP8_DTYPE, Fp8Config, Fp8Rows,
                                                current_fp8_config, row_amax)
from radixserve.layers.quantization.fp8_linear import (add_fp8_params, finish_fp8_loading,
                                                       fp8_linear, fp8_rows_linear,
                                                       takes_fp8_rows)
from radixserve.layers.lora import LoRAStacks, add_lora
from radixserve.layers.quantization.int4 import Int4Config, current_int4_config
from radixserve.layers.quantization.int4_linear import (add_int4_params, finish_int4_loading,
                                                        int4_linear)

if TYPE_CHECKING:
    from radixserve.layers.kernels.gemv_rope import RopeStore
    from radixserve.layers.norm import RMSNorm

# RADIXSERVE_GEMV=0 sends one-token and decode-sized products to cuBLAS too (for A/B timing)
SMALL_M_MAX = 64  # the largest row count a swept table may cover
_GEMV_ENABLED = os.environ.get("RADIXSERVE_GEMV", "1") != "0"
# RADIXSERVE_ROW_FUSION=0 keeps a decode layer's norms, SiLU-mul and residual adds as their own
# kernels at 1-8 rows (for A/B timing of `LinearBase.fused_row_product`)
ROW_FUSION_ENABLED = os.environ.get("RADIXSERVE_ROW_FUSION", "1") != "0"
MAX_FUSED_ROWS = 8  # the most rows a fused decode product takes (kernels/fused_rows.py)


@functools.lru_cache(maxsize=None)
def _triton_kernels():  # -> the kernels module namespace, or None without triton
    try:
        from radixserve.layers.kernels import fused_rows, gemm_tables, gemv, skinny_gemm
    except ImportError:
        return None
    return gemm_tables, gemv, skinny_gemm, fused_rows


@functools.lru_cache(maxsize=None)
def _small_m_kernel(n: int, k: int, m: int):  # -> a callable(x, weight, bias) or None
    kernels = _triton_kernels()
    if kernels is None:
        return None
    gemm_tables, gemv, skinny_gemm, fused_rows = kernels
    if m == 1:
        config = gemv.tuned_gemv_config("bf16", n, k)
        if config is None:
            return None
        return lambda x, weight, bias: gemv.gemv(x.contiguous(), weight, bias, config)
    rows = fused_rows.rows_config(n, k, m, "")  # the GEMV widened to M rows, where it won
    if rows is not None:
        return lambda x, weight, bias: fused_rows.fused_rows(x, weight, rows, gemv.NO_FUSION,
                                                             bias)
    cfg = skinny_gemm.config_from_entry(gemm_tables.tuned_entry("bf16", n, k, m))
    if cfg is None:  # not swept, or cuBLAS won the sweep
        return None
    return lambda x, weight, bias: skinny_gemm.skinny_gemm(x, weight, cfg, bias=bias)


def _small_m_product(x: torch.Tensor, weight: torch.Tensor):  # -> a callable or None
    """The Triton GEMV / rows GEMV / skinny GEMM that `linear` runs this product on, if any."""
    if (_GEMV_ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] <= SMALL_M_MAX
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.shape[0] > 0):
        return _small_m_kernel(weight.shape[0], weight.shape[1], x.shape[0])
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T (+ bias). On CUDA in fp16/bf16 a single row (batch-1 decode) goes to the
    Triton GEMV, which reads the weights faster than cuBLAS does at M=1, and a decode-sized
    batch to the GEMV widened to its rows (kernels/fused_rows.py, 2-8 rows) or the skinny
    Triton GEMM where the H200 sweep found it faster (kernels/gemm_tables); the rest to
    cuBLAS."""
    kernel = _small_m_product(x, weight)
    if kernel is not None:
        return kernel(x, weight, bias)
    if not x.is_cuda:  # the CPU GEMV, or oneDNN with the weight packed once (cpu_linear.py)
        out = packed_linear(x, weight, bias)
        if out is not None:
            return out
        if weight.dtype != x.dtype:  # a bf16 weight kept under float32 compute
            weight = weight.to(x.dtype)
    return nn.functional.linear(x, weight, bias)


def linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) written into `out` ([rows, out_features], contiguous, of the product's
    dtype), which is returned. Where `linear` would run cuBLAS, cuBLAS writes `out` itself, so
    the product is not written twice; the Triton kernels' and the CPU's results are copied in."""
    if (x.is_cuda and x.dim() == 2 and out.dtype == x.dtype == weight.dtype
            and out.is_contiguous() and _small_m_product(x, weight) is None):
        return torch.matmul(x, weight.t(), out=out)
    return out.copy_(linear(x, weight))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _shard(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return loaded
    size = loaded.shape[dim]
    if size % tp_size:
        raise ValueError(f"dimension {dim} of size {size} does not split over {tp_size} ranks")
    part = size // tp_size
    return loaded.narrow(dim, tp_rank * part, part)


class LinearBase(nn.Module):
    """y = x @ W.T (+ b), W of [output_size, input_size] on this rank."""

    input_is_split = False  # the checkpoint's input columns are split over the ranks
    group_k: int | None = None  # FP8 block scales: input columns per scale group on this rank
    # --quantization fp8 at tp > 1: the checkpoint's whole rows' maxima, until finish_loading
    checkpoint_row_amax: torch.Tensor | None = None
    lora: "LoRAStacks | None" = None  # LoRA adapters' stacks (layers/lora.py), if adapted

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None,
                 quantize: bool = True) -> None:
        """quantize=False keeps the layer in the compute dtype even when the model is built
        under an FP8 setting (layers/quantization/fp8.py: fp8_linears)."""
        super().__init__()
        self.tp_rank, self.tp_size = _rank_and_size(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.fp8: Fp8Config | None = current_fp8_config() if quantize else None
        # int4 (W4A16): packed codes instead of `weight` (layers/quantization/int4_linear.py)
        self.int4: Int4Config | None = current_int4_config() if quantize else None
        if self.int4 is None:
            dtype = FP8_DTYPE if self.fp8 is not None and not self.fp8.online else None
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        if self.fp8 is not None:
            add_fp8_params(self, self.fp8)
        if self.int4 is not None:
            add_int4_params(self, self.int4)

    def full_rows(self, shard_id: object = None) -> int:
        """Rows of the checkpoint tensor (or of its piece `shard_id`) before the rank split."""
        return self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        default_weight_loader(param, loaded)

    def finish_loading(self) -> None:
        """After every tensor is loaded (--quantization fp8 quantises here; int4 codes are
        packed, or dequantised where the packed product cannot serve)."""
        finish_fp8_loading(self)
        finish_int4_loading(self)

    def product(self, x: "torch.Tensor | Fp8Rows", bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias) with this rank's weight, FP8 or not. x may be rows quantised
        beforehand (`Fp8Rows`, for FP8 layers only: see `takes_fp8_rows`)."""
        if isinstance(x, Fp8Rows):
            assert self.fp8 is not None, "quantised rows need an FP8 weight"
            return fp8_rows_linear(x, self.weight, self.weight_scale, self.group_k, bias)
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.group_k, bias)
        if self.int4 is not None:
            return int4_linear(x, self.int4_qweight, self.int4_scales, self.int4_zeros,
                               self.int4_group_k, self.int4_perm, bias)
        return linear(x, self.weight, bias)

    def forward(self, x: "torch.Tensor | Fp8Rows") -> torch.Tensor:
        return self.with_lora(x, self.product(x, self.bias))

    def with_lora(self, x: "torch.Tensor | Fp8Rows", out: torch.Tensor) -> torch.Tensor:
        """out plus the LoRA adapters' deltas of the pass's adapted rows, if any."""
        if self.lora is None:
            return out
        assert isinstance(x, torch.Tensor), "LoRA layers take unquantised rows"
        return add_lora(self, x, out)

    def takes_fp8_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether rows of `dtype` activations quantised beforehand (per token, e4m3) go to
        the tensor cores as they are here: an FP8 weight with a swept configuration for that
        many rows, or a batch _scaled_mm takes."""
        return self.fp8 is not None and self.lora is None and self.weight.stride(1) == 1 \
            and takes_fp8_rows(self.weight, self.weight_scale, self.group_k, rows, dtype)

    def _row_fusion_kernels(self, dtype: torch.dtype, residual: bool):
        """The Triton kernels (`_triton_kernels()`) when rows of `dtype` through this layer may
        carry their neighbours at all: row fusion on, half-precision rows, weight rows
        contiguous, and no residual add that waits for the ranks' all-reduce; else None."""
        if not (_GEMV_ENABLED and ROW_FUSION_ENABLED) or \
                dtype not in (torch.float16, torch.bfloat16):
            return None
        if residual and self.tp_size > 1:  # the ranks' partial sums are reduced before the add
            return None
        if self.int4 is not None:  # packed int4 codes: the int4 kernels only
            return None
        if self.lora is not None:  # the adapters' deltas need the layer's own output
            return None
        if self.weight.stride(1) != 1:
            return None
        return _triton_kernels()

    def fuses_one_row(self, dtype: torch.dtype, *, residual: bool = False) -> bool:
        """Whether `fused_row_product` has a kernel for one row of `dtype`: the GPU GEMV (bf16
        or FP8 weights) with a configuration for this weight."""
        kernels = self._row_fusion_kernels(dtype, residual)
        if kernels is None:
            return False
        gemv = kernels[1]
        if self.fp8 is not None:
            return self.weight.dtype == FP8_DTYPE and gemv.fp8_gemv_config(
                self.weight, self.weight_scale, self.group_k) is not None
        n, k = self.weight.shape
        return self.weight.dtype == dtype and gemv.tuned_gemv_config("bf16", n, k) is not None

    def fuses_rows(self, rows: int, dtype: torch.dtype, *, norm: bool = False,
                   gated: bool = False, residual: bool = False) -> bool:
        """Whether `fused_row_product` has a kernel for `rows` rows of `dtype` with these
        fusions: one row as `fuses_one_row`; 2-8 rows over a weight of that dtype where the
        H200 sweep wrote this fusion's configuration at that row count (kernels/fused_rows.py;
        benchmarks/gpu_rows_fusion.py writes it only where the fused layer was faster)."""
        if rows == 1:
            return self.fuses_one_row(dtype, residual=residual)
        kernels = self._row_fusion_kernels(dtype, residual)
        if kernels is None or self.fp8 is not None or self.weight.dtype != dtype:
            return False
        gemv, fused_rows = kernels[1], kernels[3]
        n, k = self.weight.shape
        variant = gemv.fusion_variant(norm, gated, residual)
        return fused_rows.rows_config(n, k, rows, variant) is not None

    def _one_row_gemv_config(self, fusion):  # -> gemv.GemvConfig | None
        """The configuration of the GEMV that a one-row `fused_row_product` with `fusion` runs,
        or None where another kernel runs it (FP8: the tensor-core rows kernel's sweep won)."""
        gemv = _triton_kernels()[1]
        n, k = self.weight.shape
        if self.fp8 is None:
            return gemv.row_config("bf16", n, k, fusion)
        from radixserve.layers.kernels import fp8_mma_rows
        if fp8_mma_rows.tuned_config(n, k, 1, fusion.variant) is not None:
            return None
        return gemv.fp8_gemv_config(self.weight, self.weight_scale, self.group_k,
                                    fusion=fusion)

    def carries_rope_store(self, dtype: torch.dtype, head_dim: int, norm: "RMSNorm") -> bool:
        """Whether this q|k|v layer's one-row product with `norm` fused can also carry rope
        and the K/V store (kernels/gemv_rope.py): its GEMV's programs hold whole rope pairs
        (RADIXSERVE_GEMV_ROPE=0: never)."""
        if not self.fuses_one_row(dtype):
            return False
        from radixserve.layers.kernels import gemv_rope
        gemv = _triton_kernels()[1]
        config = self._one_row_gemv_config(gemv.RowFusion(norm.weight, norm.variance_epsilon))
        return gemv_rope.ENABLED and config is not None and \
            gemv_rope.rope_rows_fit(config.block_n, head_dim)

    def fused_row_product(self, x: torch.Tensor, *, norm: "RMSNorm | None" = None,
                          gated: bool = False, residual: torch.Tensor | None = None,
                          rope: "RopeStore | None" = None) -> torch.Tensor:
        """Rows x [M, K] through this layer with its neighbours fused into the product (see
        kernels/gemv.py RowFusion): norm: x is the residual stream and the input is norm(x);
        gated: the output is silu(gate) * up of a gate|up weight; residual: the output is
        residual + x @ W.T. One row runs the GEMV, 2-8 rows kernels/fused_rows.py. Only where
        `fuses_rows` (`fuses_one_row` for one row) said so. rope (one row, where
        `carries_rope_store` said so): the q|k|v output comes rotated and K/V are stored."""
        _, gemv, _, fused_rows = _triton_kernels()
        fusion = gemv.RowFusion(None if norm is None else norm.weight,
                                0.0 if norm is None else norm.variance_epsilon, gated, residual)
        x = x.contiguous()
        if rope is not None:  # the GEMV, never the FP8 tensor-core kernel (carries_rope_store)
            assert x.shape[0] == 1, "rope rides on the one-row GEMV"
            if self.fp8 is None:
                return gemv.gemv(x, self.weight, self.bias, fusion=fusion, rope=rope)
            return gemv.fp8_gemv(x, self.weight, self.weight_scale, self.group_k, self.bias,
                                 fusion=fusion, rope=rope)
        if x.dim() == 2 and x.shape[0] > 1:
            n, k = self.weight.shape
            config = fused_rows.rows_config(n, k, x.shape[0], fusion.variant)
            assert config is not None, "fuses_rows promised a swept configuration"
            return fused_rows.fused_rows(x, self.weight, config, fusion, self.bias)
        if self.fp8 is None:
            return gemv.gemv(x, self.weight, self.bias, fusion=fusion)
        from radixserve.layers.kernels.fp8_gemm import fp8_rows_product
        y = fp8_rows_product(x.view(1, -1), self.weight, self.weight_scale, self.group_k,
                             self.bias, fusion)
        assert y is not None, "fuses_one_row promised an FP8 GEMV configuration"
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y


def _rank_and_size(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    group = get_tp_group()
    return (group.rank if tp_rank is None else tp_rank,
            group.size if tp_size is None else tp_size)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quantize: bool = True) -> None:
        super().__init__(input_size, output_size, bias, 0, 1, quantize)


class ColumnParallelLinear(LinearBase):
    """Output features split over the ranks (each rank loads its rows)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        tp_rank, tp_size = _rank_and_size(tp_rank, tp_size)
        if output_size % tp_size:
            raise ValueError(f"{output_size} output features do not split over {tp_size} ranks")
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def full_rows(self, shard_id: object = None) -> int:
        return self.output_size * self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        default_weight_loader(param, _shard(loaded, 0, self.tp_rank, self.tp_size))


class RowParallelLinear(LinearBase):
    """Input features split over the ranks (each rank loads its columns; the bias stays whole).
    The ranks' partial products are summed by an all-reduce, then the bias is added once.
    `reduce_results=False` leaves the partial product unreduced (no bias allowed), for a caller
    that adds several partial products and reduces once (an MoE block's shared expert)."""

    input_is_split = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None,
                 reduce_results: bool = True) -> None:
        tp_rank, tp_size = _rank_and_size(tp_rank, tp_size)
        if input_size % tp_size:
            raise ValueError(f"{input_size} input features do not split over {tp_size} ranks")
        if bias and not reduce_results:
            raise ValueError("an unreduced row-parallel layer cannot add a bias")
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        # 2-D: the weight's columns split, unless the parameter's own loader placed this
        # rank's columns already (`columns_placed`: an FP8 scale cut to the rank's groups by
        # fp8_linear.load_scale, or kept whole for one group per row; int4 scales kept whole
        # or regrouped by int4_linear.load_int4_tensor)
        if param.dim() == 2 and not getattr(param, "columns_placed", False):
            if self.fp8 is not None and self.fp8.online and param is self.weight \
                    and self.tp_size > 1:  # --quantization fp8 scales whole rows, as at tp 1
                self.checkpoint_row_amax = row_amax(loaded)
            loaded = _shard(loaded, 1, self.tp_rank, self.tp_size)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:
            return self.with_lora(x, self.product(x, self.bias))
        return self.reduce_partial(self.with_lora(x, self.product(x, None)))

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """This layer's output from this rank's product without its bias, computed elsewhere
        (a kernel that fuses the layer with its predecessor): the ranks' sum, plus the bias."""
        out = partial
        if self.tp_size > 1 and self.reduce_results:
            out = get_tp_group().all_reduce(partial)
        return out if self.bias is None else out + self.bias
