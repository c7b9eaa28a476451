"""`bullet-trt bench serve`: the serving benchmark (open-loop Poisson load over gRPC streaming).

    # against a running server (bullet-trt serve ...), one label per server mode
    bullet-trt bench serve --url localhost:8001 --engine-dir engines/default \\
        --dataset sharegpt --rates 1,2,4 --num-requests 200 --label chunked --out results/

    # start tritonserver once per mode, sweep the rates, stop it: one command compares modes
    bullet-trt bench serve --start-server --engine-dir engines/llama-3.1-8b \\
        --modes chunked,bullet,static --set serve.static_prefill_sms=66 \\
        --dataset azure-conv --rates 1,2,4,8 --duration 120 --out results/

    # rebuild summary.md and the plots from the JSON files (plain, .json.gz or .json.xz) in a directory
    bullet-trt bench serve --compare results/

Every run (one label, one dataset, one rate, one seed) writes
``<label>__<dataset>__rate<r>.json`` (``…__seed<s>.json`` for seeds other than 0; a label
longer than 150 characters is cut and ended by a digest of the whole); with
``--repeats N`` each rate runs N times with seeds seed … seed+N-1 (other arrivals and
lengths, same distribution). After each run ``summary.md`` and the plots are rebuilt from ALL
JSON files in the output directory, so runs of several modes (and of the transformers peer,
`bench hf-peer`) land in one table, followed by each label's sustained rate (the highest rate
at which it and every lower rate keep the mean SLO attainment >= 90%; bullet_trt/tools/
bench/capacity.py) and its ratio to the best chunked label: ``slo_attainment_<dataset>.png`` (mean
SLO attainment and goodput against the rate, one line per label) and
``latency_cdf_<dataset>_rate<r>.png`` (TTFT and TPOT CDFs per label). Metric definitions:
bullet_trt/tools/bench/metrics.py and docs/benchmarking.md.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from bullet_trt.config import load_engine_config, parse_overrides
from bullet_trt.serving.triton.server import DEFAULT_ENGINE_DIR
from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.managed_server import ManagedServer
from bullet_trt.tools.bench.report import rebuild_report
from bullet_trt.tools.bench.results import dataset_name, slug
from bullet_trt.tools.bench.run_budget import BudgetSpent
from bullet_trt.tools.bench.sweep import run_sweep
from bullet_trt.tools.bench.workload_args import add_workload_args, resolve_tokenizer, workloads_from_args
from bullet_trt.tools.build import build_default_engine


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bullet-trt bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="gRPC host:port of tritonserver (default localhost:8001)")
    ap.add_argument("--model", default="bullet", help="Triton model name (default bullet)")
    ap.add_argument("--label", default=None,
                    help="name of this configuration in the results (default: the mode with --start-server, "
                         "else 'server')")
    add_workload_args(ap)
    c = ap.add_argument_group("client")
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    c.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling's p for every request, in (0, 1] (default 1: not sent)")
    c.add_argument("--top-k", type=int, default=0, help="top-k for every request (default 0: not sent)")
    c.add_argument("--allow-eos", action="store_true",
                   help="let requests stop at an end token (default: min_tokens = max_tokens, so every request "
                        "generates exactly its workload length)")
    c.add_argument("--streams", type=int, default=1, help="gRPC streams to spread requests over (default 1)")
    c.add_argument("--warmup", type=int, default=8,
                   help="requests sent together before each sweep, shaped like the workload's first ones with "
                        "outputs capped at 8 tokens; not measured (default 8)")
    c.add_argument("--drain-timeout-s", type=float, default=300.0,
                   help="wait at most this long after the last send (default 300)")
    c.add_argument("--stop-when-decided", action="store_true",
                   help="stop a run once its rate can no longer reach 90%% mean SLO attainment over its "
                        "repeats, and skip that rate's other repeats and every higher rate "
                        "(bullet_trt/tools/bench/decided.py): the sustained rate comes out the same, "
                        "in less time")
    c.add_argument("--decide-over", type=int, default=None, metavar="N",
                   help="with --stop-when-decided: the runs a rate's mean is taken over, when only "
                        "--repeats of them run in this sweep and the rest elsewhere (one seed per GPU: "
                        "--seed 101 --repeats 1 --decide-over 3); those count as meeting the SLO "
                        "(default: --repeats)")
    c.add_argument("--timeout-s", type=float, default=0.0,
                   help="bound on one run (default: last arrival + drain timeout + 60 s)")
    c.add_argument("--time-budget-s", type=float, default=0.0,
                   help="wall time this command may take, counted from its start (0: unbounded): a run "
                        "that would not end within it (its arrivals plus the longest drain seen so far, "
                        "30 s before the first) is not started, nor any after it, so that an outer time "
                        "limit does not cut a run short")
    c.add_argument("--no-plots", action="store_true", help="write JSON and summary.md only")
    c.add_argument("--gpu-telemetry", default="auto", metavar="auto|off|INDEX",
                   help="sample this GPU's SM clock, power and utilization through NVML every 0.25 s of a run "
                        "into its JSON (default auto: GPU 0 when the server runs on this host)")
    s = ap.add_argument_group("server")
    s.add_argument("--start-server", action="store_true",
                   help="start tritonserver (--engine-dir, default engines/default) once per --modes entry")
    s.add_argument("--modes", default="chunked,bullet,static", help="serve.mode values to compare (default all three)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="engine configuration override for the started servers (repeatable)")
    s.add_argument("--tp", type=int, metavar="N",
                   help="tensor-parallel GPUs of the started servers (= --set parallel.tensor_parallel_size=N)")
    s.add_argument("--server-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--compare", metavar="PATH", nargs="+", default=None,
                    help="only rebuild summary.md and the plots from result JSON files: every one in each "
                         "directory PATH, or the file PATH (re-scored with --ttft-slo-ms / --tpot-slo-ms "
                         "when given); a mode's runs from several rounds then share one table")
    ap.add_argument("--report-dir", metavar="DIR", default=None,
                    help="with --compare: write summary.md and the plots here instead of into the compared "
                         "directory (needed for several PATHs or a file; one set of runs, reports under "
                         "several SLOs)")
    return ap


def server_settings(args) -> dict[str, str]:
    """The configuration overrides of the servers `--start-server` starts: the SLOs the run is
    scored against, when given, become the SLOs the spatial policies plan for (a server that
    plans for 50 ms while it is judged at 40 ms would be measured out of its configuration);
    an explicit --set of either still wins; --tp sets the tensor-parallel size."""
    slos = {key: f"{value:g}" for key, value in (("serve.ttft_slo_ms", args.ttft_slo_ms),
                                                 ("serve.tpot_slo_ms", args.tpot_slo_ms)) if value is not None}
    tp = {} if args.tp is None else {"parallel.tensor_parallel_size": str(args.tp)}
    return {**slos, **parse_overrides(args.set), **tp}


def sweep_started_servers(args, workloads: list[ds.Workload], out_dir: Path, tokenizer, note: str) -> None:
    """One tritonserver per --modes entry, started, swept and stopped in turn."""
    sets = server_settings(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise SystemExit("--modes is empty")
    for mode in modes:  # fail before starting anything
        try:
            load_engine_config(args.engine_dir, {**sets, "serve.mode": mode})
        except ValueError as e:
            raise SystemExit(f"bullet-trt bench serve: mode {mode}: {e}")
    for mode in modes:
        overrides = {**sets, "serve.mode": mode}
        label = f"{args.label}-{mode}" if args.label else mode
        log = out_dir / f"server_{slug(label)}.log"
        print(f"starting tritonserver for mode {mode} (log {log})", file=sys.stderr, flush=True)
        server = ManagedServer(Path(args.engine_dir), overrides, log, args.model, args.server_start_timeout_s)
        try:
            run_sweep(server.url, label, workloads, args, out_dir, tokenizer=tokenizer, note=note,
                      overrides=overrides, engine_notes=server.engine_notes())
        finally:
            server.stop()


def _raise_keyboard_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _stop_like_ctrl_c_on_sigterm():
    """A SIGTERM (`timeout`, a job scheduler) ends the sweep as Ctrl-C does: the runs measured
    so far are written and the started server is stopped, instead of Python dying at once with
    the server left running. Returns what puts the previous handler back (nothing to do off
    the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.started_at = time.monotonic()
    if args.compare:
        md, pngs = rebuild_report([Path(p) for p in args.compare], args.ttft_slo_ms, args.tpot_slo_ms,
                                  plots=not args.no_plots, report_dir=args.report_dir)
        print(md.read_text())
        for p in pngs:
            print(f"wrote {p}")
        return 0
    if not 0.0 < args.top_p <= 1.0 or args.top_k < 0:
        raise SystemExit(f"bullet-trt bench serve: --top-p must lie in (0, 1] and --top-k be >= 0, "
                         f"got {args.top_p} and {args.top_k}")
    if args.decide_over is not None and args.decide_over < args.repeats:
        raise SystemExit(f"bullet-trt bench serve: --decide-over must be >= --repeats ({args.repeats}), "
                         f"got {args.decide_over}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.start_server and not args.engine_dir:
        args.engine_dir = str(build_default_engine(DEFAULT_ENGINE_DIR))
    try:
        tok, max_len, note = resolve_tokenizer(args)
        workloads = workloads_from_args(args, tok, max_len)
    except (ds.TraceError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"bullet-trt bench serve: {e}")
    if note:
        print(f"bullet-trt bench serve: {note}", file=sys.stderr)
    for w in workloads:
        lens = w.lengths()
        print(f"workload {dataset_name(w.dataset)} at {w.rate:g} req/s: {len(w.requests)} requests over "
              f"{w.duration_s:.1f} s; input mean {lens['input']['mean']:.0f} (median {lens['input']['median']:.0f}), "
              f"output mean {lens['output']['mean']:.0f} (median {lens['output']['median']:.0f}) tokens",
              file=sys.stderr)
    restore = _stop_like_ctrl_c_on_sigterm()
    try:
        if args.start_server:
            sweep_started_servers(args, workloads, out_dir, tok, note)
        else:
            run_sweep(args.url, args.label or "server", workloads, args, out_dir, tokenizer=tok, note=note)
    except KeyboardInterrupt:
        print("\ninterrupted: the results measured so far are in " + str(out_dir), file=sys.stderr)
        return 130
    except BudgetSpent:
        print(f"--time-budget-s {args.time_budget_s:g} spent: the results of the runs that ended are in "
              f"{out_dir}", file=sys.stderr)
    finally:
        restore()
    print(f"results: {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
