"""The three serving modes run the same model: greedy outputs are identical, and the spatial
modes leave a per-iteration record that the plot command draws."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bullet_trt.tools.bench.iteration_records import load
from bullet_trt.tools.bench.plot_iterations import plot
from bullet_trt.tools.bench.timeline import timeline_report
from bullet_trt.serving.llm import LLM
from bullet_trt.engine.sampling import SamplingParams
from tests.test_engine import GREEDY, llama_engine, prompts  # noqa: F401 (fixture)


def run_mode(engine_dir, mode: str, batch, **extra):
    with LLM(str(engine_dir), **{"serve.mode": mode, **extra}) as llm:
        out = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        stats = llm.engine.stats()
    return out, stats


def test_greedy_outputs_identical_across_modes(llama_engine, tmp_path):
    batch = prompts(10, seed=5)
    chunked, _ = run_mode(llama_engine, "chunked", batch, **{"serve.chunk_size": 32})
    log = tmp_path / "iterations.jsonl"
    bullet, stats = run_mode(llama_engine, "bullet", batch, **{"serve.iteration_log": str(log)})
    static, _ = run_mode(llama_engine, "static", batch, **{"serve.static_prefill_sms": 8})
    assert bullet == chunked
    assert static == chunked
    assert stats.kv_blocks_free == stats.kv_blocks_total
    records = load(log)
    phases = {r["phase"] for r in records}
    assert phases == {"prefill", "decode"}
    assert sum(r["batch"] for r in records if r["phase"] == "prefill") >= len(batch)
    for r in records:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["wall_ms"] >= r["measured_ms"]  # the worker's own time is part of the round trip
        assert set(r) >= {"t", "phase", "batch", "tokens", "prefill_sms", "decode_sms", "waiting"}
    decodes = [r for r in records if r["phase"] == "decode"]
    assert all(r["host_gap_ms"] >= 0 for r in decodes[1:]) and "host_gap_ms" not in decodes[0]
    assert not any("launch_ms" in r for r in decodes)  # steps one at a time: no launch ahead
    png = plot(records, tmp_path / "split.png")
    assert png.stat().st_size > 1000


def test_steps_launched_ahead_log_their_launch_time(llama_engine, tmp_path):
    """decode.overlap_steps: each decode record carries its launch's host time, which tells a
    launch that returned at once from one that waited for its step (bench gaps reads it)."""
    batch = prompts(6, seed=5)
    chunked, _ = run_mode(llama_engine, "chunked", batch, **{"serve.chunk_size": 32})
    log = tmp_path / "iterations.jsonl"
    overlapped, stats = run_mode(llama_engine, "bullet", batch,
                                 **{"serve.iteration_log": str(log), "decode.overlap_steps": True})
    assert overlapped == chunked and stats.kv_blocks_free == stats.kv_blocks_total
    decodes = [r for r in load(log) if r["phase"] == "decode"]
    assert decodes and all(0 <= r["launch_ms"] <= r["wall_ms"] for r in decodes)


def test_prompts_fused_into_decode_steps_give_the_same_outputs(llama_engine, tmp_path):
    """serve.fuse_prefill=always: once rows decode, waiting prompts are prefilled inside the
    decode worker's step; outputs stay those of chunked serving and every block comes back."""
    batch = prompts(14, seed=9)
    chunked, _ = run_mode(llama_engine, "chunked", batch, **{"serve.chunk_size": 32})
    log = tmp_path / "fused.jsonl"
    fused, stats = run_mode(llama_engine, "bullet", batch, **{
        "serve.fuse_prefill": "always", "serve.iteration_log": str(log), "prefill.max_num_seqs": 2,
        "serve.prefill_hold_fraction": 0})
    assert fused == chunked
    assert stats.kv_blocks_free == stats.kv_blocks_total
    records = load(log)
    steps = [r for r in records if r["phase"] == "fused"]
    assert steps and {"prefill", "decode"} <= {r["phase"] for r in records}
    prefilled = sum(r["batch"] for r in records if r["phase"] == "prefill")
    assert prefilled < len(batch)  # the rest rode along in decode steps
    assert all(r["tokens"] > r["batch"] for r in steps)  # prompt tokens on top of one per row
    # each prompt prefilled once, on the partition or riding along; a fused step names its riders,
    # so bench timeline can tell its prompt tokens from its rows
    assert prefilled + sum(r["prompts"] for r in steps) == len(batch)
    riding = sum(r["tokens"] - (r["batch"] - r["prompts"]) for r in steps)
    partition = sum(r["tokens"] for r in records if r["phase"] == "prefill")
    assert riding + partition == sum(len(p) for p in batch)
    window = timeline_report(records, window_s=1e6)["windows"][0]
    assert window["fused_steps"] == len(steps)
    assert window["prompt_tokens_fused"] == round(riding / (riding + partition), 3)
    assert plot(records, tmp_path / "fused.png").stat().st_size > 1000
    # the next fused prompts go out while a step carries the last ones, so they ride in the
    # very next step: back-to-back fused steps (with one job out at a time, every other step)
    log = tmp_path / "back_to_back.jsonl"
    back_to_back, _ = run_mode(llama_engine, "bullet", batch, **{
        "serve.fuse_prefill": "always", "serve.iteration_log": str(log), "prefill.max_num_seqs": 2,
        "serve.prefill_hold_fraction": 0, "serve.chunk_size": 64})
    assert back_to_back == chunked
    phases = [r["phase"] for r in load(log)]
    assert ("fused", "fused") in zip(phases, phases[1:])
    # with slices a prompt that does not fit rides in part, filling the step's budget as
    # chunked's steps do; its rest rides later or goes to the partition, each token once
    log = tmp_path / "slices.jsonl"
    sliced, stats = run_mode(llama_engine, "bullet", batch, **{
        "serve.fuse_prefill": "always", "serve.fuse_prompt_slices": True, "serve.iteration_log": str(log),
        "prefill.max_num_seqs": 2, "serve.prefill_hold_fraction": 0, "serve.chunk_size": 64})
    assert sliced == chunked
    assert stats.kv_blocks_free == stats.kv_blocks_total
    records = load(log)
    steps = [r for r in records if r["phase"] == "fused"]
    riding = sum(r["tokens"] - (r["batch"] - r["prompts"]) for r in steps)
    partition = sum(r["tokens"] for r in records if r["phase"] == "prefill")
    assert riding + partition == sum(len(p) for p in batch)
    prefilled = sum(r["batch"] for r in records if r["phase"] == "prefill")
    assert prefilled + sum(r["prompts"] for r in steps) > len(batch)  # some prompt rode in more than one step
    # a slice filled a step's budget as the admission counted it: the rows it saw beside the
    # prompt tokens (rows that joined or left the worker's batch meanwhile move the step's total)
    prompt_tokens = [r["tokens"] - (r["batch"] - r["prompts"]) for r in steps]
    budgeted = [r["planned_rows"] + n for r, n in zip(steps, prompt_tokens)]
    assert max(budgeted) == 64 and all(n <= 64 for n in budgeted)
    # the decode worker's fused steps through piecewise graphs of its own (run uncaptured on
    # a CPU: the same pieces and attention between them), beside the prefill worker's
    pieces, _ = run_mode(llama_engine, "bullet", batch, **{
        "serve.fuse_prefill": "always", "prefill.max_num_seqs": 2, "serve.prefill_hold_fraction": 0,
        "decode.piecewise_graph_tokens": "[16, 64, 128]", "prefill.piecewise_graph_tokens": "[32, 128]"})
    assert pieces == chunked


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from bullet_trt.tools.build import build_tiny_random_engine
    return build_tiny_random_engine(tmp_path_factory.mktemp("tiny") / "engine")


def test_decode_keeps_stepping_while_prefill_runs(tiny_engine, tmp_path):
    """Requests arriving while others decode: the decode worker's iterations interleave with
    prefill iterations instead of waiting for them (decode steps end while a prefill batch is
    in flight)."""
    log = tmp_path / "it.jsonl"
    with LLM(str(tiny_engine), **{"serve.mode": "bullet", "serve.iteration_log": str(log),
                                  "serve.prefill_hold_fraction": 0}) as llm:
        core = llm.engine
        from bullet_trt.engine.request import NewRequest
        long_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts(4, seed=1)):
            core.add_request(NewRequest(f"a{i}", ids, long_params))
        steps = 0
        while core.has_unfinished():
            core.step()
            steps += 1
            if steps == 10:  # a second wave arrives mid-decode
                for i, ids in enumerate(prompts(4, seed=2)):
                    core.add_request(NewRequest(f"b{i}", ids * 8, long_params))
    records = [json.loads(line) for line in open(log)]
    assert [r for r in records if r["phase"] == "prefill"], "no prefill ran"
    beside = [r for r in records if r["phase"] == "decode" and r["prefill_in_flight"]]
    assert beside, "no decode step ended while a prefill batch was in flight: decode waited for prefill"


def _gather_beside_a_decoding_request(engine_dir, log, **extra):
    """One request decodes while a short prompt gathers for its batch (a TTFT SLO of a minute
    holds it for 30 s), then its prefill runs. The orchestrator is told of splits of a 64-SM
    GPU, which the CPU's workers run on their one device: only the policy and the iteration
    log see them. Returns the log's records, the split decode was moved ahead to (None: not
    moved), and the decode steps' SMs logged while the prompt gathered (the log flushes each
    record: those before the hold ends)."""
    from bullet_trt.engine.request import NewRequest
    with LLM(str(engine_dir), **{"serve.mode": "bullet", "serve.iteration_log": str(log),
                                 "serve.ttft_slo_ms": 60_000.0, "serve.prefill_hold_fraction": 0.5,
                                 "serve.prefill_batch_tokens": 4096, **extra}) as llm:
        core = llm.engine
        core.total_sms, core.splits, core.log.partitioned = 64, list(range(8, 64, 8)), True
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        core.add_request(NewRequest("long", prompts(1, seed=3)[0], long))
        for _ in range(5):
            core.step()
        core.add_request(NewRequest("short", prompts(1, seed=4)[0], SamplingParams(max_tokens=4, temperature=0)))
        for _ in range(12):  # the prompt gathers: no prefill starts
            core.step()
        assert core.prefilling is None and [s.request_id for s in core.queues.waiting] == ["short"]
        ahead = core.ahead
        while_gathering = [r["decode_sms"] for r in load(log) if r["phase"] == "decode"]
        core.cfg.serve.prefill_hold_fraction = 0.0  # the hold ends: the prefill starts
        while core.has_unfinished():
            core.step()
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
    return sorted(load(log), key=lambda r: r["t"]), ahead, while_gathering


def test_decode_moves_ahead_to_the_split_of_a_gathering_batch(tiny_engine, tmp_path):
    """serve.split_ahead: while a prompt gathers for its batch, decode's steps run on the
    complement of the split the batch is expected to get, and its prefill then starts on SMs
    decode has left: none of its time beside a decode step on SMs it holds (`bench overlap`'s
    figure, from the iteration log), with or without decode's steps launched one ahead.
    Without it, or before the batch is due, decode keeps the whole GPU while the prompt gathers."""
    from bullet_trt.tools.bench.split_overlap import overlap_report

    for overlap in (False, True):
        # a lead longer than the 30 s hold: the batch is due while it gathers
        records, ahead, while_gathering = _gather_beside_a_decoding_request(
            tiny_engine, tmp_path / f"ahead_{overlap}.jsonl", **{"serve.split_ahead": True,
                                                                 "serve.split_ahead_lead_steps": 1e9,
                                                                 "decode.overlap_steps": overlap})
        assert ahead is not None and ahead.decode_sms < 64
        assert while_gathering[-3:] == [ahead.decode_sms] * 3
        short = [r for r in records if r["phase"] == "prefill"][-1]
        assert 0 < short["prefill_sms"] <= ahead.prefill_sms
        assert overlap_report(records)["prefill_share_sharing_sms"] == 0.0
    # Without it, and with it before the batch is due, every decode step while the prompt
    # gathers runs on the whole GPU. (Once the hold ends the batch is due and the gated
    # split_ahead may move decode a step before the prefill launches: not looked at here.)
    _, ahead, while_gathering = _gather_beside_a_decoding_request(tiny_engine, tmp_path / "plain.jsonl")
    assert ahead is None and len(while_gathering) >= 12 and set(while_gathering) == {64}
    # with the default lead of two decode steps a hold with most of its 30 s to run is not due
    _, ahead, while_gathering = _gather_beside_a_decoding_request(tiny_engine, tmp_path / "not_due.jsonl",
                                                                  **{"serve.split_ahead": True})
    assert ahead is None and len(while_gathering) >= 12 and set(while_gathering) == {64}


def test_decode_goes_from_one_prefill_split_to_the_next_not_through_the_whole_gpu(tiny_engine):
    """serve.split_ahead: a prefill ends while a prompt waits for the next one, which the next
    call launches: decode's update names the split that prefill is expected to get, where
    without it decode went to the whole GPU in between (and the next prefill started beside
    its steps there). The decode worker's real updates, recorded on their way."""
    from bullet_trt.engine.request import NewRequest
    from bullet_trt.protocol import SmSplit

    def splits_sent(split_ahead: bool) -> list:
        with LLM(str(tiny_engine), **{"serve.mode": "bullet", "serve.prefill_hold_fraction": 0.0,
                                      "serve.split_ahead": split_ahead}) as llm:
            core = llm.engine
            core.total_sms, core.splits = 64, list(range(8, 64, 8))
            sent, send = [], core.decode.send_update
            core.decode.send_update = lambda update: (sent.append(update.split), send(update))
            # the prefill batches as the worker is given them: a prefill can start and end within
            # one call of step(), so watching core.prefilling between calls may never see it. The
            # first short prompt's batch reaches the worker only once the second prompt has
            # arrived, as from a slower prefill: its prefill is then surely in flight meanwhile
            submitted, submit, held = [], core.prefill.submit, []
            # the updates up to second's launch, counted as it is submitted: its prefill can end
            # within the same call of step(), and decode's move back to the whole GPU after it
            # would count as the move this test looks for
            until_second = None

            def submit_recorded(items, *a, **kw):
                nonlocal until_second
                submitted.extend(it.request_id for it in items)
                if [it.request_id for it in items] == ["second"]:
                    until_second = len(sent)
                if [it.request_id for it in items] == ["first"]:
                    held.append((items, a, kw))
                else:
                    submit(items, *a, **kw)
            core.prefill.submit = submit_recorded
            long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
            core.add_request(NewRequest("long", prompts(1, seed=3)[0], long))
            for _ in range(5):
                core.step()
            short = SamplingParams(max_tokens=2, temperature=0)
            core.add_request(NewRequest("first", prompts(1, seed=4)[0], short))
            core.step()
            assert core.prefilling is not None and submitted == ["long", "first"]  # first's prefill in flight
            core.add_request(NewRequest("second", prompts(1, seed=5)[0], short))
            after_first = len(sent)
            items, a, kw = held.pop()
            submit(items, *a, **kw)
            while core.has_unfinished():
                core.step()
        assert until_second is not None and submitted == ["long", "first", "second"]
        return sent[after_first:until_second]

    whole = SmSplit.whole(64)
    ahead = splits_sent(True)
    assert ahead and whole not in ahead
    assert whole in splits_sent(False)


def test_bad_split_configuration_is_a_startup_error(llama_engine):
    from bullet_trt.config import ConfigError
    with pytest.raises(ConfigError, match="static_prefill_sms"):
        LLM(str(llama_engine), **{"serve.mode": "static", "serve.static_prefill_sms": 0})
    with pytest.raises(ConfigError, match="tpot_slo_ms"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.tpot_slo_ms": 0})
    with pytest.raises(ConfigError, match=r"serve.ttft_plan_fraction must be in \(0, 1\]"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.ttft_plan_fraction": 1.5})
    with pytest.raises(ConfigError, match=r"serve.tpot_plan_fraction must be in \(0, 2\], got 0"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.tpot_plan_fraction": 0})
    with pytest.raises(ConfigError, match="serve.fuse_prefill must be never, auto or always, got 'often'"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.fuse_prefill": "often"})
    with pytest.raises(ConfigError, match="serve.split_ahead_lead_steps must be >= 0, got -1"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.split_ahead": True, "serve.split_ahead_lead_steps": -1})
    # an 8-SM phase failed the decode worker's graph capture in cuBLAS on an H100: refused before any worker starts
    with pytest.raises(ConfigError, match=r"serve.min_phase_sms must be >= 16 .*got 8"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.min_phase_sms": 8})
    with pytest.raises((ValueError, RuntimeError), match="serve.partitioner"):
        LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.partitioner": "green"})


def test_workers_exit_when_the_orchestrator_dies(llama_engine, tmp_path):
    """An orchestrator that dies without closing (a crash, SIGKILL) leaves no worker behind."""
    import os
    import select
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from bullet_trt.serving.llm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(llama_engine)!r}, **{{'serve.mode': 'bullet'}})\n"
        "    print(llm.engine.prefill.pid, llm.engine.decode.pid, flush=True)\n"
        "    os._exit(0)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie waits only for its reaper
            return f.read().split()[2] != "Z"

    # The workers are not our children; a pidfd reports each one's exit as it happens. The
    # timeout only keeps a broken build from hanging the suite.
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], 120)
        finally:
            os.close(fd)
    assert not any(alive(p) for p in pids), "worker processes outlived their orchestrator"


def _mixed_requests(batch):
    """Per-request sampling that exercises every stopping and sampling rule the decode
    worker's own batch must follow: seeded noise keyed by output index, min_tokens banning
    the end id, stop sequences, length limits and log-probs."""
    reference = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(batch)
    return reference, [
        SamplingParams(max_tokens=24, temperature=1.0, seed=7 + i, ignore_eos=True, logprobs=i % 2 == 0)
        if i % 3 == 0 else
        SamplingParams(max_tokens=5 + i, temperature=0.8, top_k=20, seed=100 + i, min_tokens=3)
        if i % 3 == 1 else
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i in range(len(batch))]


def test_a_dry_pool_preempts_only_the_rows_it_needs(llama_engine):
    """Under a dry pool the fewest decoding sequences are preempted. A preempted row's blocks
    come back only when the decode worker acknowledges its leave, so the pool stays dry until
    then; the sequence that needed a block waits for them instead of preempting every other
    row, and gets them with the acknowledgement."""
    from bullet_trt.engine.request import NewRequest
    from bullet_trt.engine.sequence import SeqStatus
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(llama_engine), **{"serve.mode": "bullet", "kv.num_blocks": 16}) as llm:
        core = llm.engine
        bs = core.queues.block_size
        assert core.allocator.num_blocks == 16
        seqs = []
        for i in range(4):  # four decoding rows of four full blocks each: the pool is full
            seq = core.requests.admit(NewRequest(f"r{i}", [5 + i] * (4 * bs), params))
            seq.status = SeqStatus.RUNNING
            core.queues.decoding.append(seq)
            assert core.queues.reserve(seq, seq.num_tokens)
            seq.num_cached_tokens = seq.num_tokens
            core.rows.join(seq, core.requests.item(seq, 1))
            seqs.append(seq)
        assert core.allocator.num_free == 0
        newest_row = core.rows.row_of["r3"]
        seqs[0].output_token_ids.append(9)  # its next position needs a fifth block
        assert core._ensure_room(seqs[0])
        assert core.queues.num_preemptions == 1
        assert core.queues.waiting == [seqs[3]] and seqs[3].status is SeqStatus.WAITING
        assert [s.status for s in seqs[:3]] == [SeqStatus.RUNNING] * 3
        assert core.allocator.num_free == 0 and core.rows.pending_blocks == 4
        assert core.starved == [seqs[0]] and len(seqs[0].block_table) == 4
        core._free_acknowledged([newest_row])  # the worker acknowledges the leave
        assert core.starved == [] and len(seqs[0].block_table) == 5
        row0 = core.rows.row_of["r0"]
        assert (row0, seqs[0].block_table[4:]) in core.rows.pending.grants
        assert core.allocator.num_free == 3 and core.queues.num_preemptions == 1


@pytest.mark.parametrize("fuse, waits, row_budget, lookahead, overlap", [
    ("never", True, False, 4, False), ("never", False, False, 4, False), ("always", False, False, 4, False),
    ("never", False, True, 0, False), ("never", False, False, 16, False), ("never", False, False, 4, True),
    ("always", True, False, 0, True)])
def test_spatial_modes_follow_every_rule_under_preemption(llama_engine, fuse, waits, row_budget, lookahead, overlap):
    """The decode worker steps its own rows: seeded sampling, min_tokens, end ids, stop
    sequences and log-probs come out as in the in-process engine, also when a small pool
    preempts decoding sequences, when every prefill waits for decode's move to the
    complement, when the rows' TPOT budgets bound decode's step, whether blocks are
    granted just in time or a block ahead, and when each decode step is launched before the
    last one's tokens reach the host (its input tokens fed on the device; rows that end step
    once more), with fused prompts draining it; and every block comes back."""
    batch = prompts(12, seed=11)
    greedy_params, params = _mixed_requests(batch)
    with LLM(str(llama_engine), **{"serve.mode": "chunked"}) as llm:
        greedy = llm.generate_token_ids(batch, greedy_params)
        # end id and a stop sequence taken from greedy continuations
        params[2] = SamplingParams(max_tokens=24, temperature=0, end_id=greedy[2].token_ids[6])
        params[5] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                   stop_token_ids=[greedy[5].token_ids[8:10]])
        params[8] = SamplingParams(max_tokens=24, temperature=0, end_id=greedy[8].token_ids[4], min_tokens=9)
        ref = llm.generate_token_ids(batch, params)
    assert ref[2].finish_reason == ref[5].finish_reason == "stop"
    # 24 blocks of 16 tokens cannot hold 12 requests of ~60 tokens at once
    # (prefills at once, as the decode rows come and go: gathering prompts would change
    # when the pool runs dry, not the rules)
    with LLM(str(llama_engine), **{"serve.mode": "bullet", "kv.num_blocks": 24,
                                   "serve.prefill_hold_fraction": 0, "serve.fuse_prefill": fuse,
                                   "serve.prefill_waits_for_split": waits,
                                   "serve.row_tpot_budget": row_budget,
                                   "serve.grant_lookahead_tokens": lookahead,
                                   "decode.overlap_steps": overlap}) as llm:
        out = llm.generate_token_ids(batch, params)
        stats = llm.engine.stats()
    for got, want in zip(out, ref):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        if want.logprobs is not None:
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total == 24


def finish_reasons(core) -> dict[str, str]:
    """Steps the engine until every request has ended; how each ended."""
    reasons = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return reasons


def test_abort_of_a_decoding_row_frees_its_blocks_in_spatial_mode(llama_engine):
    from bullet_trt.engine.request import NewRequest
    with LLM(str(llama_engine), **{"serve.mode": "bullet"}) as llm:
        core = llm.engine
        long_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts(3)):
            core.add_request(NewRequest(f"r{i}", ids, long_params))
        emitted = {}
        while len(emitted.get("r1", [])) < 3:  # r1 is decoding in the worker's batch
            for out in core.step():
                emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert core.stats().kv_blocks_free < core.stats().kv_blocks_total
        core.abort_request("r1")
        assert finish_reasons(core) == {"r0": "length", "r1": "abort", "r2": "length"}
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


def test_abort_of_a_prompt_that_rode_in_part_frees_its_blocks(llama_engine):
    """serve.fuse_prompt_slices: a sequence whose prompt rode in part in a fused step waits for
    its rest holding its prompt's blocks; aborted there, it ends and gives them back."""
    from bullet_trt.engine.request import NewRequest
    with LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.fuse_prefill": "always",
                                   "serve.fuse_prompt_slices": True, "serve.chunk_size": 16,
                                   "serve.prefill_hold_fraction": 0}) as llm:
        core = llm.engine
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        core.add_request(NewRequest("r0", prompts(1, seed=3)[0], params))
        while not core.queues.decoding:
            core.step()
        core.add_request(NewRequest("r1", list(range(3, 53)), params))  # 50 tokens, 15 a step beside r0
        while not any(s.num_cached_tokens for s in core.queues.waiting):
            core.step()
        assert [s.request_id for s in core.queues.waiting] == ["r1"] and core.queues.waiting[0].block_table
        core.abort_request("r1")
        assert finish_reasons(core) == {"r0": "length", "r1": "abort"}
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


def test_the_stats_carry_the_performance_models_correction(llama_engine):
    """bullet_perf_model_correction on /metrics: the online correction per phase, which moves
    from 1 as measured steps come in (a stale calibration shows as a correction far from 1);
    0 where no performance model plans the steps (chunked)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(llama_engine), **{"serve.mode": "bullet"}) as llm:
        llm.generate_token_ids(prompts(3, seed=31), params)
        core = llm.engine
        stats = core.stats()
        assert stats.perf_correction_prefill == core.perf.correction["prefill"] != 1.0
        assert stats.perf_correction_decode == core.perf.correction["decode"] != 1.0
    with LLM(str(llama_engine), **{"serve.mode": "chunked"}) as llm:
        llm.generate_token_ids(prompts(1, seed=31), params)
        stats = llm.engine.stats()
        assert (stats.perf_correction_prefill, stats.perf_correction_decode) == (0.0, 0.0)


def test_a_failed_prefill_batch_ends_its_requests_and_the_engine_serves_on(llama_engine):
    """A prefill batch that raises in the worker (on a GPU: out of memory under a burst) ends
    its own requests with an error that says so and frees their blocks; the worker and the
    engine go on. The failure here is real: a token id past the vocabulary, planted after
    the engine validated the request, makes the worker's embedding lookup raise."""
    from bullet_trt.engine.request import NewRequest
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(llama_engine), **{"serve.mode": "bullet"}) as llm:
        core = llm.engine
        vocab = core.state.arch.vocab_size
        bad, good = prompts(2, seed=3)
        core.add_request(NewRequest("bad", bad, params))
        core.requests.seqs["bad"].prompt_token_ids[0] = vocab + 7
        finished = {}
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = out
        assert finished["bad"].finish_reason == "error"
        assert "prefill failed" in finished["bad"].error and "IndexError" in finished["bad"].error
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
        core.add_request(NewRequest("good", good, params))
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = out
        assert finished["good"].finish_reason == "length" and finished["good"].num_output_tokens == 6
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


def _drain(core, finished: dict) -> None:
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_failed_decode_step_ends_its_rows_and_the_engine_serves_on(llama_engine, overlap):
    """A decode step that raises in the decode worker ends the requests of its rows with an
    error that says so and frees their blocks (once the worker acknowledges the leave); the
    worker keeps stepping and the engine serves later requests, also with its steps launched
    one ahead. The failure is real: the row's input token is replaced, on its way to the
    worker, by an id past the vocabulary."""
    from bullet_trt.engine.request import NewRequest
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(llama_engine), **{"serve.mode": "bullet", "decode.overlap_steps": overlap}) as llm:
        core = llm.engine
        vocab = core.state.arch.vocab_size
        join = core._join

        def join_with_a_bad_token(seq):
            join(seq)
            joins = core.rows.pending.joins
            if seq.request_id == "bad" and joins and joins[-1][0] == core.rows.row_of.get("bad"):
                joins[-1][1].input_token_ids = [vocab + 7]

        core._join = join_with_a_bad_token
        bad, good = prompts(2, seed=5)
        core.add_request(NewRequest("bad", bad, params))
        finished = {}
        _drain(core, finished)
        assert finished["bad"].finish_reason == "error"
        assert "decode failed" in finished["bad"].error and "IndexError" in finished["bad"].error
        assert finished["bad"].num_output_tokens == 1  # the prefill's token, then the failed step
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
        core.add_request(NewRequest("good", good, params))
        _drain(core, finished)
        assert finished["good"].finish_reason == "length" and finished["good"].num_output_tokens == 6
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


def test_chunked_steps_that_fail_end_their_requests_until_they_keep_failing(llama_engine):
    """In `chunked` a hybrid step that raises ends the requests it carried and the engine
    serves on; a success resets the count, and the third failure in a row ends the engine
    (so the server reports not ready) instead of failing every request forever."""
    from bullet_trt.engine.request import NewRequest
    from bullet_trt.engine.step_failure import StepsKeepFailing
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(llama_engine), **{"serve.mode": "chunked"}) as llm:
        core = llm.engine
        vocab = core.state.arch.vocab_size
        batch = prompts(6, seed=9)
        finished = {}

        def add(rid, prompt, bad):
            core.add_request(NewRequest(rid, prompt, params))
            if bad:
                core.requests.seqs[rid].prompt_token_ids[0] = vocab + 7  # after validation

        for i, bad in enumerate([True, True, False, True, True, True]):
            add(f"r{i}", batch[i], bad)
            if i == 5:
                with pytest.raises(StepsKeepFailing, match="3 engine steps failed in a row"):
                    _drain(core, finished)
                break
            _drain(core, finished)
        assert [finished[f"r{i}"].finish_reason for i in range(5)] == ["error", "error", "length", "error", "error"]
        assert finished["r2"].num_output_tokens == 4
        assert "step failed in the engine" in finished["r0"].error and "IndexError" in finished["r0"].error


def test_the_plan_follows_the_pressure_on_the_two_slos(llama_engine, tmp_path):
    """serve.tpot_plan_auto: every first token gives the tuner its TTFT and every request that
    ends with tokens its TPOT, and the policy's next decision plans decode's step with the
    tuner's plan (here TTFT's SLO is a millisecond and TPOT's generous, so it rises; the tuner's
    own rules are tests/test_plan_tuner.py); the iteration log's prefill records carry the
    plan, and the timeline plot draws it."""
    from bullet_trt.spatial.plan_tuner import TpotPlanTuner
    from bullet_trt.tools.bench.iteration_records import step_windows
    from bullet_trt.tools.bench.plot_iterations import plan_series
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    log = tmp_path / "plan.jsonl"
    with LLM(str(llama_engine), **{"serve.mode": "bullet", "serve.tpot_plan_auto": True,
                                   "serve.iteration_log": str(log), "serve.ttft_slo_ms": 1.0,
                                   "serve.tpot_slo_ms": 10_000.0, "serve.tpot_plan_fraction": 0.85}) as llm:
        core = llm.engine
        assert core.plan_tuner is not None and core.slo.tpot_plan == 0.85
        assert (core.plan_tuner.ttft_slo_ms, core.plan_tuner.tpot_slo_ms) == (1.0, 10_000.0)
        # the serving defaults wait for 50 requests and look once a second
        core.plan_tuner = TpotPlanTuner(1.0, 10_000.0, 0.85, min_requests=4, interval_s=0.0)
        llm.generate_token_ids(prompts(6, seed=21), params)
        assert len(core.plan_tuner.ttfts) == 6 and len(core.plan_tuner.tpots) == 6
        assert all(t > 0 for t in core.plan_tuner.ttfts)
        assert all(0 < t < 10_000.0 for t in core.plan_tuner.tpots)
        llm.generate_token_ids(prompts(1, seed=22), params)  # one more decision, with the tuner's plan
        assert core.slo.tpot_plan == core.plan_tuner.value > 0.85
        assert core.stats().tpot_plan == core.plan_tuner.value  # bullet_tpot_plan_fraction on /metrics
    records = load(log)
    plans = [r["tpot_plan"] for r in records if r["phase"] == "prefill"]
    assert plans[0] == 0.85 and plans[-1] > 0.85
    assert "tpot_plan" not in {k for r in records if r["phase"] == "decode" for k in r}
    shown = list(zip(records, step_windows(records, "host")))
    assert plan_series(shown)[1] == plans
    assert plot(records, tmp_path / "plan.png").stat().st_size > 1000
