"""The decode-config pick of gpu_fp8.sh's attn_ab step, and the env override it feeds."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.decode_config_pick import config_label, pick  # noqa: E402
from radixserve.attention.kernels.decode_attention import DecodeKernelConfig  # noqa: E402
from radixserve.attention.triton_backend import _decode_config_from_env  # noqa: E402

LOG = """\
decode bs=256  ctx=1536  splits=1* n64w2s3e           259.6 us   3.10 TB/s (73.0% of 4.25)
decode bs=862  ctx=1536  splits=1* n64w2s3e           873.4 us   3.10 TB/s (73.1% of 4.25)
decode bs=862  ctx=1536  splits=1* n128w4s2e          840.0 us   3.20 TB/s (75.0% of 4.25)
decode bs=862  ctx=1536  splits=1* n64w2s4            800.0 us   3.40 TB/s (80.0% of 4.25)
decode bs=256  ctx=1536  splits=1* n64w2s3er168       250.0 us   3.20 TB/s
decode bs=862  ctx=1536  gather only h1 n64w2s3       683.0 us   3.97 TB/s (93.4% of 4.25)
decode bs=862  ctx=1536  splits=2 n32w2s3e            500.0 us   5.00 TB/s
""".splitlines()


def test_pick_the_fastest_planned_split_config_that_beats_the_default_enough() -> None:
    # the gather-only line and a non-planned split count (no '*') are not configs to pick
    assert pick(LOG, 862, 1.0) == "64,2,4,0,0"
    assert pick(LOG, 862, 0.92) == "64,2,4,0,0"  # 800 < 0.92 * 873.4
    assert pick(LOG, 862, 0.90) == ""  # not 10% faster
    assert pick(LOG, 256, 1.0) == "64,2,3,1,168"  # a register cap
    assert pick(LOG, 256, 0.95) == ""
    assert pick(LOG, 1, 1.0) == ""  # no lines for that batch


def test_labels_are_what_the_pick_reads() -> None:
    config = DecodeKernelConfig(32, 1, 4, True, 168)
    line = f"decode bs=862  ctx=1536  splits=1* {config_label(config):<24} 1.0 us"
    assert pick(LOG + [line], 862, 1.0) == "32,1,4,1,168"
    assert config_label(DecodeKernelConfig(early_v=True)) == "n64w2s3e"


def test_decode_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    default = DecodeKernelConfig(early_v=True)
    monkeypatch.delenv("RADIXSERVE_DECODE_CONFIG", raising=False)
    assert _decode_config_from_env(default) is default
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "128,4,2,0")
    assert _decode_config_from_env(default) == DecodeKernelConfig(128, 4, 2, False)
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "64,2,3,1,168")
    assert _decode_config_from_env(default) == DecodeKernelConfig(64, 2, 3, True, 168)
