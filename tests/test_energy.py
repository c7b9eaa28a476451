"""Output tokens per joule over a run's last third (bullet_trt/tools/bench/energy.py)."""
import pytest

from bullet_trt.tools.bench.energy import energy_between, tokens_per_joule
from bullet_trt.tools.bench.report import format_row
from bullet_trt.tools.bench.steady_state import steady_state


def _power(watts_at, until_s=35.0, every_s=0.25):
    return [{"t": i * every_s, "power_w": watts_at(i * every_s)} for i in range(int(until_s / every_s) + 1)]


def _run(samples, n=30, tokens=11):
    """n requests arriving 1 s apart, each streaming `tokens` tokens over 1 s from 50 ms after it arrived."""
    requests = [{"scheduled_s": float(i), "sent_s": float(i), "ttft_s": 0.05, "e2e_s": 1.05, "tpot_s": 0.1,
                 "num_output_tokens": tokens, "max_tokens": tokens, "finished": True, "error": None}
                for i in range(n)]
    summary = {"completed": n, "num_requests": n, "request_throughput": 1.0, "output_token_throughput": 11.0,
               "ttft_s": {"p50": 0.05, "p99": 0.05}, "tpot_s": {"p50": 0.1, "p99": 0.1},
               "slo_attainment": 1.0, "goodput": 1.0, "ttft_slo_s": 1.0, "tpot_slo_s": 0.15}
    return {"label": "bullet", "dataset": "sharegpt", "rate": 1.0, "summary": summary, "requests": requests,
            "gpu_telemetry": {"summary": {}, "samples": samples}}


def test_power_integrates_over_the_window_only():
    # 1000 W until 10 s, 500 W from 10.25 s: the window from 12 to 20 s sees only the 500
    samples = _power(lambda t: 1000.0 if t < 10.0 else 500.0)
    assert energy_between(samples, 12.0, 20.0) == pytest.approx(4000.0)
    # across the step (the samples at 9.75 and 10.0 s read 1000 and 500 W) a trapezoid counts the mean
    assert energy_between(samples, 9.5, 10.5) == pytest.approx(0.25 * 1000 + 0.25 * 750 + 0.5 * 500)
    # a window's edges between samples take the interpolated power
    assert energy_between(samples, 9.875, 10.0) == pytest.approx(0.125 * (750 + 500) / 2)
    # a window the samples do not reach, or an empty one, has no energy
    assert energy_between(samples, 30.0, 40.0) is None
    assert energy_between(samples, 20.0, 20.0) is None


def test_the_energy_counter_wins_over_sampled_power():
    # NVML's counter says 600 W throughout; the sampled power, read between its averages, says 100
    samples = [{"t": 0.5 * i, "energy_j": 1e6 + 300.0 * i, "power_w": 100.0} for i in range(41)]
    assert energy_between(samples, 2.2, 12.2) == pytest.approx(6000.0)


def test_tokens_per_joule_divides_the_last_thirds_tokens_by_its_energy():
    doc = _run(_power(lambda t: 1000.0 if t < 10.0 else 500.0))
    tail = steady_state(doc, 1.0, 0.15)
    assert tail.window_s == pytest.approx((29.0 * 2 / 3, 29.0))
    assert tail.served_tok_s == pytest.approx(11.0, rel=0.1)
    # 500 W over the whole window (the 1000 W stretch lies before it)
    assert tokens_per_joule(doc, tail.served_tok_s, tail.window_s) == pytest.approx(tail.served_tok_s / 500.0)
    assert f"1 / 1 streaming at once (p50 / p90), {tail.served_tok_s / 500.0:.1f} out tokens per joule" in format_row(doc)


def test_a_run_whose_telemetry_stops_early_names_no_tokens_per_joule():
    doc = _run(_power(lambda t: 500.0, until_s=20.0))
    tail = steady_state(doc, 1.0, 0.15)
    assert tokens_per_joule(doc, tail.served_tok_s, tail.window_s) is None
    assert "per joule" not in format_row(doc)


def test_the_report_names_each_modes_tokens_per_joule_and_power_at_its_first_miss(tmp_path):
    """Two labels alike per joule at different power: the report's capacity part lists both at their
    first miss, the figures the benchmarks' power-bound reading rests on."""
    from bullet_trt.tools.bench import datasets as ds
    from bullet_trt.tools.bench.metrics import RequestRecord
    from bullet_trt.tools.bench.report import markdown_table
    from bullet_trt.tools.bench.results import write_result

    def run(label, rate, ttft, watts):
        w = ds.build_workload("sharegpt", rate, 30, seed=0, prompts=False)
        records = []
        for i in range(30):
            times = [i + ttft + 0.1 * k for k in range(11)]
            r = RequestRecord(i, float(i), 10, 11, sent_s=float(i), chunk_times=times, chunk_tokens=[1] * 11,
                              end_s=times[-1], num_input_tokens=10, finished=True)
            r.scheduled_s = float(i)
            records.append(r)
        samples = _power(lambda t: watts, until_s=40.0)
        telemetry = {"summary": {"sm_clock_mhz": {"p50": 1980.0}, "power_w": {"p50": watts}}, "samples": samples}
        return write_result(tmp_path, label=label, dataset="sharegpt", rate=rate, seed=0, backend="test",
                            records=records, workload=w, ttft_slo_ms=1000.0, tpot_slo_ms=150.0,
                            extra={"gpu_telemetry": telemetry})[1]

    docs = [run("bullet", 1.0, 0.05, 700.0), run("bullet", 2.0, 3.0, 700.0),
            run("chunked", 1.0, 0.05, 600.0), run("chunked", 2.0, 3.0, 600.0)]
    md = markdown_table(docs)
    section = md.split("At capacity")[1]
    served = {d["label"]: steady_state(d, 1.0, 0.15).served_tok_s for d in docs if d["rate"] == 2.0}
    assert f"| sharegpt | bullet | 2 | {served['bullet'] / 700.0:.1f} | 700 W |" in section
    assert f"| sharegpt | chunked | 2 | {served['chunked'] / 600.0:.1f} | 600 W |" in section
    # the runs' table carries each run's figure too
    assert f"| {served['chunked'] / 600.0:.1f} | 1980 MHz / 600 W |" in md
