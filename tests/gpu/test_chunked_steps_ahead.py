"""Chunked steps launched one ahead (`decode.overlap_steps` in chunked mode, engine/steps_ahead.py)
on a GPU: the plain loop's tokens through the decode graphs and the piecewise graphs of mixed
steps, and a mixed step's launch (decode rows fed on the device, a prompt chunk, its attention
metadata) that never waits for the step in flight: a launch that waited would run the host's
work after the GPU's again, and the loop would gain nothing."""
from __future__ import annotations

import pytest

from bullet_trt import LLM, SamplingParams
from bullet_trt.engine.request import NewRequest
from bullet_trt.tools.build import build_from_checkpoint
from tests.gpu.test_sampling_without_host_sync import no_host_sync

CHUNKED = {"serve.mode": "chunked", "serve.chunk_size": 64, "prefill.piecewise_graph_tokens": [64, 128]}
AHEAD = {**CHUNKED, "decode.overlap_steps": True}


@pytest.fixture(scope="module", params=["llama", "qwen3_moe-mixed"])
def engine(checkpoint, tmp_path_factory, request):
    """A dense model and a mixture-of-experts one, whose routing and fused experts must launch
    without a host wait too. fp32: both loops must pick the same tokens."""
    return str(build_from_checkpoint(checkpoint(request.param), tmp_path_factory.mktemp("ahead") / "engine",
                                     max_model_len=256, dtype="float32"))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length + 7 * i)] for i in range(n)]


def test_the_steps_launched_ahead_pick_the_plain_loops_tokens_on_the_gpu(engine, tmp_path):
    """Also each loop's iteration log (engine/step_log.py): every step stamped with the GPU's
    timer, one after the other on the engine's one stream, as `bench gaps` reads them."""
    from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load

    batch = prompts(12, 40, seed=1)
    params = [SamplingParams(max_tokens=24 + i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(12)]
    outs = []
    for name, overrides in (("plain", CHUNKED), ("ahead", AHEAD)):
        log = tmp_path / f"{name}.jsonl"
        with LLM(engine, **overrides, **{"serve.iteration_log": str(log)}) as llm:
            assert (llm.engine.ahead is not None) == (overrides is AHEAD)
            outs.append([c.token_ids for c in llm.generate_token_ids(batch, params)])
            stats = llm.engine.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total
        records = load(log)
        assert has_gpu_stamps(records) and {r["phase"] for r in records} == {"decode", "mixed"}
        steps = sorted(records, key=lambda r: r["gpu_start_ns"])
        assert all(0 < r["gpu_end_ns"] - r["gpu_start_ns"] for r in steps)
        assert all(a["gpu_end_ns"] <= b["gpu_start_ns"] for a, b in zip(steps, steps[1:]))
    assert outs[0] == outs[1]


def test_a_mixed_step_is_launched_without_waiting_for_the_step_in_flight(engine):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(engine, **AHEAD) as llm:
        core = llm.engine
        for i, ids in enumerate(prompts(4, 30, seed=2)):
            core.add_request(NewRequest(f"d{i}", ids, greedy))
        for _ in range(4):  # prompts in, decoding, a step in flight
            core.step()
        core.add_request(NewRequest("p", prompts(1, 100, seed=3)[0], greedy))
        plan = core.scheduler.schedule(core.requests.ends_for_certain)
        chunks = plan.decodes + plan.prefills
        assert plan.prefills and any(c.seq.num_pending for c in plan.decodes)  # fed rows and a prompt chunk
        items = [core.requests.item(c.seq, c.num_new_tokens) for c in chunks]
        with no_host_sync():
            step = core.ahead.launch(chunks, items, len(plan.decodes))
        core._report_ahead(step)
        ends = {}
        while core.has_unfinished():
            ends.update({o.request_id: o.finish_reason for o in core.step() if o.finished})
        assert ends == {**{f"d{i}": "length" for i in range(4)}, "p": "length"}
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
