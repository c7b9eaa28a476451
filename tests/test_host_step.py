"""bullet-trt bench host-step (tools/bench/host_step.py): the baselines it times the current code
against stage and mask what the current code does, so that its ratios compare like with like."""
from __future__ import annotations

import json

import numpy as np
import torch

from bullet_trt.engine.graph_inputs import DecodeInputStaging
from bullet_trt.engine.sampling import _ban
from bullet_trt.tools.bench.host_step import BLOCK, MAX_BLOCKS, _Rows, ban_by_pairs, main, stage_from_scratch


def test_the_row_by_row_baseline_stages_what_the_staging_stages():
    rows = 12
    batch = _Rows(rows, seed=1)
    i64, i32 = np.zeros((3, rows), dtype=np.int64), np.zeros(rows + rows * MAX_BLOCKS, dtype=np.int32)
    staging = DecodeInputStaging(i64, i32, BLOCK, MAX_BLOCKS)
    b64, b32 = i64.copy(), i32.copy()
    for _ in range(40):
        token_ids, positions, tables = batch.step()
        staging.fill(token_ids, positions, tables, rows)
        stage_from_scratch(b64, b32, BLOCK, token_ids, positions, tables)
        assert (i64 == b64).all() and (i32[:rows] == b32[:rows]).all()
        mine, theirs = i32[rows:].reshape(rows, MAX_BLOCKS), b32[rows:].reshape(rows, MAX_BLOCKS)
        for row, table in enumerate(tables):
            assert (mine[row, :len(table)] == theirs[row, :len(table)]).all()


def test_the_pairwise_baseline_masks_what_the_grouped_mask_masks():
    banned = [[1, 0], [], [1, 0], [3], [0, 1, 1]]
    grouped, pairwise = torch.zeros(5, 8), torch.zeros(5, 8)
    _ban(grouped, banned)
    ban_by_pairs(pairwise, banned)
    assert torch.equal(grouped, pairwise) and torch.isinf(grouped).sum() == 7


def test_the_command_prints_and_writes_both_ratios(tmp_path, capsys):
    out = tmp_path / "host_step.json"
    assert main(["--rows", "64", "--steps", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "staging the inputs" in printed and "masking banned tokens" in printed
    assert "a mixed step's attention metadata (+ a 1024-token chunk)" in printed
    result = json.loads(out.read_text())
    assert result["rows"] == 64 and result["steps"] == 5
    assert result["staging_ratio"] > 0 and result["ban_ratio"] > 0 and result["metadata_ratio"] > 0
