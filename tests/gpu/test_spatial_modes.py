"""The spatial modes end to end on a GPU: a prefill and a decode worker, both MPS clients, on
green-context partitions of one GPU, driven through the offline API.

Needs the MPS daemon that scripts/gpu_run.sh starts (the workers refuse to share the GPU
without it) and green contexts (CUDA 12.4+ driver, cuda.bindings). Asserts what ran, never
how long it took: the tokens against the chunked engine, every request's length, every KV
block back in the pool, and SM splits in the iteration log that the partitioner offers.
"""
from __future__ import annotations

import json
import random

import pytest

from bullet_trt import LLM, SamplingParams
from bullet_trt.tools.build import build_dummy_engine, build_from_checkpoint
from tests.checkpoints import VOCAB_SIZE


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_splits(records: list[dict], total: int, splits: list[int]) -> list[dict]:
    """The records that ran on a split (not the whole GPU); each must be a split on offer,
    prefill and decode holding complementary shares."""
    assert records, "the iteration log is empty"
    assert {r["phase"] for r in records} >= {"prefill", "decode"}, {r["phase"] for r in records}
    split = [r for r in records if 0 < r["prefill_sms"] < total]
    for r in split:
        assert r["prefill_sms"] in splits, (r, splits)
        assert r["decode_sms"] == total - r["prefill_sms"], r
        assert r["sms"] == (r["prefill_sms"] if r["phase"] == "prefill" else r["decode_sms"]), r
    for r in records:
        assert 0 < r["sms"] <= total, r
    check_gpu_clock(records)
    return split


def check_gpu_clock(records: list[dict]) -> None:
    """Every step carries its window on the GPU's clock (serve.iteration_log turns the stamps
    on); one worker's steps run one after the other, so its windows are ordered, and each lies
    inside the host's window of the same step (checked by length: the two clocks' epochs
    differ; 50 us of slack for the timer's update step)."""
    for r in records:
        assert 0 < r["gpu_start_ns"] < r["gpu_end_ns"], r
        assert r["gpu_end_ns"] - r["gpu_start_ns"] <= r["measured_ms"] * 1e6 + 50_000, r
    for phases in (("prefill",), ("decode", "fused")):
        mine = sorted((r for r in records if r["phase"] in phases), key=lambda r: r["gpu_start_ns"])
        for a, b in zip(mine, mine[1:]):
            assert b["gpu_start_ns"] >= a["gpu_end_ns"], (a, b)


@pytest.fixture(scope="module")
def tiny_engine(checkpoint, tmp_path_factory):
    # fp32: the spatial engine must reproduce the chunked engine's tokens exactly
    return build_from_checkpoint(checkpoint("llama"), tmp_path_factory.mktemp("tiny") / "engine",
                                 max_model_len=256, dtype="float32")


@pytest.mark.parametrize("mode", ["bullet", "static", "bullet-overlapped"])
def test_spatial_mode_on_green_partitions_matches_chunked(mps_daemon, tiny_engine, tmp_path, mode):
    """bullet-overlapped: bullet with each decode step launched before the last one's tokens
    reach the host, its input tokens fed on the device (decode.overlap_steps), through the
    decode graphs of every partition."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(9, 120))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(8, 40), temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)] * 6
    common = {"kv.num_blocks": 512}
    with LLM(str(tiny_engine), **{"serve.mode": "chunked", **common}) as llm:
        want = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
    log = tmp_path / "iterations.jsonl"
    spatial = {"serve.mode": mode.split("-")[0], "serve.partitioner": "green", "serve.iteration_log": str(log),
               "decode.overlap_steps": mode == "bullet-overlapped", **common}
    if mode == "static":
        spatial["serve.static_prefill_sms"] = 64
    with LLM(str(tiny_engine), **spatial) as llm:
        engine = llm.engine
        assert engine.prefill.partitions["name"] == "green" and engine.decode.partitions["name"] == "green"
        total, splits = engine.total_sms, list(engine.splits)
        got = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        stats = engine.stats()
    assert got == want
    assert stats.kv_blocks_free == stats.kv_blocks_total
    split = check_splits(read_log(log), total, splits)
    if mode == "static":
        assert splits == [64]
        # static: every iteration on the one split, decode included while nothing prefills
        assert len(split) == len(read_log(log))


def test_bullet_burst_on_a_dummy_8b_engine(mps_daemon, tmp_path):
    """The shape that matters (Llama-3.1-8B, bf16, random weights): a first wave of prompts,
    then a second wave once the first decodes. The second wave's prefills run beside decode,
    so the iteration log must show decode on the remainder of a split."""
    engine_dir = build_dummy_engine("llama-3.1-8b", tmp_path / "engine", 4096, seed=0)
    log = tmp_path / "iterations.jsonl"
    rng = random.Random(0)
    waves = []
    for wave in range(2):
        waves.append([(f"w{wave}-{i}", [rng.randrange(1000, 30000) for _ in range(rng.randint(200, 2000))],
                       rng.randint(64, 256)) for i in range(16)])
    overrides = {"serve.mode": "bullet", "serve.partitioner": "green", "serve.iteration_log": str(log),
                 # the workers' activations and graphs live beside the pool (an 80 GB GPU)
                 "kv.gpu_memory_fraction": 0.5}
    from bullet_trt.engine.request import NewRequest

    with LLM(str(engine_dir), **overrides) as llm:
        core = llm.engine
        total, splits = core.total_sms, list(core.splits)
        want = {rid: n for wave in waves for rid, _, n in wave}
        got: dict[str, int] = {}
        reasons: dict[str, str | None] = {}

        def add(wave):
            for rid, ids, n in wave:
                core.add_request(NewRequest(rid, ids, SamplingParams(max_tokens=n, temperature=0,
                                                                     ignore_eos=True)))

        add(waves[0])
        second_sent = False
        while core.has_unfinished() or not second_sent:
            for out in core.step():
                got[out.request_id] = got.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
            if not second_sent and any(n >= 2 for n in got.values()):
                add(waves[1])  # the first wave is decoding now
                second_sent = True
        stats = core.stats()
    assert got == want
    assert len(reasons) == len(want) and set(reasons.values()) == {"length"}
    assert stats.kv_blocks_free == stats.kv_blocks_total
    split = check_splits(read_log(log), total, splits)
    assert any(r["phase"] == "decode" for r in split), "decode never ran beside a prefill"
