"""`bullet-trt bench moe-tune --sms N` on a GPU: the tiles timed on a green-context partition,
the shard naming that partition's real SM count and the tile the kernels took there before, and
the merged table written under the partition's name, which the kernels then take when they
plan for that many SMs. Skipped without a GPU (tests/gpu/conftest.py)."""
from __future__ import annotations

import json

import torch

from bullet_trt.kernels import moe_tiles, sm_budget, triton_moe
from bullet_trt.tools.bench import moe_tune


def test_a_partitions_tiles_are_timed_on_it_and_its_table_is_the_one_its_kernels_take(tmp_path):
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = total - 24  # decode's side of the split that leaves prefill 24
    part = tmp_path / "part.json"
    # every 48th tile of the 192: four, at two decode row counts
    assert moe_tune.main(["--sms", str(sms), "--shard", "0/48", "--tokens", "64,256", "--json", str(part)]) == 0
    shard = json.loads(part.read_text())
    assert shard["sms"] == sms and sm_budget.get_num_sms() == total  # the budget is back to the whole GPU
    assert len(shard["timings"]) == 8 and all(t["ms"] > 0 for t in shard["timings"] if "ms" in t)
    assert set(shard["before"]) == {"64", "256"}
    table = moe_tune.merge([shard])
    path = moe_tune.write_table(table, str(tmp_path))
    assert path.name.endswith(f",sms={sms}.json")
    assert triton_moe.MOE_TILE_OVERRIDE is None
    layer = shard["layer"]
    tables = {k: moe_tiles.load_table(name, tmp_path) for k, name in moe_tiles.tables_of(
        shard["device"], layer["experts"], layer["inter"], layer["hidden"], layer["top_k"], layer["dtype"],
        tmp_path).items()}
    assert moe_tiles.table_for(tables, sms, total, 128) == moe_tiles.load_table(path.name, tmp_path)


def test_a_size_no_split_gives_is_refused_before_any_tile_runs():
    import pytest

    with pytest.raises(SystemExit, match="no partition"):
        moe_tune.main(["--sms", "3", "--tokens", "64"])
