"""Per-GPU calibrations: an engine directory keeps one performance-model calibration per GPU
model and a server takes its own GPU's, never another GPU's (an H100 was once served with
the H200's figures). The measurement itself needs a GPU: tests/gpu/test_calibration_on_start.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from bullet_trt.config import EngineConfig, apply_overrides
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.serving.calibrate_on_start import calibration_overrides, needs_calibration
from bullet_trt.serving.device_sizing import GRAPH_BUCKETS, MAX_DECODE_ROWS
from bullet_trt.kernels import moe_tiles
from bullet_trt.spatial.calibration_store import (CalibrationKey, calibration_file, find_calibration, load_perf_model,
                                                 moe_tiles_of)
from bullet_trt.spatial.perf_model import ModelCost, PerfModel
from bullet_trt.spatial.step_code import code_digest, code_text, step_code

H200_CALIBRATION = Path(__file__).resolve().parents[1] / "docs/data/perf_model_h200_llama-3.1-8b.yaml"
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
COST = ModelCost.from_arch(ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"]), 2)


def copy_as_if_timed_now(stored: Path, target: Path) -> None:
    """A stored calibration as if measured on this tree's step code, so that a test of another
    staleness sees only its own."""
    data = yaml.safe_load(stored.read_text())
    data["calibration"]["step_code"] = step_code()
    target.write_text(yaml.safe_dump(data))


def test_each_gpu_gets_its_own_file_name():
    assert calibration_file("e", H100) == Path("e/perf_model.nvidia-h100-80gb-hbm3.yaml")
    assert calibration_file("e", H200) == Path("e/perf_model.nvidia-h200.yaml")


def test_a_calibration_measured_on_another_gpu_is_not_used(tmp_path):
    shutil.copy(H200_CALIBRATION, tmp_path / "perf_model.yaml")
    on_h200, note200 = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132))
    on_h100, note100 = load_perf_model(tmp_path, COST, CalibrationKey(H100, 132))
    measured = yaml.safe_load(H200_CALIBRATION.read_text())["coeffs"]
    assert on_h200.coeffs.bw_max_gbs == measured["bw_max_gbs"] and "NVIDIA H200" in note200
    assert on_h100.coeffs == PerfModel.default(COST, 132, on_gpu=True).coeffs
    assert H100 in note100 and "measured on NVIDIA H200" in note100 and "uncalibrated" in note100


def test_the_gpus_own_file_wins_and_the_plain_file_serves_its_gpu_only(tmp_path):
    shutil.copy(H200_CALIBRATION, tmp_path / "perf_model.yaml")
    own = yaml.safe_load(H200_CALIBRATION.read_text())
    own["coeffs"]["bw_max_gbs"] = 2900.0
    own["calibration"]["gpu"] = H100
    calibration_file(tmp_path, H100).write_text(yaml.safe_dump(own))
    assert find_calibration(tmp_path, CalibrationKey(H100, 132)).path == calibration_file(tmp_path, H100)
    assert load_perf_model(tmp_path, COST, CalibrationKey(H100, 132))[0].coeffs.bw_max_gbs == 2900.0
    assert find_calibration(tmp_path, CalibrationKey(H200, 132)).path == tmp_path / "perf_model.yaml"


def test_a_hand_written_calibration_naming_no_gpu_is_used_and_a_different_sm_count_is_not(tmp_path):
    hand = yaml.safe_load(H200_CALIBRATION.read_text())
    del hand["calibration"]
    (tmp_path / "perf_model.yaml").write_text(yaml.safe_dump(hand))
    assert find_calibration(tmp_path, CalibrationKey(H100, 132)).path == tmp_path / "perf_model.yaml"
    smaller = find_calibration(tmp_path, CalibrationKey(H100, 66))  # a MIG slice of the same GPU model
    assert smaller.path is None and "66 SMs" in smaller.note


def test_the_cpu_uses_its_defaults_and_never_calibrates(tmp_path):
    shutil.copy(H200_CALIBRATION, tmp_path / "perf_model.yaml")
    perf, note = load_perf_model(tmp_path, COST, None, cpu_sms=2)
    assert perf.coeffs == PerfModel.default(COST, 2, on_gpu=False).coeffs and note.startswith("CPU")
    cfg = EngineConfig(engine_dir=str(tmp_path), device="cpu")
    assert needs_calibration(cfg) is None
    assert needs_calibration(apply_overrides(cfg, {"serve.calibrate": "off"})) is None


def engine_of(tmp_path, preset: str, overrides: dict) -> EngineConfig:
    """An engine directory whose checkpoint is the preset's config.json alone."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(PRESETS[preset]))
    return apply_overrides(EngineConfig(engine_dir=str(tmp_path), checkpoint="ckpt"), overrides)


def test_the_measurement_covers_the_largest_sized_batch_and_keeps_the_users_overrides(tmp_path):
    cfg = engine_of(tmp_path, "llama-3.1-8b", {"kv.gpu_memory_fraction": "0.6", "decode.max_num_seqs": "256"})
    assert calibration_overrides(cfg) == {
        "decode.max_num_seqs": 256, "decode.max_num_batched_tokens": MAX_DECODE_ROWS,
        "decode.cuda_graph_batch_sizes": list(GRAPH_BUCKETS), "kv.gpu_memory_fraction": 0.6}


def test_an_moe_bullet_server_measures_its_prefill_through_the_graphs_sizing_gives_it(tmp_path):
    cfg = engine_of(tmp_path, "qwen3-30b-a3b", {"serve.mode": "bullet"})
    cfg.prefill.max_num_batched_tokens = 4096
    assert calibration_overrides(cfg)["prefill.piecewise_graph_tokens"] == [128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    cfg.serve.sizing = "engine"  # engine.yaml's values: no pieces unless it names them
    assert "prefill.piecewise_graph_tokens" not in calibration_overrides(cfg)


def test_a_chunked_server_measures_prefill_as_the_bullet_worker_runs_it(tmp_path):
    """Both modes' servers share an engine directory's calibration, and only the spatial modes
    read its prefill figures: a chunked server's own mixed-step buckets and chunk (which the
    H200's stored MoE calibrations recorded, 2026-11-28) would stand there for bullet's."""
    sets = {"serve.mode": "chunked", "serve.chunk_size": "1024",
            "prefill.piecewise_graph_tokens": "[128,256,512,768,1024]"}
    cfg = engine_of(tmp_path, "qwen3-30b-a3b", sets)
    cfg.prefill.max_num_batched_tokens = 4096
    overrides = calibration_overrides(cfg)
    assert overrides["prefill.piecewise_graph_tokens"] == [128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert "serve.chunk_size" not in overrides and overrides["serve.mode"] == "chunked"


def test_the_calibration_process_says_it_needs_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bullet_trt.spatial.calibrate", str(tmp_path)],
                          capture_output=True, text=True, env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""})
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr


def test_a_calibration_names_how_its_prefill_ran_when_the_prefill_worker_runs_otherwise(tmp_path):
    eager = calibration_file(tmp_path, H200)
    copy_as_if_timed_now(H200_CALIBRATION, eager)  # measured before calibrations recorded it: eager
    _, same = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132), prefill_graph_tokens=[])
    _, graphed = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132), prefill_graph_tokens=[128, 256, 2048])
    assert same == f"calibrated on {H200} ({eager.name})"
    assert "ran eagerly" in graphed and "through graphs of [128, 256, 2048] tokens" in graphed
    assert f"delete {eager.name}" in graphed
    data = yaml.safe_load(eager.read_text())
    data["calibration"]["prefill_graph_tokens"] = [128, 256, 2048]
    eager.write_text(yaml.safe_dump(data))
    _, now_same = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132), prefill_graph_tokens=[128, 256, 2048])
    _, now_eager = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132), prefill_graph_tokens=[])
    assert now_same == same
    assert "ran through graphs of [128, 256, 2048] tokens" in now_eager and "runs them eagerly" in now_eager
    _, other_buckets = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132), prefill_graph_tokens=[128, 1024, 2048])
    assert "[128, 256, 2048]" in other_buckets and "runs them through graphs of [128, 1024, 2048]" in other_buckets


MOE_ARCH = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
MOE_COST = ModelCost.from_arch(MOE_ARCH, 2)
H200_MOE_CALIBRATION = H200_CALIBRATION.with_name("perf_model_h200_qwen3-30b-a3b.yaml")


def test_a_dense_model_has_no_moe_tiles_and_an_moe_one_names_its_gpus_table():
    assert moe_tiles_of(ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"]), H200) is None
    on_h200 = moe_tiles_of(MOE_ARCH, H200)
    tables = moe_tiles.tables_of(H200, 128, 768, 2048, 8, "bfloat16")
    assert tables[None] == moe_tiles.table_name(H200, 128, 768, 2048, 8, "bfloat16")
    named = re.findall(r"(.+?\.json)#([0-9a-f]{12})(?:,|$)", on_h200)
    assert sorted(name for name, _ in named) == sorted(tables.values())  # the whole GPU's and every partition's
    assert moe_tiles_of(MOE_ARCH, "a GPU nobody tuned") == "untuned"


def test_an_moe_calibration_timed_on_other_tiles_is_stale_until_measured_again(tmp_path):
    stored = calibration_file(tmp_path, H200)
    data = yaml.safe_load(H200_MOE_CALIBRATION.read_text())
    del data["calibration"]["moe_tiles"]  # as calibrations measured before the tuned tables read
    data["calibration"]["step_code"] = step_code()
    stored.write_text(yaml.safe_dump(data))
    now = moe_tiles_of(MOE_ARCH, H200)
    found = find_calibration(tmp_path, CalibrationKey(H200, 132, now))
    assert found.path == stored and "tiles untuned" in found.stale and now in found.stale
    perf, note = load_perf_model(tmp_path, MOE_COST, CalibrationKey(H200, 132, now))
    measured = yaml.safe_load(H200_MOE_CALIBRATION.read_text())["coeffs"]
    assert perf.coeffs.expert_tflops == measured["expert_tflops"]  # still served, and said to be stale
    assert "stale" in note and "serve.calibrate=auto" in note
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, "untuned")).stale == ""  # on a GPU without a table
    data = yaml.safe_load(stored.read_text())
    data["calibration"]["moe_tiles"] = now  # as a calibration under the table records it
    stored.write_text(yaml.safe_dump(data))
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, now)).stale == ""
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, None)).stale == ""  # a dense model never asks


def test_a_saved_calibration_replaces_the_old_file_whole(tmp_path):
    path = calibration_file(tmp_path, H200)
    shutil.copy(H200_CALIBRATION, path)
    perf, _ = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132))
    perf.save(path, extra={"calibration": {"gpu": H200, "moe_tiles": "untuned"}})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no part file left behind
    assert yaml.safe_load(path.read_text())["calibration"]["moe_tiles"] == "untuned"


def test_quantized_experts_keep_their_own_calibration_beside_the_bf16_one(tmp_path):
    bf16, w8a8 = calibration_file(tmp_path, H200), calibration_file(tmp_path, H200, "fp8-w8a8")
    assert w8a8.name == "perf_model.nvidia-h200.fp8-w8a8.yaml" and bf16.name == "perf_model.nvidia-h200.yaml"
    shutil.copy(H200_MOE_CALIBRATION, bf16)
    tiles = moe_tiles_of(MOE_ARCH, H200, "fp8-w8a8")
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, tiles, "fp8-w8a8")).path is None  # the bf16 one is not its
    copy_as_if_timed_now(H200_MOE_CALIBRATION.with_name("perf_model_h200_qwen3-30b-a3b.fp8-w8a8.yaml"), w8a8)
    found = find_calibration(tmp_path, CalibrationKey(H200, 132, tiles, "fp8-w8a8"))
    assert found.path == w8a8 and found.stale == ""
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, moe_tiles_of(MOE_ARCH, H200))).path == bf16


def test_the_stored_moe_calibrations_timed_the_shipped_tables_of_their_experts():
    """Tuning one dtype's tiles (FP8's) leaves the other's calibration true; a table change
    that stales a stored calibration shows here, before a server measures again at start."""
    for quantization, stored in [("none", H200_MOE_CALIBRATION),
                                 ("fp8-w8a8", H200_MOE_CALIBRATION.with_name(
                                     "perf_model_h200_qwen3-30b-a3b.fp8-w8a8.yaml")),
                                 ("fp8-w8a8", H200_MOE_CALIBRATION.with_name(
                                     "perf_model_h200_qwen3-30b-a3b.fp8-w8a8.kv-fp8.yaml"))]:
        recorded = yaml.safe_load(stored.read_text())["calibration"]["moe_tiles"]
        assert recorded == moe_tiles_of(MOE_ARCH, H200, quantization), stored.name


def test_a_calibration_timed_on_other_step_code_is_stale_and_one_written_by_hand_is_not(tmp_path):
    """New kernels under the same tiles made Qwen3-30B-A3B's w8a8 decode step 1.14x faster and
    the stored calibration, still served, held bullet back (spatial/step_code.py)."""
    stored = calibration_file(tmp_path, H200)
    shutil.copy(H200_CALIBRATION, stored)  # measured before calibrations recorded their code
    found = find_calibration(tmp_path, CalibrationKey(H200, 132))
    assert "before calibrations recorded its code" in found.stale and step_code() in found.stale
    _, note = load_perf_model(tmp_path, COST, CalibrationKey(H200, 132))
    assert "stale" in note and "serve.calibrate=auto" in note
    data = yaml.safe_load(stored.read_text())
    data["calibration"]["step_code"] = "0123456789ab"
    stored.write_text(yaml.safe_dump(data))
    assert "timed step code 0123456789ab" in find_calibration(tmp_path, CalibrationKey(H200, 132)).stale
    data["calibration"]["step_code"] = step_code()
    stored.write_text(yaml.safe_dump(data))
    assert find_calibration(tmp_path, CalibrationKey(H200, 132)).stale == ""
    # an MoE server's stale note names both, the code and the tiles
    data["calibration"]["step_code"] = "0123456789ab"
    stored.write_text(yaml.safe_dump(data))
    both = find_calibration(tmp_path, CalibrationKey(H200, 132, moe_tiles_of(MOE_ARCH, H200))).stale
    assert "0123456789ab" in both and "tiles untuned" in both
    stored.unlink()
    hand = yaml.safe_load(H200_CALIBRATION.read_text())
    del hand["calibration"]
    (tmp_path / "perf_model.yaml").write_text(yaml.safe_dump(hand))
    assert find_calibration(tmp_path, CalibrationKey(H200, 132)).stale == ""


def test_the_step_code_digest_follows_code_and_not_comments_or_docstrings(tmp_path):
    kernel = tmp_path / "kernel.py"

    def digest(text: str) -> str:
        kernel.write_text(text)
        return code_digest([kernel], tmp_path)

    plain = digest('def step(x):\n    return x * 2\n')
    assert plain == digest('"""A module."""\n# why\ndef step(x):\n    """Doubles."""\n    return x * 2  # twice\n')
    assert plain != digest('def step(x):\n    return x * 3\n')
    assert plain != digest('def step(x):\n    return 2 * x\n')
    assert len(step_code()) == 12 and step_code() == step_code()


def test_the_step_code_is_the_text_without_comments_docstrings_and_blank_lines(tmp_path):
    """The text, not the parse: ast.dump's output changed with Python 3.12 and 3.13, and a digest
    taken under 3.11 differed from a GPU machine's 3.12 over the same files."""
    source = ('"""Module doc."""\n# a comment\nimport os  # why\n\n\nclass K:\n    """One line."""\n'
              '    def f(self, x):\n        """Doc\n        more."""\n        return f"{x}#"  # twice\n')
    assert code_text(source) == 'import os\nclass K:\n    def f(self, x):\n        return f"{x}#"'
    # ast's columns count UTF-8 bytes, tokenize's and str's characters
    assert code_text('def f():\n    """µ doc µ"""; x = "é"  # c µ\n    return x\n') == 'def f():\n    ; x = "é"\n    return x'
    (tmp_path / "kernel.py").write_text(source)
    # pinned: the same under every Python version (checked under 3.10-3.13 when it was written)
    assert code_digest([tmp_path / "kernel.py"], tmp_path) == "5b4bbebea4cd"


def test_an_fp8_kv_pool_keeps_its_own_calibration_beside_the_bf16_pools(tmp_path):
    """Attention over an FP8 pool runs other kernels (kernels/fp8_kv.py): a calibration timed over
    a bf16 pool is not an FP8-pool server's, nor the other way round."""
    tiles = moe_tiles_of(MOE_ARCH, H200, "fp8-w8a8")
    bf16_pool = calibration_file(tmp_path, H200, "fp8-w8a8")
    fp8_pool = calibration_file(tmp_path, H200, "fp8-w8a8", "fp8")
    assert fp8_pool.name == "perf_model.nvidia-h200.fp8-w8a8.kv-fp8.yaml"
    assert calibration_file(tmp_path, H200, kv_cache_dtype="fp8").name == "perf_model.nvidia-h200.kv-fp8.yaml"
    copy_as_if_timed_now(H200_MOE_CALIBRATION.with_name("perf_model_h200_qwen3-30b-a3b.fp8-w8a8.yaml"), bf16_pool)
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, tiles, "fp8-w8a8", "fp8")).path is None  # it measures its own
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, tiles, "fp8-w8a8")).path == bf16_pool
    perf, note = load_perf_model(tmp_path, MOE_COST, CalibrationKey(H200, 132, tiles, "fp8-w8a8", "fp8"))
    assert "no calibration" in note and "uncalibrated defaults" in note
    shutil.copy(bf16_pool, fp8_pool)
    assert find_calibration(tmp_path, CalibrationKey(H200, 132, tiles, "fp8-w8a8", "fp8")).path == fp8_pool


def test_a_server_s_key_names_its_experts_tiles_and_pool_from_its_settings(tmp_path):
    """Every reader and writer of a calibration (the scheduler, sizing, calibration at start, the
    calibration itself) builds its key from the server's settings the same way."""
    w8a8_fp8_pool = apply_overrides(EngineConfig(engine_dir=str(tmp_path)),
                                    {"quantization": "fp8-w8a8", "kv.cache_dtype": "fp8"})
    key = CalibrationKey.for_server(w8a8_fp8_pool, MOE_ARCH, H200, 132, "bfloat16")
    assert key == CalibrationKey(H200, 132, moe_tiles_of(MOE_ARCH, H200, "fp8-w8a8"), "fp8-w8a8", "fp8")
    assert key.file(tmp_path) == calibration_file(tmp_path, H200, "fp8-w8a8", "fp8")
    assert key.profile(tmp_path).name == "perf_profile.nvidia-h200.fp8-w8a8.kv-fp8.json"
    dense = CalibrationKey.for_server(EngineConfig(engine_dir=str(tmp_path)), ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"]),
                                      H100, 132, "bfloat16")
    assert dense == CalibrationKey(H100, 132) and dense.file(tmp_path) == calibration_file(tmp_path, H100)
