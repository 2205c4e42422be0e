"""Per-board kernel tables (kernels/board_tables.py, through gemm_tables.py and fused_moe.py): a
board reads its own file where it has one, else the reference board's; a sweep on another board
writes only that board's files."""
from __future__ import annotations

import json

import pytest

from radixserve.layers.kernels import board_tables, gemm_tables

H100 = "NVIDIA_H100_80GB_HBM3"


def _write(path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))


def test_the_reference_board_and_no_device_read_the_folder_itself(table_dir, as_board) -> None:
    _write(table_dir / "fp8_N64_K256.json", {"1": {"block_n": 4}})
    _write(table_dir / "boards" / H100 / "fp8_N64_K256.json", {"1": {"block_n": 8}})
    for board in (None, gemm_tables.REFERENCE_BOARD):
        as_board(board)
        assert gemm_tables.board_dir() == table_dir
        assert gemm_tables.tuned_entry("fp8", 64, 256, 1) == {"block_n": 4}


def test_another_board_reads_its_own_file_first(table_dir, as_board) -> None:
    _write(table_dir / "fp8_N64_K256.json", {"1": {"block_n": 4}})
    _write(table_dir / "fp8_N32_K256.json", {"1": {"block_n": 2}})
    _write(table_dir / "boards" / H100 / "fp8_N64_K256.json", {"1": {"block_n": 8}})
    as_board(H100)
    assert gemm_tables.tuned_entry("fp8", 64, 256, 1) == {"block_n": 8}
    assert gemm_tables.tuned_entry("fp8", 32, 256, 1) == {"block_n": 2}  # the reference's
    assert gemm_tables.tuned_entry("fp8", 16, 256, 1) is None  # nobody swept it
    as_board("NVIDIA_A100_SXM4_80GB")  # no tables of its own: the reference's
    assert gemm_tables.tuned_entry("fp8", 64, 256, 1) == {"block_n": 4}


def test_a_sweep_on_another_board_leaves_the_reference_alone(table_dir, as_board) -> None:
    reference = {"1": {"block_n": 4}, "8": {"kernel": "cublas"}}
    _write(table_dir / "bf16_N64_K256.json", reference)
    as_board(H100)
    path = gemm_tables.writable_table("bf16", 64, 256)
    assert path == table_dir / "boards" / H100 / "bf16_N64_K256.json"
    assert json.loads(path.read_text()) == reference  # seeded: the unswept entries stay
    _write(path, {"1": {"block_n": 16}, "8": {"kernel": "cublas"}})
    assert json.loads((table_dir / "bf16_N64_K256.json").read_text()) == reference
    fresh = gemm_tables.writable_table("bf16", 32, 256)  # no reference file: nothing to seed
    assert not fresh.exists() and fresh.parent == path.parent
    assert gemm_tables.shipped_boards() == [gemm_tables.REFERENCE_BOARD, H100]
    as_board(gemm_tables.REFERENCE_BOARD)
    assert gemm_tables.writable_table("bf16", 64, 256) == table_dir / "bf16_N64_K256.json"


def test_board_names_are_the_device_name_made_path_safe(monkeypatch) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    board_tables.current_board.cache_clear()
    try:
        assert gemm_tables.board() == H100
    finally:
        board_tables.current_board.cache_clear()


def test_the_moe_tables_are_per_board_too(tmp_path, monkeypatch) -> None:
    pytest.importorskip("triton")
    from radixserve.layers.kernels import fused_moe
    reference = {"16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                            num_stages=4)}
    _write(tmp_path / "E8_N64_K32.json", reference)
    _write(tmp_path / "boards" / H100 / "E8_N64_K32.json",
           {"16": dict(reference["16"], BLOCK_N=128)})
    monkeypatch.setattr(fused_moe, "CONFIG_DIR", tmp_path)
    for board, block_n in ((None, 64), (H100, 128), ("NVIDIA_A100_SXM4_80GB", 64)):
        monkeypatch.setattr(board_tables, "current_board", lambda board=board: board)
        fused_moe._tuned_table.cache_clear()
        assert fused_moe.moe_kernel_config(16, 8, 64, 32)["BLOCK_N"] == block_n, board
    fused_moe._tuned_table.cache_clear()


def test_the_shipped_boards_have_folders_of_tables() -> None:
    for board in gemm_tables.shipped_boards()[1:]:
        assert sorted(gemm_tables.board_dir(board).glob("*_N*_K*.json")), board
