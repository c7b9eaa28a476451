"""Chunked steps launched one ahead (engine/steps_ahead.py) against the plain chunked loop: the
same tokens, ends and log-probs whatever ends a request (an end id, a stop sequence, its
length, the model's length, an abort, a preemption), and every block back in the pool. A step's
decode rows take their input tokens on the device from the step before (the host holds a 0 in
their place), so a feed that missed a row would change its tokens."""
from __future__ import annotations

import pytest

from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.sequence import Sequence
from bullet_trt.serving.llm import LLM
from tests.test_engine import engine_dir_for, prompts

CHUNKED = {"serve.mode": "chunked", "serve.chunk_size": 16, "kv.block_size": 5}
AHEAD = {**CHUNKED, "decode.overlap_steps": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return str(engine_dir_for(tmp_path_factory, "llama")[0])


def run(engine: str, batch, params, **overrides):
    with LLM(engine, **overrides) as llm:
        assert (llm.engine.ahead is not None) == bool(overrides.get("decode.overlap_steps"))
        out = llm.generate_token_ids(batch, params)
        stats = llm.engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total  # every block back
        return [(c.token_ids, c.finish_reason, c.logprobs) for c in out], stats


def test_the_steps_launched_ahead_end_every_request_as_the_plain_loop_does(engine):
    batch = prompts(10, seed=21)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(engine, **CHUNKED) as llm:  # tokens greedy decoding reaches, to end requests on
        ref = [c.token_ids for c in llm.generate_token_ids(batch, greedy)]
    params = [
        greedy,
        SamplingParams(max_tokens=30, temperature=0.0, end_id=ref[1][6]),  # ends on an end id
        SamplingParams(max_tokens=30, temperature=0.0, end_id=ref[2][3], min_tokens=9),  # banned first
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[3][4:6]]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),  # its length, early
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.1, top_k=40, seed=8, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # ends with its prompt
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=True, end_id=ref[8][0]),  # ends at once
        SamplingParams(max_tokens=17, temperature=0.8, seed=9, ignore_eos=True),
    ]
    plain, _ = run(engine, batch, params, **CHUNKED)
    ahead, _ = run(engine, batch, params, **AHEAD)
    assert [(t, r) for t, r, _ in ahead] == [(t, r) for t, r, _ in plain]
    for (_, _, a), (_, _, b) in zip(ahead, plain):  # other batches around a row: other roundings
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-4))
    reasons = [r for _, r, _ in plain]
    assert reasons[1] == reasons[3] == reasons[8] == "stop" and reasons[4] == reasons[7] == "length"
    assert len(plain[1][0]) == ref[1].index(ref[1][6]) and plain[8][0] == []


def test_a_mixture_of_experts_model_launched_ahead_picks_the_plain_loops_tokens(tmp_path_factory):
    """Sizing leaves an MoE model's chunked steps in the plain loop until one is served launched
    ahead on a GPU; the loop itself must already give its tokens: routed rows fed on the device
    from the step in flight, greedy and sampled, every block back."""
    moe = str(engine_dir_for(tmp_path_factory, "qwen3_moe-mixed")[0])
    batch = prompts(8, seed=5)
    params = ([SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
              + [SamplingParams(max_tokens=20, temperature=0.9, seed=3 + i, ignore_eos=True) for i in range(4)])
    plain, _ = run(moe, batch, params, **CHUNKED)
    ahead, _ = run(moe, batch, params, **AHEAD)
    assert [(t, r) for t, r, _ in ahead] == [(t, r) for t, r, _ in plain]
    assert all(len(t) == 20 for t, _, _ in plain)


def test_a_dry_pool_preempts_under_the_steps_launched_ahead_as_without(engine):
    batch = prompts(12, seed=11)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    roomy, _ = run(engine, batch, greedy, **CHUNKED)
    tight, stats = run(engine, batch, greedy, **{**AHEAD, "kv.block_size": 16, "kv.num_blocks": 24})
    assert tight == roomy and stats.num_preemptions > 0


def test_the_model_length_ends_a_request_without_a_step_past_it(engine):
    ids = prompts(1, seed=5)[0]
    long = SamplingParams(max_tokens=255, temperature=0.0, ignore_eos=True)  # room for 255 - len(ids) only
    plain, _ = run(engine, [ids], long, **CHUNKED)
    ahead, _ = run(engine, [ids], long, **AHEAD)
    assert ahead == plain and plain[0][1] == "length" and len(ids) + len(plain[0][0]) == 256


def test_an_abort_while_a_step_is_in_flight_ends_only_that_request(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = prompts(3, seed=2)
    with LLM(engine, **AHEAD) as llm:
        core = llm.engine
        for i, ids in enumerate(batch):
            core.add_request(NewRequest(f"r{i}", ids, params))
        tokens = {f"r{i}": [] for i in range(3)}
        ends = {}
        steps = 0
        while core.has_unfinished():
            steps += 1
            if steps == 12:
                core.abort_request("r1")
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    ends[out.request_id] = out.finish_reason
        assert ends == {"r0": "length", "r1": "abort", "r2": "length"}
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
    plain, _ = run(engine, [batch[0], batch[2]], params, **CHUNKED)
    assert [tokens["r0"], tokens["r2"]] == [t for t, _, _ in plain]


def test_a_sequences_tokens_in_flight_count_in_its_length_and_read_as_zero():
    seq = Sequence("r", [5, 6, 7], SamplingParams())
    seq.output_token_ids = [8]
    seq.num_pending = 2
    assert seq.num_tokens == 6 and seq.num_outputs == 3
    assert seq.token_ids(2, 4) == [7, 8, 0, 0] and seq.token_ids(4, 1) == [0] and seq.token_ids(0, 2) == [5, 6]
    fresh = Sequence("f", [1, 2], SamplingParams())
    fresh.num_cached_tokens, fresh.num_pending = 2, 1
    assert not fresh.in_prefill  # its first token is in flight: it decodes next


def test_the_bench_runs_both_loops_over_one_load_and_compares_their_tokens(engine, tmp_path):
    import json

    from bullet_trt.tools.bench.steps_ahead import main

    out = tmp_path / "bench.json"
    assert main(["--engine-dir", engine, "--requests", "12", "--per-step", "2", "--prompt", "30", "--output", "8",
                 "--chunk", "48", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True
    assert report["plain"]["steps"] > 6 and report["ahead"]["steps"] >= report["plain"]["steps"]
    assert report["plain"]["period_ms"] > 0 and report["ahead_over_plain"] > 0


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "launched-ahead"])
def test_chunked_mode_logs_each_step_for_bench_gaps(engine, tmp_path, ahead):
    """serve.iteration_log in chunked mode (engine/step_log.py): one record per step, its
    decode rows and prompt chunks, in the fields `bench gaps` reads (on this CPU, the host's
    clock); steps launched ahead log their launch's host time too."""
    from bullet_trt.tools.bench.decode_gaps import decode_gaps
    from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load

    log = tmp_path / "steps.jsonl"
    batch = prompts(6, seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    overrides = {**(AHEAD if ahead else CHUNKED), "serve.iteration_log": str(log)}
    run(engine, batch, params, **overrides)
    records = load(log)
    assert {r["phase"] for r in records} == {"decode", "mixed"} and not has_gpu_stamps(records)
    mixed = [r for r in records if r["phase"] == "mixed"]
    assert sum(r["tokens"] for r in records) == sum(len(p) for p in batch) + 6 * 9  # prompts, then 9 decode steps each
    assert all(r["prefilling"] > 0 and r["batch"] == r["prefilling"] + r["decoding"] for r in mixed)
    assert all(("launch_ms" in r) == ahead for r in records)
    bands = decode_gaps(records, "host")
    assert bands and sum(b["steps"] for b in bands) == len(records)
