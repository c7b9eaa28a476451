"""The serving benchmark: datasets, trace files, metrics, the report, the transformers peer's
replay loop, and one end-to-end run of `bench serve` against the real tritonserver (CPU,
embedded default engine). No test asserts on wall time."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.managed_server import engine_notes
from bullet_trt.tools.bench.metrics import RequestRecord, percentiles, slo_attainment, summarize

# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------

# documented targets (bullet_trt/tools/bench/datasets.py, docs/benchmarking.md): sample means, no model cap
MEAN_RANGES = {
    "sharegpt": ((145, 180), (310, 365)),
    "azure-conv": ((1050, 1270), (205, 250)),
    "azure-code": ((1850, 2200), (26, 33)),
}


@pytest.mark.parametrize("name", sorted(MEAN_RANGES))
def test_length_distributions_match_documented_means(name):
    spec = ds.DATASETS[name]
    inputs, outputs = ds.sample_lengths(name, 20000, seed=1)
    (in_lo, in_hi), (out_lo, out_hi) = MEAN_RANGES[name]
    assert in_lo <= inputs.mean() <= in_hi
    assert out_lo <= outputs.mean() <= out_hi
    # medians follow exp(mu) (rounding and clipping aside)
    assert np.median(inputs) == pytest.approx(spec.input.median, rel=0.06)
    assert np.median(outputs) == pytest.approx(spec.output.median, rel=0.08)
    assert inputs.min() >= spec.min_input and inputs.max() <= spec.max_input
    assert outputs.min() >= spec.min_output and outputs.max() <= spec.max_output
    # the analytic mean in the table matches the parameters
    assert spec.input.mean == pytest.approx(math.exp(spec.input.mu + spec.input.sigma ** 2 / 2))


def test_lengths_are_reproducible_and_seed_dependent():
    a = ds.sample_lengths("sharegpt", 500, seed=7)
    b = ds.sample_lengths("sharegpt", 500, seed=7)
    c = ds.sample_lengths("sharegpt", 500, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("name", sorted(MEAN_RANGES))
def test_lengths_fit_the_model(name):
    inputs, outputs = ds.sample_lengths(name, 3000, seed=0, max_model_len=1024, max_output_tokens=100)
    assert (inputs + outputs <= 1024).all()
    assert (outputs >= 1).all() and (outputs <= 100).all()
    assert (inputs >= min(ds.DATASETS[name].min_input, 1023)).all()


def test_poisson_arrivals_rate_and_scaling():
    t1 = ds.poisson_arrivals(20000, rate=1.0, seed=3)
    t4 = ds.poisson_arrivals(20000, rate=4.0, seed=3)
    assert t1[0] == 0.0 and (np.diff(t1) >= 0).all()
    assert np.diff(t4).mean() == pytest.approx(0.25, rel=0.03)
    # one seed: the same requests at every rate, compressed in time
    np.testing.assert_allclose(t4 * 4.0, t1)
    assert not np.array_equal(ds.poisson_arrivals(100, 1.0, seed=4), t1[:100])
    with pytest.raises(ValueError, match="rate"):
        ds.poisson_arrivals(10, 0.0)


def test_count_for_duration():
    n = ds.count_for_duration(30.0, rate=2.0, seed=0)
    t = ds.poisson_arrivals(n + 1, 2.0, seed=0)
    assert t[n - 1] <= 30.0 < t[n]


@pytest.fixture(scope="module")
def tokenizer():
    from tests.triton_fixture import ensure_tiny_random_engine
    return ds.load_tokenizer(ensure_tiny_random_engine())


def test_prompts_tokenize_to_the_wanted_length(tokenizer):
    b = ds.PromptBuilder(tokenizer, seed=0)
    for n in (2, 5, 17, 100, 513, 1000):
        text, measured, ids = b.build(n)
        assert measured == n and len(tokenizer.encode(text)) == n and ids == tokenizer.encode(text)
    # different requests do not share a prefix
    assert b.build(50)[0].split()[:3] != b.build(50)[0].split()[:3]


def test_prompts_without_a_tokenizer_approximate_with_words():
    text, measured, ids = ds.PromptBuilder(None, seed=0).build(40)
    assert len(text.split()) == 40 and measured is None and ids is None


def test_prompts_open_with_the_shared_prefix_and_keep_their_lengths(tokenizer):
    """--shared-prefix-tokens: the same tokens open every prompt (all but the last token of a
    shorter one), and each prompt still has its wanted length."""
    w = ds.build_workload("sharegpt", 5.0, 40, seed=3, tokenizer=tokenizer, max_model_len=1024,
                          shared_prefix_tokens=64)
    special = len(tokenizer.encode("", add_special_tokens=True))
    longest = max(w.requests, key=lambda r: r.input_tokens)
    assert longest.input_tokens > special + 64
    prefix = longest.prompt_ids[:special + 64]
    for r in w.requests:
        assert r.prompt_tokens == r.input_tokens and r.prompt_ids == tokenizer.encode(r.prompt)
        shared = special + min(64, r.input_tokens - special - 1)
        assert r.prompt_ids[:shared] == prefix[:shared]
    assert len({tuple(r.prompt_ids[special + 64:special + 70]) for r in w.requests if r.input_tokens > 140}) > 1
    assert "the same 64 tokens" in w.source
    words = ds.PromptBuilder(None, seed=0, shared_prefix_tokens=10)
    a, b = words.build(30)[0].split(), words.build(30)[0].split()
    assert len(a) == len(b) == 30 and a[:10] == b[:10] and a[10:] != b[10:]


def test_workload_is_reproducible(tokenizer):
    a = ds.build_workload("azure-code", 3.0, 6, seed=5, tokenizer=tokenizer, max_model_len=1024)
    b = ds.build_workload("azure-code", 3.0, 6, seed=5, tokenizer=tokenizer, max_model_len=1024)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.prompt) for r in a.requests] == \
           [(r.arrival_s, r.input_tokens, r.output_tokens, r.prompt) for r in b.requests]
    assert all(r.prompt_tokens == r.input_tokens for r in a.requests)
    w = ds.build_workload("sharegpt", 2.0, None, duration_s=20.0, seed=1, prompts=False)
    assert len(w.requests) == ds.count_for_duration(20.0, 2.0, 1) and w.duration_s <= 20.0


# ---------------------------------------------------------------------------------------------
# trace files
# ---------------------------------------------------------------------------------------------

def _write(tmp_path, text, name="trace.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_trace_reads_columns_in_any_order_and_shifts_time(tmp_path):
    p = _write(tmp_path, "# recorded on day 1\ninput_tokens,arrival_time_s,output_tokens,extra\n"
                         "100,10.5,20,x\n\n200,11.0,5,y\n300,12.5,7,z\n")
    rows = ds.read_trace(p)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in rows] == \
           [(0.0, 100, 20), (0.5, 200, 5), (2.0, 300, 7)]
    native = ds.build_workload(f"trace:{p}", None, prompts=False)
    assert [r.arrival_s for r in native.requests] == [0.0, 0.5, 2.0] and native.rate == pytest.approx(1.0)
    fast = ds.build_workload(f"trace:{p}", 4.0, prompts=False)  # rescaled: mean rate 4 req/s
    assert [r.arrival_s for r in fast.requests] == pytest.approx([0.0, 0.125, 0.5])
    capped = ds.build_workload(f"trace:{p}", None, max_model_len=256, max_output_tokens=6, prompts=False)
    assert [(r.input_tokens, r.output_tokens) for r in capped.requests] == [(100, 6), (200, 5), (250, 6)]
    out = ds.write_trace(tmp_path / "round.csv", native.requests)
    assert [(r.arrival_s, r.input_tokens) for r in ds.read_trace(out)] == [(0.0, 100), (0.5, 200), (2.0, 300)]


@pytest.mark.parametrize("text, match", [
    ("", r"empty file"),
    ("arrival_time_s,input_tokens\n0,1\n", r":1: header lacks column\(s\) output_tokens"),
    ("0,10,20\n1,10,20\n", r":1: header lacks column\(s\) arrival_time_s, input_tokens, output_tokens"),
    ("arrival_time_s,input_tokens,output_tokens\n0,10,20\n1,ten,20\n", r":3: column 'input_tokens' must be a whole number, got 'ten'"),
    ("arrival_time_s,input_tokens,output_tokens\n0,10,2.5\n", r":2: column 'output_tokens' must be a whole number"),
    ("arrival_time_s,input_tokens,output_tokens\n0,10,0\n", r":2: column 'output_tokens' must be >= 1"),
    ("arrival_time_s,input_tokens,output_tokens\n-1,10,3\n", r":2: column 'arrival_time_s' must be a non-negative"),
    ("arrival_time_s,input_tokens,output_tokens\n0,10,3\n2,10,3\n1,10,3\n", r":4: column 'arrival_time_s' goes back in time"),
    ("arrival_time_s,input_tokens,output_tokens\n0,10\n", r":2: column 'output_tokens' is missing"),
    ("arrival_time_s,input_tokens,output_tokens\n", r"no requests after the header"),
])
def test_trace_errors_name_line_and_column(tmp_path, text, match):
    p = _write(tmp_path, text)
    with pytest.raises(ds.TraceError, match=match) as e:
        ds.read_trace(p)
    assert str(p) in str(e.value)


def test_trace_missing_file(tmp_path):
    with pytest.raises(ds.TraceError, match="not found"):
        ds.read_trace(tmp_path / "nope.csv")


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

def rec(index, sent, times, tokens=None, end=None, error=None, finished=True) -> RequestRecord:
    tokens = tokens or [1] * len(times)
    return RequestRecord(index, sent, 10, sum(tokens), sent_s=sent, chunk_times=list(times),
                         chunk_tokens=list(tokens), end_s=end if end is not None else (times[-1] if times else None),
                         num_input_tokens=10, error=error, finished=finished and error is None)


def test_per_request_metrics_exact():
    r = rec(0, 1.0, [1.5, 1.75, 2.0, 2.25, 2.5])  # binary fractions: exact comparisons below
    assert r.ttft == 0.5 and r.tpot == 0.25 and r.itls == [0.25] * 4 and r.e2e == 1.5
    # a chunk of two tokens: TPOT counts tokens, ITL counts chunks
    r2 = rec(1, 0.0, [0.2, 0.3, 0.5], [1, 2, 1])
    assert r2.num_output_tokens == 4 and r2.tpot == pytest.approx(0.1) and r2.itls == pytest.approx([0.1, 0.2])
    # an empty (e.g. final-only) response does not count as the first token
    r3 = rec(2, 0.0, [0.1, 0.4, 0.6], [0, 1, 1])
    assert r3.ttft == pytest.approx(0.4) and r3.tpot == pytest.approx(0.2) and r3.itls == pytest.approx([0.2])
    one = rec(3, 0.0, [0.3])
    assert one.tpot is None and one.itls == [] and one.meets_slo(0.5, 0.01)
    assert r.meets_slo(0.5, 0.25) and not r.meets_slo(0.49, 0.25) and not r.meets_slo(0.5, 0.24)
    failed = rec(4, 0.0, [0.1, 0.2], error="boom")
    assert not failed.ok and not failed.meets_slo(10, 10)


def test_percentiles_exact():
    p = percentiles([4.0, 1.0, 3.0, 2.0, None])
    assert p == {"n": 4, "mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    assert percentiles([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_throughput_attainment_goodput():
    records = [
        rec(0, 0.0, [0.5, 0.6, 0.7]),                  # TTFT 0.5, TPOT 0.1: meets (1.0, 0.1)
        rec(1, 1.0, [3.0, 3.1]),                       # TTFT 2.0: misses TTFT
        rec(2, 2.0, [2.2, 2.6, 3.0]),                  # TPOT 0.4: misses TPOT
        rec(3, 3.0, [3.1], end=4.0),                   # 1 token: meets
        rec(4, 3.5, [], error="server error", finished=False),  # failed: a miss
    ]
    s = summarize(records, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert s.num_requests == 5 and s.completed == 4 and s.failed == 1
    assert s.duration_s == pytest.approx(4.0)  # first send 0.0 .. last end 4.0
    assert s.request_throughput == pytest.approx(1.0)
    assert s.total_output_tokens == 9 and s.output_token_throughput == pytest.approx(9 / 4)
    assert s.responses_per_s == pytest.approx(9 / 4) and s.tokens_per_response == pytest.approx(1.0)
    merged = summarize([rec(0, 0.0, [0.5, 1.0], [1, 3]), rec(1, 0.0, [0.5, 1.0], [2, 2])], 1.0, 1.0)
    assert merged.responses_per_s == pytest.approx(4 / 1.0) and merged.tokens_per_response == pytest.approx(2.0)
    assert summarize([rec(0, 0.0, [], error="refused")], 1.0, 1.0).tokens_per_response is None
    assert s.total_input_tokens == 40
    assert s.slo_met == 2 and s.slo_attainment == pytest.approx(0.4) and s.goodput == pytest.approx(0.5)
    assert s.ttft_s["p50"] == pytest.approx(np.percentile([0.5, 2.0, 0.2, 0.1], 50))
    assert s.tpot_s["n"] == 3 and s.tpot_s["mean"] == pytest.approx((0.1 + 0.1 + 0.4) / 3)
    assert s.itl_s["n"] == 5  # 2 + 1 + 2 gaps
    assert s.errors == {"server error": 1}
    assert slo_attainment([0.5, 2.0, None], [0.1, None, None], 1.0, 0.1, [True, True, False]) == pytest.approx(1 / 3)


def test_record_json_round_trip():
    r = rec(7, 0.5, [0.75, 1.0], [1, 3])
    d = r.to_json(token_times=True)
    back = RequestRecord.from_json(d)
    assert back.ttft == pytest.approx(r.ttft) and back.tpot == pytest.approx(r.tpot)
    assert d["ttft_s"] == 0.25 and d["tpot_s"] == pytest.approx(0.25 / 3, abs=1e-6) and d["num_chunks"] == 2


# ---------------------------------------------------------------------------------------------
# report: JSON per run, summary.md, plots, --compare re-scoring
# ---------------------------------------------------------------------------------------------

def _fake_run(out_dir, label, rate, ttft, seed=0, late=0):
    """Four requests with the given TTFT, the first `late` of them 1 s late instead."""
    from bullet_trt.tools.bench.results import write_result
    w = ds.build_workload("sharegpt", rate, 4, seed=seed, prompts=False)
    records = [rec(i, r.arrival_s, [r.arrival_s + (1.0 if i < late else ttft) + 0.01 * k for k in range(3)])
               for i, r in enumerate(w.requests)]
    return write_result(out_dir, label=label, dataset="sharegpt", rate=rate, seed=seed, backend="test",
                        records=records, workload=w, ttft_slo_ms=100.0, tpot_slo_ms=50.0)


def test_labels_spelling_long_settings_name_distinct_files(tmp_path):
    """The failure this guards: a label naming every CUDA-graph size and prefill piece made a
    file name past the file system's 255 bytes, and the benchmark died before serving."""
    from bullet_trt.tools.bench.results import SLUG_MAX_CHARS, load_results
    graphs = ",".join(str(n) for n in range(8, 1544, 8))
    labels = [f"moe-chunked-3072-cuda_graph_batch_sizes=[{graphs}]-piecewise_graph_tokens=[{end}]-chunked"
              for end in ("2048,3072", "2048,4096")]
    paths = [_fake_run(tmp_path, label, 1.0, 0.05)[0] for label in labels]
    assert paths[0] != paths[1]
    assert all(len(p.name) < 255 and len(p.name.split("__")[0]) <= SLUG_MAX_CHARS for p in paths)
    assert sorted(d["label"] for d in load_results(tmp_path)) == sorted(labels)


def test_report_table_plots_and_compare(tmp_path, capsys):
    from bullet_trt.tools.bench import serve_bench
    _fake_run(tmp_path, "chunked", 1.0, 0.05)
    _fake_run(tmp_path, "chunked", 2.0, 0.2)
    _, doc = _fake_run(tmp_path, "bullet", 1.0, 0.05)
    assert doc["summary"]["slo_attainment"] == 1.0
    (tmp_path / "unrelated.json").write_text('{"hello": 1}')
    assert serve_bench.main(["--compare", str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    runs_table = md.split("## Sustained")[0]
    rows = [line for line in runs_table.splitlines() if line.startswith("| ") and "label" not in line]
    assert len(rows) == 3 and rows[0].startswith("| bullet | sharegpt | 1 | 0 | 4/4")
    assert "| chunked | sharegpt | 2 | 0 | 4/4" in md and "| 0.0% |" in md  # TTFT 200 ms > 100 ms
    assert "| 0.0% | 0 / 4 / 0 |" in md and "| 100.0% | 0 / 0 / 0 |" in md  # missed: failed / TTFT / TPOT
    for png in ("slo_attainment_sharegpt.png", "latency_cdf_sharegpt_rate1.png", "latency_cdf_sharegpt_rate2.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # re-scored with a looser TTFT SLO, from the per-request values in the JSON
    assert serve_bench.main(["--compare", str(tmp_path), "--ttft-slo-ms", "500", "--no-plots"]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "TTFT <= 500 ms" in md and "| 0.0% |" not in md and "0 / 4 / 0" not in md  # misses re-scored too
    # a report under another SLO beside the runs, leaving the directory's own summary alone
    report = tmp_path / "ttft150"
    assert serve_bench.main(["--compare", str(tmp_path), "--ttft-slo-ms", "150", "--report-dir", str(report)]) == 0
    assert "TTFT <= 150 ms" in (report / "summary.md").read_text()
    assert "TTFT <= 500 ms" in (tmp_path / "summary.md").read_text()
    assert (report / "slo_attainment_sharegpt.png").stat().st_size > 1000


def test_compare_over_several_directories_and_files(tmp_path):
    """A mode's runs from several rounds share one table: directories and single result files,
    a file reached twice counted once; a report of several sources must be told where to go."""
    from bullet_trt.tools.bench import serve_bench
    round1, round2, report = tmp_path / "round1", tmp_path / "round2", tmp_path / "report"
    _fake_run(round1, "bullet", 1.0, 0.05)
    _fake_run(round1, "chunked", 1.0, 0.05)
    in_round2, _ = _fake_run(round2, "bullet", 2.0, 0.05)
    one_file, _ = _fake_run(tmp_path / "round3", "bullet", 3.0, 0.2)
    _fake_run(tmp_path / "round3", "chunked", 3.0, 0.05)  # in the directory, not named
    assert serve_bench.main(["--compare", str(round1), str(round2), str(one_file), str(in_round2),
                             "--report-dir", str(report), "--no-plots"]) == 0
    md = (report / "summary.md").read_text()
    runs = [line for line in md.split("## Sustained")[0].splitlines() if line.startswith("| ") and "label" not in line]
    assert sorted(r.split(" | ")[0] + " " + r.split(" | ")[2] for r in runs) == [
        "| bullet 1", "| bullet 2", "| bullet 3", "| chunked 1"]
    assert "| sharegpt | bullet | 2 | 3 |" in md  # 3 req/s missed (TTFT 200 ms > 100 ms): the ladder spans rounds
    assert not (round1 / "summary.md").exists()
    with pytest.raises(SystemExit, match="--report-dir"):
        serve_bench.main(["--compare", str(round1), str(round2), "--no-plots"])
    with pytest.raises(SystemExit, match="--report-dir"):
        serve_bench.main(["--compare", str(one_file), "--no-plots"])
    with pytest.raises(SystemExit, match="no such result file or directory"):
        serve_bench.main(["--compare", str(tmp_path / "missing"), "--report-dir", str(report)])
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    with pytest.raises(SystemExit, match="not a benchmark result"):
        serve_bench.main(["--compare", str(tmp_path / "notes.json"), "--report-dir", str(report)])


def test_sustained_rate_averages_repeats_and_stops_at_the_first_miss(tmp_path):
    from bullet_trt.tools.bench import capacity
    from bullet_trt.tools.bench.report import rebuild_report
    from bullet_trt.tools.bench.results import load_results
    # chunked: 100% at 1, then 75% and 100% at 2 (mean 87.5% < 90%), 100% at 3
    _fake_run(tmp_path, "chunked", 1.0, 0.05)
    _fake_run(tmp_path, "chunked", 2.0, 0.05, seed=0, late=1)
    _fake_run(tmp_path, "chunked", 2.0, 0.05, seed=1)
    _fake_run(tmp_path, "chunked", 3.0, 0.05)
    # bullet: 100% at 1 and 2, 75% + 100% + 100% at 3 (mean 91.7%), 0% at 4
    for rate in (1.0, 2.0):
        _fake_run(tmp_path, "bullet", rate, 0.05)
    for seed, late in ((0, 1), (1, 0), (2, 0)):
        _fake_run(tmp_path, "bullet", 3.0, 0.05, seed=seed, late=late)
    _fake_run(tmp_path, "bullet", 4.0, 0.05, late=4)
    assert (tmp_path / "bullet__sharegpt__rate3__seed2.json").is_file()
    docs = load_results(tmp_path)
    caps = {c.label: c for c in capacity.capacities([(d, d["summary"]["slo_attainment"], None) for d in docs])}
    assert caps["chunked"].sustained == 1.0 and caps["chunked"].first_miss == 2.0  # 3 does not count
    assert caps["bullet"].sustained == 3.0 and caps["bullet"].first_miss == 4.0
    assert caps["bullet"].attainment[3.0] == [0.75, 1.0, 1.0]
    rebuild_report(tmp_path, plots=False)
    md = (tmp_path / "summary.md").read_text()
    # the edges lie in [3, 4) and [1, 2): the ratio between 3/2 and 4/1
    assert "| sharegpt | bullet | 3 | 4 | 3.00x [1.50x-4.00x] chunked |" in md
    bullet_edge_unknown = dataclasses.replace(caps["bullet"], first_miss=None)
    assert capacity.ratio_bracket(bullet_edge_unknown, caps["chunked"]) == "[1.50x-?]"


def test_an_interrupted_run_is_left_out_of_its_rates_mean_and_a_decided_one_is_not():
    from bullet_trt.tools.bench import capacity

    def doc(label, seed, stopped=None):
        return {"label": label, "dataset": "sharegpt", "rate": 2.0, "seed": seed, "stopped_early": stopped}
    scored = [(doc("bullet", 0), 0.95, 0.92), (doc("bullet", 1), 0.93, 0.91),
              # cut by a time limit with a quarter of its requests unfinished, counted as misses
              (doc("bullet", 2, "interrupted"), 0.70, 0.40),
              (doc("chunked", 0), 0.95, 0.95),
              (doc("chunked", 1, "decided: 31 of 100 requests missed the SLO"), 0.69, 0.2)]
    caps = {c.label: c for c in capacity.capacities(scored)}
    assert caps["bullet"].attainment[2.0] == [0.95, 0.93] and caps["bullet"].sustained == 2.0
    assert caps["chunked"].attainment[2.0] == [0.95, 0.69] and caps["chunked"].first_miss == 2.0


def test_a_run_cut_in_its_drain_counts_as_a_lower_bound_that_can_pass_but_not_fail_a_rate():
    from bullet_trt.tools.bench import capacity

    def doc(label, rate, seed, stopped=None, unsent=0):
        requests = [{"sent_s": None if i < unsent else float(i)} for i in range(10)]
        return {"label": label, "dataset": "sharegpt", "rate": rate, "seed": seed, "stopped_early": stopped,
                "requests": requests}
    cut = "interrupted"
    scored = [(doc("bullet", 2.0, 0), 0.99, 0.97),
              (doc("bullet", 2.0, 1, cut), 0.98, 0.96), (doc("bullet", 2.0, 2, cut), 0.97, 0.95),
              # at 3: one whole run passes; the cut one, far lower, cannot make the rate a miss
              (doc("bullet", 3.0, 0), 0.95, 0.93), (doc("bullet", 3.0, 1, cut), 0.50, 0.10),
              # interrupted before it sent everything: left out altogether
              (doc("bullet", 4.0, 0, cut, unsent=3), 0.99, 0.99)]
    (cap,) = capacity.capacities(scored)
    assert cap.attainment[2.0] == [0.99, 0.98, 0.97] and cap.lower_bounds == {2.0: 2, 3.0: 1}
    assert cap.sustained == 3.0 and cap.first_miss is None and 4.0 not in cap.attainment
    assert "2: 98.0% [97%-99%] n=3 (2 of them cut in their drain: a lower bound)" in capacity.markdown([cap])
    # with no whole run to decide it, a failing lower bound leaves the rate unsustained
    (alone,) = capacity.capacities([(doc("static", 2.0, 0, cut), 0.5, 0.1)])
    assert alone.sustained is None and alone.first_miss == 2.0


def test_a_cut_run_without_a_last_third_leaves_the_whole_runs_their_own_last_thirds():
    """The whole runs decide a rate a lower bound fails, by their own figures: a cut run whose
    last third was not scored must not take a whole run's last third with it."""
    from bullet_trt.tools.bench import capacity

    def doc(seed, stopped=None):
        return {"label": "bullet", "dataset": "sharegpt", "rate": 2.0, "seed": seed, "stopped_early": stopped,
                "requests": [{"sent_s": 0.0}]}
    (cap,) = capacity.capacities([(doc(0), 0.95, 0.80), (doc(1, "interrupted"), 0.50, None)])
    assert cap.lower_bounds == {2.0: 1} and cap.tail_attainment == {2.0: [0.80]}
    assert cap.sustained is None and cap.first_miss == 2.0  # the whole run's last third misses


def _queued_run(out_dir, label, first_token_at, seed=0, n=30, tokens=11):
    """n requests arriving 1 s apart, each streaming `tokens` tokens 0.1 s apart from the time
    first_token_at(i) gives request i."""
    from bullet_trt.tools.bench.results import write_result
    w = ds.build_workload("sharegpt", 1.0, n, seed=seed, prompts=False)
    records = []
    for i in range(n):
        first = first_token_at(i)
        r = rec(i, float(i), [first + 0.1 * k for k in range(tokens)])
        r.scheduled_s = float(i)
        records.append(r)
    return write_result(out_dir, label=label, dataset="sharegpt", rate=1.0, seed=seed, backend="test",
                        records=records, workload=w, ttft_slo_ms=1000.0, tpot_slo_ms=150.0)[1]


def test_steady_state_tells_a_server_that_keeps_up_from_one_whose_queue_grows(tmp_path):
    from bullet_trt.tools.bench.steady_state import steady_state
    kept_up = steady_state(_queued_run(tmp_path, "kept-up", lambda i: i + 0.05), 1.0, 0.15)
    assert kept_up.tail_attainment == 1.0
    assert kept_up.served_tok_s == pytest.approx(kept_up.offered_tok_s, rel=0.1)
    # the server delivers one request's tokens per 2 s: its queue grows by one request every 2 s
    behind = steady_state(_queued_run(tmp_path, "behind", lambda i: 2.0 * i + 0.05), 1.0, 0.15)
    assert behind.tail_attainment == 0.0
    assert behind.served_tok_s < 0.6 * behind.offered_tok_s
    assert behind.offered_tok_s == pytest.approx(kept_up.offered_tok_s)


def test_bench_steady_shows_where_in_its_arrivals_a_run_stopped_keeping_up(tmp_path, capsys):
    from bullet_trt.tools.bench.cli import main as bench_main
    from bullet_trt.tools.bench.steady_state import attainment_by_window
    doc = _queued_run(tmp_path, "late-tail", lambda i: i + (2.0 if i >= 27 else 0.05))
    assert attainment_by_window(doc, 1.0, 0.15, 3) == [1.0, 1.0, 0.7]
    assert bench_main(["steady", str(tmp_path / "late-tail__sharegpt__rate1.json"), "--windows", "3"]) == 0
    out = capsys.readouterr().out
    assert "late-tail sharegpt 1 req/s seed 0: attainment in 3 parts of the arrivals 100 100 70; " \
           "first half 100.0%, whole 90.0%; last third 70.0%" in out
    assert "TTFT p50 per part 50 50 50 ms; TPOT p50 per part 100 100 100 ms" in out


def test_streaming_rows_weigh_each_count_by_how_long_it_lasted():
    from bullet_trt.tools.bench.steady_state import streaming_rows

    def streams(*spans):
        return {"requests": [{"sent_s": a, "ttft_s": 0.0, "e2e_s": b - a} for a, b in spans]}
    # one stream over the whole window, a second over its last 3 s of 10: 1 for 70% of the time, 2 for 30%
    doc = streams((0.0, 10.0), (7.0, 12.0))
    assert streaming_rows(doc, (0.0, 10.0)) == (1.0, 2.0)
    assert streaming_rows(doc, (7.5, 9.5)) == (2.0, 2.0)  # both stream throughout
    # a request that never ended is not counted; nothing streaming at all gives nothing
    doc["requests"].append({"sent_s": 0.0, "ttft_s": 0.1, "e2e_s": None})
    assert streaming_rows(doc, (0.0, 10.0)) == (1.0, 2.0)
    assert streaming_rows(streams((0.0, 1.0)), (2.0, 3.0)) is None


def test_bench_steady_shows_a_tpot_still_climbing_when_the_arrivals_stopped(tmp_path):
    from bullet_trt.tools.bench.results import write_result
    from bullet_trt.tools.bench.steady_state import median_by_window
    # every request meets the SLO, but the later it arrived the slower its tokens came: a
    # decode batch that was still growing
    n = 30
    w = ds.build_workload("sharegpt", 1.0, n, seed=0, prompts=False)
    records = []
    for i in range(n):
        gap = 0.01 * (1 + i // 10)  # 10, 20, 30 ms between tokens in the three thirds
        r = rec(i, float(i), [i + 0.25 + gap * k for k in range(11)])
        r.scheduled_s = float(i)
        records.append(r)
    doc = write_result(tmp_path, label="climbing", dataset="sharegpt", rate=1.0, seed=0, backend="test",
                       records=records, workload=w, ttft_slo_ms=1000.0, tpot_slo_ms=50.0)[1]
    assert doc["summary"]["slo_attainment"] == 1.0
    assert median_by_window(doc, "tpot_s", 3) == pytest.approx([0.01, 0.02, 0.03])
    assert median_by_window(doc, "ttft_s", 3) == pytest.approx([0.25, 0.25, 0.25])
    # a part whose requests all failed has no median
    for r in doc["requests"][20:]:
        r["finished"] = False
    assert median_by_window(doc, "tpot_s", 3)[2] is None


def test_a_rate_whose_last_third_misses_is_not_sustained_however_good_the_whole_run(tmp_path):
    from bullet_trt.tools.bench.report import rebuild_report
    # 27 of 30 requests meet the SLO (90%), but the three misses are the last arrivals: 70% of
    # the last third
    doc = _queued_run(tmp_path, "late-tail", lambda i: i + (2.0 if i >= 27 else 0.05))
    assert doc["summary"]["slo_attainment"] == pytest.approx(0.9)
    _queued_run(tmp_path, "even", lambda i: i + (2.0 if i % 10 == 0 else 0.05), seed=1)  # 90% both ways
    rebuild_report(tmp_path, plots=False)
    md = (tmp_path / "summary.md").read_text()
    assert "| sharegpt | late-tail | - | 1 | - | 1: 90.0% | 1: 70.0% |" in md
    assert "| sharegpt | even | 1 | - | - | 1: 90.0% | 1: 90.0% |" in md
    assert "| 70.0% |" in md  # the per-run column


def test_compare_reads_compressed_results_beside_plain_ones(tmp_path):
    import gzip
    import lzma
    from bullet_trt.tools.bench.report import rebuild_report
    from bullet_trt.tools.bench.results import load_results
    path, _ = _fake_run(tmp_path, "chunked", 1.0, 0.05)
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    path, _ = _fake_run(tmp_path, "static", 1.0, 0.05)
    path.with_name(path.name + ".xz").write_bytes(lzma.compress(path.read_bytes()))
    path.unlink()
    _fake_run(tmp_path, "bullet", 1.0, 0.05)
    (tmp_path / "broken.json.gz").write_bytes(b"not gzip")
    (tmp_path / "broken.json.xz").write_bytes(b"not xz")
    docs = load_results(tmp_path)
    assert sorted(d["label"] for d in docs) == ["bullet", "chunked", "static"]
    rebuild_report(tmp_path, plots=False)
    md = (tmp_path / "summary.md").read_text()
    assert "| chunked | sharegpt | 1 | 0 | 4/4" in md and "| static | sharegpt | 1 | 0 | 4/4" in md


def test_gpu_telemetry_summary_covers_the_arrival_window_only():
    from bullet_trt.spatial.gpu_monitor import summarize_telemetry
    arriving = [{"t": float(i), "sm_clock_mhz": 1500 + 10 * i, "power_w": 600.0 + i,
                 "power_capped": i % 2 == 0} for i in range(11)]
    drain = [{"t": 20.0, "sm_clock_mhz": 1980, "power_w": 200.0, "power_capped": False}]
    t = summarize_telemetry(arriving + drain, until_s=10.0)
    assert t["samples"] == 11
    assert t["sm_clock_mhz"] == {"p10": 1510.0, "p50": 1550.0, "p90": 1590.0}
    assert t["power_w"]["p50"] == 605.0
    assert t["power_capped_fraction"] == round(6 / 11, 3)
    assert t["gpu_sm_util_pct"] is None  # a counter the driver never gave
    assert summarize_telemetry(arriving + drain)["samples"] == 12


def test_gpu_telemetry_leaves_out_what_nvml_refuses():
    from bullet_trt.spatial.gpu_monitor import read_sample

    class Utilization:
        gpu, memory = 97, 41

    class PartialNvml:  # a driver that exposes utilization and clocks but neither power nor reasons
        NVML_CLOCK_SM = 1

        def nvmlDeviceGetUtilizationRates(self, handle):
            return Utilization()

        def nvmlDeviceGetClockInfo(self, handle, which):
            assert which == 1
            return 1755

        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("not supported")

    assert read_sample(PartialNvml(), object()) == {"gpu_sm_util_pct": 97, "gpu_mem_util_pct": 41,
                                                    "sm_clock_mhz": 1755}


def test_gpu_telemetry_device_choice_and_absence():
    import types
    from bullet_trt.tools.bench.report import format_row
    from bullet_trt.tools.bench.telemetry import telemetry_device, telemetry_fields
    from bullet_trt.spatial.gpu_monitor import GpuMonitor, TelemetrySampler
    args = types.SimpleNamespace(gpu_telemetry="auto")
    assert telemetry_device(args, "localhost:8001") == 0
    assert telemetry_device(args, "gpu-box.example:8001") is None
    args.gpu_telemetry = "3"
    assert telemetry_device(args, "gpu-box.example:8001") == 3
    args.gpu_telemetry = "off"
    assert telemetry_device(args, "localhost:8001") is None
    args.gpu_telemetry = "fast"
    with pytest.raises(SystemExit, match="--gpu-telemetry"):
        telemetry_device(args, "localhost:8001")
    # No device: nothing sampled, nothing written, no clause in the printed row.
    sampler = TelemetrySampler(None).start()
    assert sampler.stop() == [] and not sampler.available and telemetry_fields(sampler, 10.0) == {}
    assert GpuMonitor(None).sample() == {}
    s = {"completed": 1, "num_requests": 1, "request_throughput": 1.0, "output_token_throughput": 2.0,
         "ttft_s": {"p50": 0.1, "p99": 0.2}, "tpot_s": {"p50": 0.01, "p99": 0.02},
         "slo_attainment": 1.0, "goodput": 1.0}
    doc = {"label": "bullet", "dataset": "sharegpt", "rate": 4, "summary": s}
    assert "SM clock" not in format_row(doc) and "responses/s" not in format_row(doc)  # an older run's summary
    s.update(responses_per_s=1.5, tokens_per_response=1.33)
    assert "2.0 out tok/s, 2 responses/s (1.33 tokens each), TTFT p50 100.0 ms" in format_row(doc)
    doc["gpu_telemetry"] = {"summary": {"sm_clock_mhz": {"p50": 1620.0}, "power_w": {"p50": 688.0},
                                        "power_capped_fraction": 0.75}}
    assert format_row(doc).endswith("SM clock p50 1620 MHz, power p50 688 W, power-capped 75% of samples")
    doc["gpu_telemetry"]["summary"]["gpu_sm_util_pct"] = {"p10": 35.0, "p50": 54.0, "p90": 100.0}
    assert format_row(doc).endswith("power-capped 75% of samples, busy p50 54%")


def test_rates_parsing():
    from bullet_trt.tools.bench.workload_args import parse_rates
    assert parse_rates("1, 2,4.5") == [1.0, 2.0, 4.5]
    assert parse_rates(None) == [None] and parse_rates("native,2") == [None, 2.0]
    with pytest.raises(SystemExit, match="> 0"):
        parse_rates("1,0")
    with pytest.raises(SystemExit, match="req/s"):
        parse_rates("fast")


# ---------------------------------------------------------------------------------------------
# the transformers peer's replay loop (a fake manager: no model)
# ---------------------------------------------------------------------------------------------

class FakeManager:
    """add_request / get_result like transformers' ContinuousBatchingManager; each request
    produces its tokens 1 ms apart on a background thread."""

    def __init__(self, timestamps: bool):
        import queue
        self.q = queue.Queue()
        self.timestamps = timestamps
        self.added = []

    def _gen(self, rid, n, streaming, record):
        from types import SimpleNamespace
        toks, stamps = [], []
        for i in range(n):
            time.sleep(0.001)
            toks.append(i)
            stamps.append(time.perf_counter())
            last = i == n - 1
            if streaming or last:
                self.q.put(SimpleNamespace(request_id=rid, generated_tokens=list(toks), error=None,
                                           timestamps=list(stamps) if record else None,
                                           is_finished=lambda last=last: last))

    def get_result(self, request_id=None, timeout=None):
        import queue
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None


class FakeManagerTS(FakeManager):
    def add_request(self, input_ids, request_id=None, max_new_tokens=None, streaming=False,
                    record_timestamps=False, eos_token_id=None):
        self.added.append((request_id, len(input_ids), max_new_tokens, eos_token_id))
        threading.Thread(target=self._gen, args=(request_id, max_new_tokens, streaming, record_timestamps)).start()
        return request_id


class FakeManagerStream(FakeManager):
    def add_request(self, input_ids, request_id=None, max_new_tokens=None, streaming=False):
        self.added.append((request_id, len(input_ids), max_new_tokens, None))
        threading.Thread(target=self._gen, args=(request_id, max_new_tokens, streaming, False)).start()
        return request_id


@pytest.mark.parametrize("cls", [FakeManagerTS, FakeManagerStream])
def test_peer_runner_replays_open_loop(cls):
    from bullet_trt.tools.bench.hf_peer import PeerRunner
    w = ds.build_workload("azure-code", 200.0, 6, seed=0, prompts=False, max_output_tokens=5)
    for r in w.requests:
        r.prompt_ids = list(range(r.input_tokens))
    mgr = cls(timestamps=cls is FakeManagerTS)
    runner = PeerRunner(mgr)
    assert runner.timestamps == (cls is FakeManagerTS)
    records, stopped = runner.run(w.requests, timeout_s=60, drain_timeout_s=60)
    assert stopped is None
    assert [a[2] for a in mgr.added] == [r.output_tokens for r in w.requests]
    if cls is FakeManagerTS:
        assert all(a[3] == -1 for a in mgr.added)  # end tokens disabled: exact output lengths
    for rec_, req in zip(records, w.requests):
        assert rec_.ok and rec_.num_output_tokens == req.output_tokens
        assert rec_.num_input_tokens == req.input_tokens
        assert rec_.sent_s >= req.arrival_s and rec_.ttft > 0
        assert rec_.tpot is None or rec_.tpot > 0


# ---------------------------------------------------------------------------------------------
# end to end: `bench serve` against the real tritonserver
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.triton_fixture import start_server
    srv = start_server(tmp_path_factory.mktemp("bench-triton"))
    yield srv
    srv.stop()


def test_serve_bench_end_to_end(server, tmp_path, capsys):
    from bullet_trt.tools.bench import serve_bench
    from tests.triton_fixture import ensure_tiny_random_engine
    out = tmp_path / "results"
    rc = serve_bench.main(["--url", server.grpc_url, "--engine-dir", str(ensure_tiny_random_engine()),
                           "--dataset", "sharegpt", "--rates", "50", "--num-requests", "8", "--seed", "3",
                           "--max-output-tokens", "4", "--label", "chunked", "--warmup", "1",
                           "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "chunked__sharegpt__rate50__seed3.json").read_text())
    s = doc["summary"]
    assert s["num_requests"] == 8 and s["completed"] == 8 and s["failed"] == 0, s["errors"]
    assert doc["stopped_early"] is None
    for r in doc["requests"]:
        assert r["finished"] and r["error"] is None
        assert r["num_output_tokens"] == r["max_tokens"] <= 4  # min_tokens = max_tokens
        assert r["num_input_tokens"] == r["input_tokens"]  # prompts sized with the engine's tokenizer
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
    assert s["total_output_tokens"] == sum(r["max_tokens"] for r in doc["requests"])
    assert s["ttft_s"]["n"] == 8 and s["request_throughput"] > 0
    md = (out / "summary.md").read_text()
    assert "| chunked | sharegpt | 50 | 3 | 8/8 |" in md
    assert (out / "slo_attainment_sharegpt.png").stat().st_size > 1000
    assert (out / "latency_cdf_sharegpt_rate50.png").stat().st_size > 1000
    printed = capsys.readouterr()
    assert "chunked sharegpt 50 req/s seed 3: 8/8 done" in printed.out
    assert "sent 8/8" in printed.err  # the progress line


def test_loadgen_ends_a_request_its_error_names_at_once(server):
    """The gRPC stream hands an error over without its request's id; the model's message names
    it, so the load generator ends that request as failed and the run does not wait its drain
    for a final response that will never come (it did, on a GPU's failed prefill step)."""
    from bullet_trt.tools.bench.datasets import BenchRequest
    from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions
    requests = [BenchRequest(i, 0.05 * i, 4, out, prompt="hello there") for i, out in enumerate([3, 100000, 3])]
    res = LoadGenerator(server.grpc_url, LoadGenOptions(drain_timeout_s=60, timeout_s=120)).run(requests)
    assert res.stopped_early is None and res.notes == [], (res.stopped_early, res.notes)
    first, refused, last = res.records
    assert first.ok and last.ok
    assert not refused.finished and refused.end_s is not None
    # recorded without the id, so that a report counts errors by what they say
    assert refused.error.startswith("max_tokens must be <= 1023"), refused.error


def test_a_rate_is_decided_once_its_mean_attainment_cannot_reach_the_target():
    from bullet_trt.tools.bench.decided import misses_that_decide, rate_failed
    # three repeats, none measured: this run may miss 30% (its two successors at 100% would
    # bring the mean to 90%), so the 31st miss in 100 requests decides
    assert misses_that_decide(100, [], 2, 0.9) == 31
    assert misses_that_decide(100, [], 0, 0.9) == 11  # one run: the 11th miss
    assert misses_that_decide(100, [1.0, 1.0], 0, 0.9) == 31
    assert misses_that_decide(100, [0.5], 1, 0.9) == 0  # already decided: 0.5 + 1 + 1 < 2.7
    assert misses_that_decide(100, [], 2, 0.3) is None  # this run alone cannot decide
    assert rate_failed([0.69], 2, 0.9) and not rate_failed([0.71], 2, 0.9)
    assert rate_failed([1.0, 1.0, 0.6], 0, 0.9) and not rate_failed([1.0, 1.0, 0.7], 0, 0.9)


def test_a_run_whose_last_third_fell_behind_decides_its_rate():
    """The H200's 50 req/s at TPOT <= 50 ms (2026-11-26): 72.0% over the run, 15.1% over its
    last third. Two perfect seeds would lift the run's mean to 90.7%, not its last thirds'
    (71.7%), and a sustained rate needs both: the seeds still queued elsewhere can go."""
    from bullet_trt.tools.bench.decided import protocol_failed, rate_failed
    assert not rate_failed([0.72], 2, 0.9)
    assert protocol_failed([0.72], [0.151], 2, 0.9)
    assert not protocol_failed([0.72], [0.71], 2, 0.9)  # (0.71 + 2) / 3 = 0.903: still open
    assert not protocol_failed([0.95], [], 2, 0.9)  # no last third scored: the run's mean alone
    assert protocol_failed([0.5], [], 1, 0.9)


def test_seeds_measured_elsewhere_count_as_runs_to_come():
    """One seed per GPU: a sweep of seeds 100-101 whose seed 102 runs on another GPU decides
    over three runs. Told only of its own two, a second run after 87.5% would stop at its
    9th miss in 100, which the third seed could have made up."""
    from bullet_trt.tools.bench.decided import misses_that_decide, runs_to_come
    keys = [("sharegpt", 16), ("sharegpt", 16), ("sharegpt", 18)]
    assert runs_to_come(keys, 0, 0) == 1 and runs_to_come(keys, 1, 0) == 0
    assert runs_to_come(keys, 1, 1) == 1 and runs_to_come(keys, 2, 2) == 2
    assert misses_that_decide(100, [0.875], runs_to_come(keys, 1, 0), 0.9) == 8
    assert misses_that_decide(100, [0.875], runs_to_come(keys, 1, 1), 0.9) == 18


def test_decide_over_fewer_runs_than_the_sweep_repeats_is_refused(capsys):
    from bullet_trt.tools.bench import serve_bench
    with pytest.raises(SystemExit, match="--decide-over must be >= --repeats \\(3\\), got 2"):
        serve_bench.main(["--dataset", "sharegpt", "--rates", "4", "--repeats", "3", "--decide-over", "2",
                          "--stop-when-decided", "--no-progress", "--out", "unused"])


def test_a_sweep_stops_a_decided_rate_and_skips_what_it_cannot_change(server, tmp_path, capsys):
    """Every request misses a 1 us TTFT SLO: the first run stops once 30% of its requests
    have missed (the other two repeats could not lift the mean to 90%), and neither the
    rate's other repeats nor the higher rate run. The server cancels what was in flight."""
    from bullet_trt.tools.bench import serve_bench
    from tests.triton_fixture import ensure_tiny_random_engine
    out = tmp_path / "results"
    rc = serve_bench.main(["--url", server.grpc_url, "--engine-dir", str(ensure_tiny_random_engine()),
                           "--dataset", "sharegpt", "--rates", "4,8", "--repeats", "3", "--duration", "60",
                           "--max-output-tokens", "4", "--ttft-slo-ms", "0.001", "--stop-when-decided",
                           "--warmup", "1", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    assert sorted(p.name for p in out.glob("*.json")) == ["server__sharegpt__rate4.json"]
    doc = json.loads((out / "server__sharegpt__rate4.json").read_text())
    assert doc["stopped_early"].startswith("decided: "), doc["stopped_early"]
    n = doc["summary"]["num_requests"]
    assert doc["summary"]["slo_attainment"] == 0.0
    assert sum(r["sent_s"] is None for r in doc["requests"]) > n // 2  # stopped well before its end
    # every request missed (the unsent ones as unfinished), and no goodput over a cut span
    unsent = sum(r["sent_s"] is None for r in doc["requests"])
    row = re.search(r"\| 0\.0% \| (\d+) / (\d+) / 0 \| - \(stopped\) \|", (out / "summary.md").read_text())
    assert row is not None
    failed, late = map(int, row.groups())
    assert failed >= unsent and failed + late == n
    printed = capsys.readouterr().out
    assert printed.count("skipped, the sweep has decided that 4 req/s misses the target") == 5
    md = (out / "summary.md").read_text()
    assert "| sharegpt | server | - | 4 |" in md
    # one seed of a protocol whose other two run in other sweeps: its run decides for them too,
    # and says so, so that a queue of such sweeps can drop them (scripts/gpu_lists.sh)
    from bullet_trt.tools.bench.decided import DECIDED_ELSEWHERE
    rc = serve_bench.main(["--url", server.grpc_url, "--engine-dir", str(ensure_tiny_random_engine()),
                           "--dataset", "sharegpt", "--rates", "4", "--repeats", "1", "--decide-over", "3",
                           "--seed", "101", "--duration", "60", "--max-output-tokens", "4", "--ttft-slo-ms", "0.001",
                           "--stop-when-decided", "--warmup", "1", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"server sharegpt 4 req/s misses the target: {DECIDED_ELSEWHERE} (2 of its seeds run in other sweeps)" in printed


def test_a_run_starts_only_when_its_arrivals_and_a_drain_fit_the_time_left():
    import time
    from bullet_trt.tools.bench.run_budget import FIRST_DRAIN_S, MARGIN_S, RunBudget
    budget = RunBudget(150.0, started_at=time.monotonic() - 100.0)  # ~50 s left
    assert budget.fits(5.0) and not budget.fits(20.0)  # 5 + 30 + 10 fits in ~50; 20 + 30 + 10 does not
    assert budget.needs_s(5.0) == 5.0 + FIRST_DRAIN_S + MARGIN_S
    # a run that drained for 38 s: the next estimate takes the longest drain seen
    budget.ran({"summary": {"duration_s": 98.0}, "workload": {"last_arrival_s": 60.0}, "stopped_early": None})
    assert budget.needs_s(5.0) == pytest.approx(5.0 + 38.0 + MARGIN_S) and not budget.fits(5.0)
    # a run stopped early did not drain as a whole run does: it teaches nothing
    budget.ran({"summary": {"duration_s": 400.0}, "workload": {"last_arrival_s": 60.0}, "stopped_early": "decided"})
    assert budget.longest_drain_s == pytest.approx(38.0)
    assert "left" in budget.why(5.0)
    assert RunBudget(0.0, started_at=0.0).fits(1e9)  # no budget: everything runs


def test_a_sweep_does_not_start_a_run_its_time_budget_cannot_hold(server, tmp_path, capsys):
    """60 s of arrivals cannot end within a 50 s budget: no run starts, nothing is cut."""
    from bullet_trt.tools.bench import serve_bench
    from tests.triton_fixture import ensure_tiny_random_engine
    out = tmp_path / "results"
    rc = serve_bench.main(["--url", server.grpc_url, "--engine-dir", str(ensure_tiny_random_engine()),
                           "--dataset", "sharegpt", "--rates", "4,8", "--duration", "60",
                           "--max-output-tokens", "4", "--time-budget-s", "50", "--warmup", "1",
                           "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    assert not list(out.glob("*.json"))
    printed = capsys.readouterr()
    assert "server sharegpt 4 req/s: not started, nor the 1 after it: it needs ~100 s" in printed.out
    assert "--time-budget-s 50 spent" in printed.err


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    from tests.tiny_engine import LONG_CONTEXT, tiny_engine
    return tiny_engine(tmp_path_factory.mktemp("tiny-long") / "engine", max_model_len=LONG_CONTEXT)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, long_engine):
    from tests.triton_fixture import start_server
    srv = start_server(tmp_path_factory.mktemp("bench-triton-long"), engine_dir=long_engine)
    yield srv
    srv.stop()


def test_serve_bench_trace_replay_and_bounded_drain(long_server, long_engine, tmp_path):
    """A trace replayed at its own timing; requests still running at the drain timeout are
    cancelled and recorded as errors, and the run still writes its results. The drain must
    outlast the short requests on a loaded machine (0.5 s once did not, and a streaming client
    there once read a response 3.6 s late) and the long one must outlast the drain: it is held
    for HELD_TOKENS tokens, a step at least each, well past the drain on any machine."""
    from bullet_trt.tools.bench import serve_bench
    from tests.tiny_engine import HELD_TOKENS
    server = long_server
    trace = _write(tmp_path, f"arrival_time_s,input_tokens,output_tokens\n0.0,20,3\n0.05,30,3\n0.1,40,{HELD_TOKENS}\n")
    out = tmp_path / "results"
    rc = serve_bench.main(["--url", server.grpc_url, "--engine-dir", str(long_engine),
                           "--dataset", f"trace:{trace}", "--label", "t", "--warmup", "0", "--no-progress",
                           "--drain-timeout-s", "8", "--no-plots", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "t__trace-trace__rate20.json").read_text())
    reqs = doc["requests"]
    assert [r["finished"] for r in reqs] == [True, True, False]
    assert [r["num_input_tokens"] for r in reqs[:2]] == [20, 30]
    assert "no final response" in reqs[2]["error"] and "drain_timeout_s" in doc["stopped_early"]
    assert doc["summary"]["failed"] == 1 and doc["summary"]["slo_attainment"] <= 2 / 3
    # the server is still fine afterwards
    from tests.triton_fixture import GrpcStreams
    streams = GrpcStreams(server.grpc_url)
    try:
        res = streams.collect(streams.send({"text_input": "hello", "max_tokens": 2, "stream": True}))
        assert res.error is None and res.final
    finally:
        streams.close()


def test_hf_peer_replays_the_workload_on_cpu(tmp_path):
    from bullet_trt.tools.bench import hf_peer
    from tests.triton_fixture import ensure_tiny_random_engine
    out = tmp_path / "results"
    rc = hf_peer.main(["--engine-dir", str(ensure_tiny_random_engine()), "--dataset", "sharegpt", "--rates", "50",
                       "--num-requests", "6", "--max-output-tokens", "4", "--seed", "3", "--warmup", "1",
                       "--cb", "num_blocks=64", "--cb", "max_batch_tokens=1024", "--no-progress", "--no-plots",
                       "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "hf-cb__sharegpt__rate50__seed3.json").read_text())
    assert doc["backend"] == "transformers-continuous-batching" and doc["notes"]
    assert doc["summary"]["completed"] == 6
    # the same requests `bench serve` sends (same dataset, seed and caps)
    w = ds.build_workload("sharegpt", 50.0, 6, seed=3, max_model_len=1024, max_output_tokens=4, prompts=False)
    assert [(r["input_tokens"], r["max_tokens"], r["scheduled_s"]) for r in doc["requests"]] == \
           [(q.input_tokens, q.output_tokens, round(q.arrival_s, 6)) for q in w.requests]
    for r in doc["requests"]:
        assert r["num_output_tokens"] == r["max_tokens"] and r["ttft_s"] > 0


def test_requests_carry_top_p_and_top_k_only_when_given():
    from bullet_trt.tools.bench.loadgen import LoadGenOptions, build_inputs
    req = ds.BenchRequest(index=0, arrival_s=0.0, input_tokens=4, output_tokens=3, prompt="hi")

    def sent(opts: LoadGenOptions) -> dict:
        return {i.name(): i for i in build_inputs(req, opts)}

    plain = sent(LoadGenOptions(temperature=0.8))
    assert "top_p" not in plain and "top_k" not in plain
    both = sent(LoadGenOptions(temperature=0.8, top_p=0.9, top_k=50))
    assert (both["top_p"].datatype(), both["top_k"].datatype()) == ("FP32", "INT32")


def test_serve_bench_starts_a_server_per_mode(tmp_path):
    from bullet_trt.tools.bench import serve_bench
    out = tmp_path / "results"
    rc = serve_bench.main(["--start-server", "--modes", "chunked", "--dataset", "azure-code", "--rates", "20",
                           "--num-requests", "4", "--max-output-tokens", "3", "--warmup", "1", "--no-progress",
                           "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
                           "--no-plots", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "chunked__azure-code__rate20.json").read_text())
    assert doc["overrides"] == {"serve.mode": "chunked"} and doc["summary"]["completed"] == 4
    # the requests sampled (temperature, top-p, top-k through the server's sampler) and say so
    assert (doc["client"]["temperature"], doc["client"]["top_p"], doc["client"]["top_k"]) == (0.8, 0.9, 50)
    assert (out / "server_chunked.log").is_file()
    assert doc["engine_notes"] == engine_notes(out / "server_chunked.log")  # none from chunked on a CPU
    host = doc["host"]  # which machine: runs on different hosts differ at the same GPU clocks
    assert host["cpu"] and 1 <= host["usable_cores"] <= host["cores"]
    with pytest.raises(SystemExit, match="--top-p must lie in"):
        serve_bench.main(["--dataset", "sharegpt", "--rates", "1", "--top-p", "0", "--out", str(out)])
    with pytest.raises(SystemExit, match="mode static: serve.static_prefill_sms"):
        serve_bench.main(["--start-server", "--modes", "static", "--dataset", "sharegpt", "--rates", "1",
                          "--out", str(out)])


def test_a_started_servers_own_lines_about_its_settings_are_kept_and_tritons_are_not(tmp_path):
    log = tmp_path / "server_bullet.log"
    log.write_text(
        'I1126 00:56:38.407577 5205 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize"\n'
        "bullet_trt: performance model: calibrated on NVIDIA H200 (perf_model.nvidia-h200.yaml)\n"
        "bullet_trt: sized for this GPU (serve.sizing=engine keeps engine.yaml's values): "
        "serve.tpot_plan_fraction=1.0; serve.chunk_size=2048\n"
        "2026-11-26 00:58:05,553 bullet_trt.serving.triton INFO: bullet: engine ready\n")
    assert engine_notes(log) == [
        "performance model: calibrated on NVIDIA H200 (perf_model.nvidia-h200.yaml)",
        "sized for this GPU (serve.sizing=engine keeps engine.yaml's values): serve.tpot_plan_fraction=1.0; "
        "serve.chunk_size=2048"]
    assert engine_notes(tmp_path / "missing.log") == []


def test_the_report_says_what_each_started_server_said_and_the_gpus_clock_in_each_run(tmp_path):
    from bullet_trt.tools.bench.report import markdown_table
    from bullet_trt.tools.bench.results import load_results
    _fake_run(tmp_path, "bullet", 1.0, 0.05)
    _fake_run(tmp_path, "bullet", 2.0, 0.05)
    _fake_run(tmp_path, "chunked", 1.0, 0.05)
    sized = "sized for this GPU (serve.sizing=engine keeps engine.yaml's values): serve.tpot_plan_fraction=1.0"
    for path in tmp_path.glob("bullet__*.json"):
        doc = json.loads(path.read_text())
        doc["engine_notes"] = ["performance model: calibrated on NVIDIA H200", sized]
        doc["gpu_telemetry"] = {"summary": {"sm_clock_mhz": {"p50": 1635.0}, "power_w": {"p50": 690.3}}}
        path.write_text(json.dumps(doc))
    md = markdown_table(load_results(tmp_path))
    # the GPU's clock and power beside each run that sampled them
    assert md.count("| 1635 MHz / 690 W |") == 2 and md.count("| - |\n") == 1
    # and the share of time it ran a kernel, where sampled
    path = sorted(tmp_path.glob("bullet__*.json"))[0]
    doc = json.loads(path.read_text())
    doc["gpu_telemetry"]["summary"]["gpu_sm_util_pct"] = {"p50": 46.0}
    path.write_text(json.dumps(doc))
    md = markdown_table(load_results(tmp_path))
    assert md.count("| 1635 MHz / 690 W / 46% |") == 1 and md.count("| 1635 MHz / 690 W |") == 1
    # once per label, whatever its runs; a label whose server said nothing has no line
    assert md.count(f"- bullet: performance model: calibrated on NVIDIA H200 / {sized}") == 1
    assert "- chunked:" not in md


def test_started_servers_plan_for_the_slos_the_run_is_scored_against():
    from bullet_trt.tools.bench import serve_bench
    parser = serve_bench.build_parser()
    args = parser.parse_args(["--start-server", "--tpot-slo-ms", "40", "--set", "serve.chunk_size=512"])
    assert serve_bench.server_settings(args) == {"serve.tpot_slo_ms": "40", "serve.chunk_size": "512"}
    args = parser.parse_args(["--start-server", "--ttft-slo-ms", "2000", "--tpot-slo-ms", "40",
                              "--set", "serve.tpot_slo_ms=45"])
    assert serve_bench.server_settings(args) == {"serve.ttft_slo_ms": "2000", "serve.tpot_slo_ms": "45"}
    # what the server reads: the configuration the overrides make
    from bullet_trt.config import load_engine_config
    from tests.triton_fixture import ensure_tiny_random_engine
    cfg = load_engine_config(str(ensure_tiny_random_engine()), serve_bench.server_settings(args))
    assert (cfg.serve.ttft_slo_ms, cfg.serve.tpot_slo_ms) == (2000.0, 45.0)


def test_loadgen_ends_the_run_when_the_server_goes_away(tmp_path, tokenizer):
    """A broken gRPC stream fails the requests in flight at once (no wait for the drain
    timeout); unsent requests are recorded as not sent."""
    from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions
    from tests.triton_fixture import start_server
    srv = start_server(tmp_path, name="doomed")
    engine_pids = srv.engine_pids()  # the engine runs in a process group of its own
    try:
        w = ds.build_workload("sharegpt", 4.0, 40, seed=0, tokenizer=tokenizer, max_model_len=1024)
        gen = LoadGenerator(srv.grpc_url, LoadGenOptions(drain_timeout_s=3600, timeout_s=3600))

        def crash():  # like a crash: no graceful drain of the requests in flight
            os.killpg(srv.proc.pid, signal.SIGKILL)

        threading.Timer(1.0, crash).start()
        res = gen.run(w.requests)
    finally:
        srv.stop()
        # This test is about the client: do not leave the crashed server's engine behind
        # (it is meant to notice its parent's death; this test does not wait for that).
        for pid in engine_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert res.stopped_early and "gRPC stream failed" in res.stopped_early
    assert not any(r.ok for r in res.records[-5:])  # the last ones arrive ~9 s in, after the server died
    for r in res.records:
        assert r.ok or r.error  # every request ends: finished, failed, or not sent
    unsent = [r for r in res.records if r.sent_s is None]
    assert unsent and all(r.error.startswith("not sent") for r in unsent)


def test_gpu_telemetry_reads_the_gpu_cuda_numbers_not_nvmls_first():
    from bullet_trt.spatial.gpu_monitor import nvml_device
    # NVML counts every GPU of the host; a run started with CUDA_VISIBLE_DEVICES=1 serves on
    # NVML's GPU 1 while its CUDA device is 0.
    assert nvml_device(0, visible="1") == 1
    assert nvml_device(1, visible="3,2") == 2
    assert nvml_device(0, visible="GPU-8f0e1c2a-aaaa") == "GPU-8f0e1c2a-aaaa"
    assert nvml_device(2, visible="") == 2
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_device(1, visible="0")


def test_the_goodput_plot_leaves_out_runs_stopped_before_their_end():
    from bullet_trt.tools.bench.report_plots import per_rate
    runs = [{"rate": 24.0, "stopped_early": None}, {"rate": 28.0, "stopped_early": None},
            {"rate": 32.0, "stopped_early": "decided: 193 of 1929 requests missed the SLO"}]
    scored = [{"slo_attainment": 1.0, "goodput": 15.5}, {"slo_attainment": 0.999, "goodput": 17.8},
              {"slo_attainment": 0.686, "goodput": 24.0}]
    rates, attainment = per_rate(runs, scored, "slo_attainment", 100.0)
    assert rates == [24.0, 28.0, 32.0] and attainment == [[100.0], [pytest.approx(99.9)], [pytest.approx(68.6)]]
    assert per_rate(runs, scored, "goodput") == ([24.0, 28.0], [[15.5], [17.8]])


def test_bench_misses_splits_a_runs_misses_by_cause_and_output_length(tmp_path, capsys):
    """One 0.4 s gap among 0.1 s ones: over 2 gaps (3 tokens) it lifts TPOT past a 0.15 s SLO,
    over 20 (21 tokens) it does not. Late first tokens and an unfinished request count apart."""
    from bullet_trt.tools.bench.cli import main as bench_main
    from bullet_trt.tools.bench.misses import misses_by_output_length
    from bullet_trt.tools.bench.results import write_result

    def tokens_at(first, n):  # n tokens from `first`, the second one 0.4 s after the first
        return [first] + [first + 0.4 + 0.1 * k for k in range(n - 1)]
    records = [rec(i, float(i), tokens_at(i + 0.1, 3)) for i in range(4)]  # short, TPOT 0.25
    records += [rec(4 + i, 4.0 + i, tokens_at(4.0 + i + 0.1, 21)) for i in range(4)]  # long, TPOT 0.115
    records += [rec(8, 8.0, tokens_at(10.0, 21))]  # long, first token 2 s late
    records += [rec(9, 9.0, [9.1, 9.2], finished=False)]  # unfinished after 2 of its 21 tokens
    w = ds.build_workload("sharegpt", 1.0, len(records), seed=0, prompts=False)
    doc = write_result(tmp_path, label="mixed", dataset="sharegpt", rate=1.0, seed=0, backend="test",
                       records=records, workload=w, ttft_slo_ms=1000.0, tpot_slo_ms=150.0)[1]
    for r, max_tokens in zip(doc["requests"], [3] * 4 + [21] * 6):
        r["max_tokens"] = max_tokens
    short, long_ = misses_by_output_length(doc, (1, 10))
    assert (short.requests, short.unfinished, short.ttft_missed, short.tpot_missed) == (4, 0, 0, 4)
    assert (long_.requests, long_.unfinished, long_.ttft_missed, long_.tpot_missed) == (6, 1, 1, 0)
    assert short.tpot_p50_ms == pytest.approx(250.0) and long_.longest_gap_p50_ms == pytest.approx(400.0)
    # the buckets' misses are the run's: 4 of 10 requests met the SLO
    met = sum(b.requests * b.attainment for b in (short, long_))
    assert met == pytest.approx(4) and doc["summary"]["slo_attainment"] == pytest.approx(0.4)
    path = tmp_path / "mixed__sharegpt__rate1.json"
    path.write_text(json.dumps(doc))
    assert bench_main(["misses", str(path), "--edges", "1,10"]) == 0
    out = capsys.readouterr().out
    assert "| 1-9 | 4 | 0 | 0 | 4 | 0.0% | 250.0 / 250.0 | 400.0 | - / - |" in out
    assert "| 10+ | 6 | 1 | 1 | 0 | 66.7% |" in out
    # the run's line says the same in a few words, and under a looser TPOT SLO the TPOT misses go
    from bullet_trt.tools.bench.misses import miss_causes
    from bullet_trt.tools.bench.report import format_row
    assert "SLO attainment 40.0% (missed: 1 failed or unfinished, 1 on TTFT, 4 on TPOT only)," in format_row(doc)
    assert miss_causes(doc, 1.0, 0.3) == "missed: 1 failed or unfinished, 1 on TTFT"
    with pytest.raises(SystemExit, match="--edges must be integers"):
        bench_main(["misses", str(path), "--edges", "1,ten"])
    # with the token times stored, the first gap (the new row's wait for decode) stands apart
    timed = write_result(tmp_path / "timed", label="mixed", dataset="sharegpt", rate=1.0, seed=0, backend="test",
                         records=records, workload=w, ttft_slo_ms=1000.0, tpot_slo_ms=150.0, token_times=True)[1]
    short, long_ = misses_by_output_length(timed, (1, 10))
    assert short.first_gap_p50_ms == pytest.approx(400.0) and short.later_gap_p50_ms == pytest.approx(100.0)
    assert long_.first_gap_p50_ms == pytest.approx(400.0) and long_.later_gap_p50_ms == pytest.approx(100.0)
