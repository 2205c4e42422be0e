"""The decode-config pick of gpu_fp8.sh's attn_ab step, and the env override it feeds."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.decode_config_pick import config_label, pick  # noqa: E402

from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, default_decode_config)
from radixserve.attention.triton_backend import _decode_config_from_env  # noqa: E402

LOG = """\
decode bs=256  ctx=1536  splits=1* n32w1s5e           259.6 us   3.10 TB/s (73.0% of 4.25)
decode bs=862  ctx=1536  splits=1* n32w1s5e           873.4 us   3.10 TB/s (73.1% of 4.25)
decode bs=8    ctx=1536  splits=8* n64w2s3e            15.3 us   1.64 TB/s (38.6% of 4.25)
decode bs=8    ctx=1536  splits=8* n32w1s4e            19.8 us   1.27 TB/s (29.9% of 4.25)
decode bs=8    ctx=1536  splits=8* n16w1s6e            14.0 us   1.56 TB/s (36.8% of 4.25)
decode bs=862  ctx=1536  splits=1* n128w4s2e          840.0 us   3.20 TB/s (75.0% of 4.25)
decode bs=862  ctx=1536  splits=1* n64w2s4            800.0 us   3.40 TB/s (80.0% of 4.25)
decode bs=256  ctx=1536  splits=1* n64w2s3er168       250.0 us   3.20 TB/s
decode bs=862  ctx=1536  gather only h1 n64w2s3       683.0 us   3.97 TB/s (93.4% of 4.25)
decode bs=862  ctx=1536  splits=2 n32w2s3e            500.0 us   5.00 TB/s
""".splitlines()


def test_pick_the_fastest_planned_split_config_that_beats_the_default_enough() -> None:
    # the gather-only line and a non-planned split count (no '*') are not configs to pick
    assert pick(LOG, 862, 1.0) == "64,2,4,0,0,0,0"
    assert pick(LOG, 862, 0.92) == "64,2,4,0,0,0,0"  # 800 < 0.92 * 873.4
    assert pick(LOG, 862, 0.90) == ""  # not 10% faster
    assert pick(LOG, 256, 1.0) == "64,2,3,1,168,0,0"  # a register cap
    assert pick(LOG, 256, 0.95) == ""
    assert pick(LOG, 1, 1.0) == ""  # no lines for that batch
    # several splits: the default is the two-warp config, which a one-warp one beats by 8.5%
    assert pick(LOG, 8, 0.95) == "16,1,6,1,0,0,0"
    assert pick(LOG, 8, 0.90) == ""


def test_labels_are_what_the_pick_reads() -> None:
    config = DecodeKernelConfig(32, 1, 4, True, 168)
    line = f"decode bs=862  ctx=1536  splits=1* {config_label(config):<24} 1.0 us"
    assert pick(LOG + [line], 862, 1.0) == "32,1,4,1,168,0,0"
    assert config_label(DecodeKernelConfig(early_v=True)) == "n64w2s3e"
    lazy = DecodeKernelConfig(32, 1, 5, True, 0, True)
    line = f"decode bs=862  ctx=1536  splits=1* {config_label(lazy):<24} 0.5 us"
    assert config_label(lazy) == "n32w1s5el"
    assert pick(LOG + [line], 862, 1.0) == "32,1,5,1,0,1,0"
    both = DecodeKernelConfig(64, 2, 3, False, 0, True, True)
    assert config_label(both) == "n64w2s3lk"
    line = f"decode bs=862  ctx=1536  splits=1* {config_label(both):<24} 0.4 us"
    assert pick(LOG + [line], 862, 1.0) == "64,2,3,0,0,1,1"


def test_decode_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXSERVE_DECODE_CONFIG", raising=False)
    assert _decode_config_from_env() is None  # the per-pool, per-split default
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "128,4,2,0")
    assert _decode_config_from_env() == DecodeKernelConfig(128, 4, 2, False)
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "64,2,3,1,168,0")
    assert _decode_config_from_env() == DecodeKernelConfig(64, 2, 3, True, 168)
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "32,1,5,1,0,1")
    assert _decode_config_from_env() == DecodeKernelConfig(32, 1, 5, True, 0, True)
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "64,2,3,0,0,1,1")
    assert _decode_config_from_env() == DecodeKernelConfig(64, 2, 3, False, 0, True, True)


def test_fp8_default_depends_on_the_split_plan() -> None:
    one_split = default_decode_config(torch.float8_e4m3fn, 1)
    assert (one_split.num_warps, one_split.block_n, one_split.num_stages, one_split.early_v) \
        == (1, 32, 5, True)
    split = default_decode_config(torch.float8_e4m3fn, 8)
    assert (split.num_warps, split.block_n, split.early_v) == (2, 64, True)
    assert default_decode_config(torch.bfloat16, 1) == DecodeKernelConfig()
    assert default_decode_config(torch.bfloat16, 8) == DecodeKernelConfig(lazy_rescale=True)
    assert not split.lazy_rescale and not one_split.lazy_rescale
