"""One sweep of `bench serve`: the workloads (rates x seeds) run one after the other against
one server, each run written to its JSON and the report rebuilt after it, so that an
interrupted sweep leaves a complete report of the runs it finished."""
from __future__ import annotations

from pathlib import Path

from bullet_trt.spatial.gpu_monitor import TelemetrySampler
from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.capacity import DEFAULT_TARGET
from bullet_trt.tools.bench.decided import DECIDED_ELSEWHERE, misses_that_decide, protocol_failed, runs_to_come
from bullet_trt.tools.bench.host import host_fields
from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions
from bullet_trt.tools.bench.progress import ProgressPrinter
from bullet_trt.tools.bench.report import format_row, rebuild_report
from bullet_trt.tools.bench.run_budget import BudgetSpent, RunBudget
from bullet_trt.tools.bench.results import dataset_name, write_result
from bullet_trt.tools.bench.scoring import slos_ms
from bullet_trt.tools.bench.steady_state import steady_state
from bullet_trt.tools.bench.telemetry import telemetry_device, telemetry_fields
from bullet_trt.tools.bench.warmup import warm_up, warmup_requests


def check_server(url: str, model: str) -> None:
    """Fails with a readable message unless tritonserver at ``url`` serves ``model``."""
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(url)
    except Exception as e:
        raise SystemExit(f"bullet-trt bench serve: bad --url {url!r}: {e}")
    try:
        try:
            live = client.is_server_ready(client_timeout=10)
        except Exception as e:
            raise SystemExit(f"bullet-trt bench serve: cannot reach tritonserver at {url} (gRPC): {e}")
        if not live:
            raise SystemExit(f"bullet-trt bench serve: tritonserver at {url} is not ready")
        if not client.is_model_ready(model, client_timeout=10):
            raise SystemExit(f"bullet-trt bench serve: model {model!r} is not ready on {url}")
    finally:
        client.close()


def run_sweep(url: str, label: str, workloads: list[ds.Workload], args, out_dir: Path, *,
              tokenizer=None, note: str = "", overrides: dict[str, str] | None = None,
              engine_notes: list[str] | None = None) -> list[dict]:
    """``args``: the parsed `bench serve` options; ``note`` goes into every run's notes,
    ``overrides`` and ``engine_notes`` (those of a started server) into its JSON."""
    docs = []
    ttft_slo, tpot_slo = slos_ms(args.ttft_slo_ms, args.tpot_slo_ms)
    check_server(url, args.model)
    if workloads:
        warm_up(url, args.model, warmup_requests(workloads[0], args.warmup, tokenizer))
    decide = getattr(args, "stop_when_decided", False)
    budget = RunBudget(getattr(args, "time_budget_s", 0.0), getattr(args, "started_at", None))
    attained: dict[tuple, list[float]] = {}  # (dataset, rate) -> attainment of each run so far
    tails: dict[tuple, list[float]] = {}  # (dataset, rate) -> the same over each run's last third
    failed_rates: dict[object, float] = {}  # dataset -> the lowest rate decided to fail
    keys = [(w.dataset, w.rate) for w in workloads]
    repeats = getattr(args, "repeats", 1)
    elsewhere = max(0, (getattr(args, "decide_over", None) or repeats) - repeats)
    for n, w in enumerate(workloads):
        rate_text = f"{w.rate:g} req/s" + (f" seed {w.seed}" if w.seed else "")
        key = (w.dataset, w.rate)
        finished = attained.setdefault(key, [])
        left = runs_to_come(keys, n, elsewhere)
        give_up = misses_that_decide(len(w.requests), finished, left, DEFAULT_TARGET) if decide else None
        if decide and (give_up == 0 or w.rate > failed_rates.get(w.dataset, float("inf"))):
            print(f"{label} {dataset_name(w.dataset)} {rate_text}: skipped, the sweep has decided that "
                  f"{failed_rates.get(w.dataset, w.rate):g} req/s misses the target", flush=True)
            continue
        # after the skip: a run the sweep has decided away takes no time, whatever its length
        if not budget.fits(w.duration_s):
            print(f"{label} {dataset_name(w.dataset)} {rate_text}: not started, nor the {len(workloads) - n - 1} "
                  f"after it: {budget.why(w.duration_s)}", flush=True)
            raise BudgetSpent()
        opts = LoadGenOptions(model=args.model, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              fixed_output=not args.allow_eos,
                              streams=args.streams, drain_timeout_s=args.drain_timeout_s,
                              timeout_s=args.timeout_s or (w.duration_s + args.drain_timeout_s + 60),
                              ttft_slo_s=ttft_slo / 1e3, give_up_at_misses=give_up)
        printer = ProgressPrinter(f"[{label} {dataset_name(w.dataset)} {rate_text}]", enabled=not args.no_progress)
        gen = LoadGenerator(url, opts, on_progress=printer)
        sampler = TelemetrySampler(telemetry_device(args, url)).start()
        try:
            result = gen.run(w.requests)
        finally:
            sampler.stop()
        printer.done()
        telemetry = telemetry_fields(sampler, w.duration_s)
        notes = list(result.notes) + ([note] if note else [])
        _, doc = write_result(
            out_dir, label=label, dataset=w.dataset, rate=w.rate, seed=w.seed, backend="triton-grpc-stream",
            records=result.records, workload=w, ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo,
            extra={"url": url, "model": args.model, "engine_dir": args.engine_dir,
                   "overrides": overrides or {},
                   **({"engine_notes": engine_notes} if engine_notes is not None else {}),
                   "client": {"streams": args.streams, "temperature": args.temperature,
                              "top_p": args.top_p, "top_k": args.top_k,
                              "fixed_output": not args.allow_eos}, **telemetry, **host_fields()},
            notes=notes, stopped_early=result.stopped_early, token_times=args.token_times)
        print(format_row(doc), flush=True)
        budget.ran(doc)
        docs.append(doc)
        finished.append(doc["summary"]["slo_attainment"])
        tail = steady_state(doc, ttft_slo / 1e3, tpot_slo / 1e3)
        if tail is not None:
            tails.setdefault(key, []).append(tail.tail_attainment)
        if decide and protocol_failed(finished, tails.get(key, []), left, DEFAULT_TARGET):
            failed_rates[w.dataset] = min(w.rate, failed_rates.get(w.dataset, w.rate))
            if elsewhere:
                print(f"{label} {dataset_name(w.dataset)} {w.rate:g} req/s misses the target: "
                      f"{DECIDED_ELSEWHERE} ({elsewhere} of its seeds run in other sweeps)", flush=True)
        rebuild_report(out_dir, None, None, plots=not args.no_plots)
        if result.stopped_early == "interrupted":
            raise KeyboardInterrupt
    return docs
