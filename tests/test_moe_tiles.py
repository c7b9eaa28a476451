"""The fused MoE kernels' tuned tile tables: naming, checking, lookup, and the tuner's merge of
its shards into a table the kernels read back. The kernels' results with every table's tiles
are tests/gpu/test_fused_moe.py's."""
from __future__ import annotations

import functools
import json

import pytest

from bullet_trt.kernels import moe_tiles
from bullet_trt.tools.bench import moe_tune

SMALL = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
MID = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
LARGE = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
LAYER = {"experts": 128, "inter": 768, "hidden": 2048, "top_k": 8, "dtype": "bfloat16"}


def test_table_name_joins_the_device_name_and_the_layer_shape():
    assert (moe_tiles.table_name("NVIDIA H200", 128, 768, 2048, 8, "bfloat16")
            == "E=128,N=768,H=2048,top_k=8,dtype=bfloat16,device=NVIDIA_H200.json")


@pytest.mark.parametrize("tile, field", [({**SMALL, "BLOCK_N": 48}, "BLOCK_N"), ({**SMALL, "BLOCK_M": 8}, "BLOCK_M"),
                                         ({k: v for k, v in SMALL.items() if k != "num_warps"}, "num_warps")])
def test_a_bad_tile_is_refused_naming_its_field(tile, field):
    with pytest.raises(ValueError, match=field):
        moe_tiles.check_tile(tile, "t")


def test_the_nearest_row_gives_the_tile_and_a_tie_takes_the_smaller():
    table = moe_tiles.parse_table({"rows": [{"tokens": 256, "tile": MID}, {"tokens": 1, "tile": SMALL},
                                            {"tokens": 4096, "tile": LARGE}]}, "t")
    assert [tokens for tokens, _ in table] == [1, 256, 4096]
    assert moe_tiles.tile_for(table, 1) == SMALL
    assert moe_tiles.tile_for(table, 128) == SMALL  # 127 from 1, 128 from 256
    assert moe_tiles.tile_for(table, 384) == MID
    assert moe_tiles.tile_for(table, 2176) == MID  # 1920 from 256, 1920 from 4096: the smaller
    assert moe_tiles.tile_for(table, 100000) == LARGE


def test_a_table_without_rows_or_with_a_bad_count_is_refused():
    with pytest.raises(ValueError, match="rows"):
        moe_tiles.parse_table({"rows": []}, "t")
    with pytest.raises(ValueError, match=r"rows\[0\].tokens"):
        moe_tiles.parse_table({"rows": [{"tokens": 0, "tile": SMALL}]}, "t")


def test_best_rows_take_the_fastest_tile_that_ran_with_the_untuned_time_beside_it():
    timings = [{"tokens": 64, "tile": SMALL, "ms": 0.30}, {"tokens": 64, "tile": MID, "ms": 0.20},
               {"tokens": 64, "tile": LARGE, "error": "out of resource: shared memory"},
               {"tokens": 4096, "tile": LARGE, "ms": 1.0}, {"tokens": 4096, "tile": MID, "ms": 1.5}]
    rows = moe_tiles.best_rows(timings, {64: SMALL, 4096: LARGE})
    assert rows == [{"tokens": 64, "tile": MID, "ms": 0.20, "untuned_ms": 0.30},
                    {"tokens": 4096, "tile": LARGE, "ms": 1.0, "untuned_ms": 1.0}]


def test_the_tile_space_is_split_into_disjoint_shards_that_cover_it():
    space = moe_tune.tile_space()
    keys = [json.dumps(t, sort_keys=True) for t in space]
    assert len(set(keys)) == len(space) == 192
    shards = [space[i::4] for i in range(4)]
    assert sorted(json.dumps(t, sort_keys=True) for s in shards for t in s) == sorted(keys)
    for t in space:
        moe_tiles.check_tile(t, "space")
    with pytest.raises(SystemExit, match="--shard"):
        moe_tune.parse_shard("4/4")


def part(device, timings, untuned):
    return {"device": device, "layer": LAYER, "tuned_on": "2026-11-28", "timings": timings,
            "untuned": {str(k): v for k, v in untuned.items()}}


def test_merged_shards_write_a_table_the_kernels_read_back(tmp_path):
    a = part("NVIDIA H200", [{"tokens": 384, "tile": SMALL, "ms": 0.9}, {"tokens": 8192, "tile": SMALL, "ms": 9.0}],
             {384: SMALL, 8192: LARGE})
    b = part("NVIDIA H200", [{"tokens": 384, "tile": MID, "ms": 0.5}, {"tokens": 8192, "tile": LARGE, "ms": 3.0}],
             {384: SMALL, 8192: LARGE})
    table = moe_tune.merge([a, b])
    assert table["tiles_timed"] == 3
    path = moe_tune.write_table(table, str(tmp_path))
    assert path.name == moe_tiles.table_name("NVIDIA H200", 128, 768, 2048, 8, "bfloat16")
    read = moe_tiles.load_table(path.name, tmp_path)
    assert read == ((384, MID), (8192, LARGE))
    assert json.loads(path.read_text())["rows"][0]["untuned_ms"] == 0.9
    assert moe_tiles.load_table("E=1,N=1,H=1,top_k=1,dtype=bfloat16,device=none.json", tmp_path) is None


def test_a_partitions_shards_write_its_own_table_with_the_gain_over_the_tile_before(tmp_path):
    timings = [{"tokens": 384, "tile": SMALL, "ms": 0.9}, {"tokens": 384, "tile": MID, "ms": 0.6},
               {"tokens": 384, "tile": LARGE, "ms": 0.5}]
    shard = {**part("NVIDIA H200", timings, {384: SMALL}), "sms": 68, "before": {"384": MID}}
    table = moe_tune.merge([shard])
    assert table["sms"] == 68
    assert table["rows"] == [{"tokens": 384, "tile": LARGE, "ms": 0.5, "untuned_ms": 0.9, "before_ms": 0.6}]
    path = moe_tune.write_table(table, str(tmp_path))
    assert path.name == "E=128,N=768,H=2048,top_k=8,dtype=bfloat16,device=NVIDIA_H200,sms=68.json"
    assert "on 68 SMs" in moe_tune.markdown(table) and "| 1.20x |" in moe_tune.markdown(table)
    with pytest.raises(SystemExit, match="differ in sms"):
        moe_tune.merge([shard, part("NVIDIA H200", timings, {384: SMALL})])


def write(tables_dir, name, rows=((1, SMALL),)):
    (tables_dir / name).write_text(json.dumps({"rows": [{"tokens": t, "tile": tile} for t, tile in rows]}))


def test_a_gpus_tables_are_found_by_the_sm_count_they_were_tuned_on(tmp_path):
    name = functools.partial(moe_tiles.table_name, "NVIDIA H200", 128, 768, 2048, 8)
    for table in (name("bfloat16"), name("bfloat16", 68), name("bfloat16", 100), name("float16", 52),
                  name("bfloat16").replace("H200", "H200_NVL"), name("bfloat16", 84).replace("E=128", "E=64")):
        write(tmp_path, table)
    found = moe_tiles.tables_of("NVIDIA H200", 128, 768, 2048, 8, "bfloat16", tmp_path)
    assert found == {None: name("bfloat16"), 68: name("bfloat16", 68), 100: name("bfloat16", 100)}
    assert moe_tiles.tables_of("NVIDIA H100 80GB HBM3", 128, 768, 2048, 8, "bfloat16", tmp_path) == {}


@pytest.mark.parametrize("sms, tuned_on", [(68, 68), (72, 68), (84, 100), (116, None), (132, None), (12, 68)])
def test_kernels_on_a_partition_take_the_table_tuned_nearest_its_sm_count(sms, tuned_on):
    # 84 lies as near 68 as 100: the larger partition's tiles fill its SMs no worse
    assert moe_tiles.nearest_sms([None, 68, 100], sms, 132) == tuned_on
    assert moe_tiles.nearest_sms([None], 12, 132) is None


def test_a_partitions_table_serves_only_the_token_counts_it_was_tuned_on():
    whole = ((1, SMALL), (8192, LARGE))
    decode_68 = ((64, MID), (768, MID))
    tables = {None: whole, 68: decode_68}
    assert moe_tiles.table_for(tables, 68, 132, 384) is decode_68
    assert moe_tiles.table_for(tables, 68, 132, 4096) is whole  # a prefill step on 68 SMs
    assert moe_tiles.table_for(tables, 68, 132, 16) is whole
    assert moe_tiles.table_for(tables, 124, 132, 384) is whole
    assert moe_tiles.table_for({68: decode_68}, 68, 132, 4096) is decode_68  # nothing else to take


def test_the_fingerprint_names_every_partitions_table_and_only_this_gpus_and_dtypes(tmp_path):
    name = functools.partial(moe_tiles.table_name, "NVIDIA H200", 128, 768, 2048, 8, "bfloat16")
    fingerprint = functools.partial(moe_tiles.fingerprint, "NVIDIA H200", 128, 768, 2048, 8, "bfloat16",
                                    tables_dir=tmp_path)
    write(tmp_path, name())
    write(tmp_path, name().replace("H200", "H200_NVL"))
    whole = fingerprint()
    assert whole.startswith(name() + "#") and whole.count(".json#") == 1  # not the H200 NVL's
    write(tmp_path, name(68), ((1, MID),))
    with_partition = fingerprint()
    assert with_partition.count(".json#") == 2 and whole in with_partition  # a calibration goes stale
    assert f"{name(68)}#" in with_partition
    # FP8 experts' tables are other kernels': tuning them leaves the bf16 calibration true
    for dtype in ("float8_e4m3fn", "float8_e4m3fn_w8a8"):
        write(tmp_path, moe_tiles.table_name("NVIDIA H200", 128, 768, 2048, 8, dtype))
    assert fingerprint() == with_partition
    w8a8 = moe_tiles.fingerprint("NVIDIA H200", 128, 768, 2048, 8, "float8_e4m3fn_w8a8", tmp_path)
    assert w8a8.count(".json#") == 1 and "dtype=float8_e4m3fn_w8a8," in w8a8


def test_shards_of_different_gpus_are_not_merged():
    with pytest.raises(SystemExit, match="device"):
        moe_tune.merge([part("NVIDIA H200", [], {}), part("NVIDIA H100 80GB HBM3", [], {})])


@pytest.mark.parametrize("path", sorted(moe_tiles.TABLES_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_table_is_named_by_what_it_holds(path):
    data = json.loads(path.read_text())
    layer = data["layer"]
    assert path.name == moe_tiles.table_name(data["device"], layer["experts"], layer["inter"], layer["hidden"],
                                             layer["top_k"], layer["dtype"], data.get("sms"))
    table = moe_tiles.parse_table(data, path.name)
    if data.get("sms") is None:
        # the whole GPU's table serves every call, a call below its first row with that row's
        # tile: bf16's starts at 1 token, FP8's at serving's batches (64 and 256 rows)
        assert table[0][0] <= 256 and table[-1][0] >= 4096
    else:  # a partition's serves only the calls its rows span (table_for), decode's at the least
        assert table[0][0] <= 64 and table[-1][0] >= 512


def test_the_benches_take_an_moe_preset_and_refuse_others_naming_the_flag():
    from bullet_trt.tools.bench.moe_bench import moe_arch

    assert moe_arch("qwen3-30b-a3b").num_experts == 128
    with pytest.raises(SystemExit, match="--arch llama-3.1-8b has no MoE layers"):
        moe_arch("llama-3.1-8b")
    with pytest.raises(SystemExit, match="--arch must be one of"):
        moe_arch("no-such-model")


def test_fp8_experts_have_a_table_of_their_own(tmp_path):
    """A table tuned with FP8 experts (bench moe-tune --fp8-experts) is found by FP8 weights' lookup
    only: the bf16 experts' kernels keep theirs, and the other way round."""
    fp8_layer = {**LAYER, "dtype": "float8_e4m3fn"}
    assert moe_tune.layer_shape(type("A", (), dict(num_experts=128, moe_intermediate_size=768, hidden_size=2048,
                                                    num_experts_per_tok=8)), fp8=True) == fp8_layer
    table = moe_tune.merge([{**part("NVIDIA H200", [{"tokens": 512, "tile": MID, "ms": 0.3}], {512: SMALL}),
                             "layer": fp8_layer}])
    path = moe_tune.write_table(table, str(tmp_path))
    assert path.name == "E=128,N=768,H=2048,top_k=8,dtype=float8_e4m3fn,device=NVIDIA_H200.json"
    assert moe_tiles.tables_of("NVIDIA H200", 128, 768, 2048, 8, "float8_e4m3fn", tmp_path) == {None: path.name}
    assert moe_tiles.tables_of("NVIDIA H200", 128, 768, 2048, 8, "bfloat16", tmp_path) == {}


def test_the_swapped_form_is_kept_in_a_table_and_searched_for_fp8_only():
    assert moe_tiles.check_tile({**SMALL, "SWAP_AB": 1}, "t") == {**SMALL, "SWAP_AB": 1}
    assert moe_tiles.check_tile({**SMALL, "SWAP_AB": 0}, "t") == SMALL
    with pytest.raises(ValueError, match="SWAP_AB"):
        moe_tiles.check_tile({**SMALL, "SWAP_AB": 2}, "t")
    plain, both = moe_tune.tile_space(), moe_tune.tile_space(swapped=True)
    assert len(both) == 2 * len(plain) and sum("SWAP_AB" in t for t in both) == len(plain)


def test_fp8_activations_tune_a_table_apart_from_fp8_weights_alone():
    assert moe_tiles.dtype_label("float8_e4m3fn", fp8_activations=True) == "float8_e4m3fn_w8a8"
    assert moe_tiles.dtype_label("bfloat16") == "bfloat16"
    arch = type("A", (), dict(num_experts=128, moe_intermediate_size=768, hidden_size=2048, num_experts_per_tok=8))
    assert moe_tune.layer_shape(arch, fp8_activations=True)["dtype"] == "float8_e4m3fn_w8a8"
    assert moe_tune.layer_shape(arch, fp8=True)["dtype"] == "float8_e4m3fn"
