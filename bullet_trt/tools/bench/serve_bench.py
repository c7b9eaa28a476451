"""`bullet-trt bench serve`: the serving benchmark (open-loop Poisson load over gRPC streaming).

    # against a running server (bullet-trt serve ...), one label per server mode
    bullet-trt bench serve --url localhost:8001 --engine-dir engines/default \\
        --dataset sharegpt --rates 1,2,4 --num-requests 200 --label chunked --out results/

    # start tritonserver once per mode, sweep the rates, stop it: one command compares modes
    bullet-trt bench serve --start-server --engine-dir engines/llama-3.1-8b \\
        --modes chunked,bullet,static --set serve.static_prefill_sms=66 \\
        --dataset azure-conv --rates 1,2,4,8 --duration 120 --out results/

    # rebuild summary.md and the plots from the JSON files (plain or .json.gz) in a directory
    bullet-trt bench serve --compare results/

Every run (one label, one dataset, one rate, one seed) writes
``<label>__<dataset>__rate<r>.json`` (``…__seed<s>.json`` for seeds other than 0); with
``--repeats N`` each rate runs N times with seeds seed … seed+N-1 (other arrivals and
lengths, same distribution). After each run ``summary.md`` and the plots are rebuilt from ALL
JSON files in the output directory, so runs of several modes (and of the transformers peer,
`bench hf-peer`) land in one table, followed by each label's sustained rate (the highest rate
at which it and every lower rate keep the mean SLO attainment >= 90%; bullet_trt/bench/
capacity.py) and its ratio to the best chunked label: ``slo_attainment_<dataset>.png`` (mean
SLO attainment and goodput against the rate, one line per label) and
``latency_cdf_<dataset>_rate<r>.png`` (TTFT and TPOT CDFs per label). Metric definitions:
bullet_trt/tools/bench/metrics.py and docs/benchmarking.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from bullet_trt.config import parse_overrides
from bullet_trt.tools.bench import capacity
from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.metrics import RequestRecord, cdf, slo_attainment, summarize
from bullet_trt.spatial.gpu_monitor import TelemetrySampler, summarize_telemetry

RESULT_KIND = "bullet_trt.serve_bench"
DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TPOT_SLO_MS = 50.0


# -- progress -----------------------------------------------------------------------------------

class ProgressPrinter:
    """One status line, rewritten in place on a terminal, every few seconds otherwise."""

    def __init__(self, prefix: str, stream=None, enabled: bool = True, interval_s: float = 5.0):
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = interval_s
        self._last = -1e9
        self._width = 0

    def __call__(self, p) -> None:
        if not self.enabled:
            return
        ttft = f"{p.p50_ttft_s * 1e3:.0f} ms" if p.p50_ttft_s is not None else "-"
        line = (f"{self.prefix} {p.elapsed_s:6.1f}s  sent {p.sent}/{p.total}  finished {p.finished}"
                f"  failed {p.failed}  in flight {p.in_flight}  p50 TTFT {ttft}")
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()
        elif p.elapsed_s - self._last >= self.interval_s or p.finished + p.failed == p.total:
            self._last = p.elapsed_s
            self.stream.write(line + "\n")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


# -- results files ------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def dataset_name(dataset: str) -> str:
    """``trace:/a/b/azure.csv`` -> ``trace-azure``; synthetic names unchanged."""
    if ds.is_trace(dataset):
        return "trace-" + _slug(Path(dataset[len("trace:"):]).stem)
    return dataset


def result_path(out_dir: Path, label: str, dataset: str, rate: float, seed: int = 0) -> Path:
    repeat = f"__seed{seed}" if seed else ""
    return Path(out_dir) / f"{_slug(label)}__{_slug(dataset_name(dataset))}__rate{rate:g}{repeat}.json"


def write_result(out_dir: Path, *, label: str, dataset: str, rate: float, seed: int, backend: str,
                 records: Sequence[RequestRecord], workload: ds.Workload, ttft_slo_ms: float,
                 tpot_slo_ms: float, extra: dict | None = None, notes: Sequence[str] = (),
                 stopped_early: str | None = None, token_times: bool = False) -> tuple[Path, dict]:
    """Summarizes one run and writes its JSON; returns (path, the JSON object)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, ttft_slo_ms / 1e3, tpot_slo_ms / 1e3)
    doc = {
        "kind": RESULT_KIND, "version": 1, "label": label, "dataset": dataset_name(dataset),
        "dataset_arg": dataset, "rate": rate, "seed": seed, "backend": backend,
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms},
        "workload": {"num_requests": len(workload.requests), "last_arrival_s": workload.duration_s,
                     "lengths": workload.lengths(), "source": workload.source},
        "summary": summary.to_json(), "stopped_early": stopped_early, "notes": list(notes),
        **(extra or {}),
        "requests": [r.to_json(token_times=token_times) for r in records],
    }
    path = result_path(out_dir, label, dataset, rate, seed)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path, doc


def load_results(out_dir: Path) -> list[dict]:
    """Every result JSON in ``out_dir``, plain or gzipped (``.json.gz``: kept results, whose
    per-request arrays --compare needs, take a quarter of the space)."""
    docs = []
    paths = sorted([*Path(out_dir).glob("*.json"), *Path(out_dir).glob("*.json.gz")])
    for path in paths:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            doc = json.loads(raw)
        except (OSError, EOFError, ValueError):  # unreadable, truncated or not JSON: not a result
            continue
        if isinstance(doc, dict) and doc.get("kind") == RESULT_KIND:
            doc["_path"] = str(path)
            docs.append(doc)
    return docs


def rescore(doc: dict, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> dict:
    """The run's SLO attainment and goodput under other SLOs (from its per-request values)."""
    s = dict(doc["summary"])
    ttft_ms = ttft_slo_ms if ttft_slo_ms is not None else doc["slo"]["ttft_ms"]
    tpot_ms = tpot_slo_ms if tpot_slo_ms is not None else doc["slo"]["tpot_ms"]
    if (ttft_ms, tpot_ms) != (doc["slo"]["ttft_ms"], doc["slo"]["tpot_ms"]):
        reqs = doc.get("requests") or []
        ok = [bool(r.get("finished")) and r.get("error") is None for r in reqs]
        att = slo_attainment([r.get("ttft_s") for r in reqs], [r.get("tpot_s") for r in reqs],
                             ttft_ms / 1e3, tpot_ms / 1e3, ok)
        s["slo_attainment"] = att
        s["slo_met"] = round(att * len(reqs))
        s["goodput"] = s["slo_met"] / s["duration_s"] if s.get("duration_s") else 0.0
    s["ttft_slo_s"], s["tpot_slo_s"] = ttft_ms / 1e3, tpot_ms / 1e3
    return s


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def markdown_table(docs: list[dict], ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> str:
    docs = sorted(docs, key=lambda d: (d["dataset"], d["label"], d["rate"], d.get("seed", 0)))
    lines = ["# Serving benchmark", ""]
    slos = sorted({(ttft_slo_ms if ttft_slo_ms is not None else d["slo"]["ttft_ms"],
                    tpot_slo_ms if tpot_slo_ms is not None else d["slo"]["tpot_ms"]) for d in docs})
    lines.append("SLO: " + "; ".join(f"TTFT <= {a:g} ms and TPOT <= {b:g} ms" for a, b in slos)
                 + ". Latencies in ms (p50 / p90 / p99). Attainment counts failed requests as misses; "
                 "goodput = requests meeting the SLO per second. Definitions: docs/benchmarking.md.")
    lines.append("")
    head = ["label", "dataset", "rate (req/s)", "seed", "done", "req/s", "out tok/s", "TTFT p50/p90/p99",
            "TPOT p50/p90/p99", "ITL p50/p90/p99", "E2E p50", "SLO attain.", "goodput (req/s)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for d in docs:
        s = rescore(d, ttft_slo_ms, tpot_slo_ms)

        def trio(key):
            v = s[key]
            return f"{_ms(v.get('p50'))} / {_ms(v.get('p90'))} / {_ms(v.get('p99'))}"

        row = [d["label"], d["dataset"], f"{d['rate']:g}", str(d.get("seed", 0)), f"{s['completed']}/{s['num_requests']}",
               f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}", trio("ttft_s"),
               trio("tpot_s"), trio("itl_s"), _ms(s["e2e_s"].get("p50")), f"{s['slo_attainment'] * 100:.1f}%",
               f"{s['goodput']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", capacity.markdown(capacity.capacities(
        [(d, rescore(d, ttft_slo_ms, tpot_slo_ms)["slo_attainment"]) for d in docs]))]
    notes = [(d["label"], d["dataset"], d["rate"], n) for d in docs for n in
             ([f"stopped early: {d['stopped_early']}"] if d.get("stopped_early") else []) + list(d.get("notes") or [])]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {label} / {dset} / {rate:g} req/s: {n}" for label, dset, rate, n in notes]
    return "\n".join(lines) + "\n"


def plot_results(docs: list[dict], out_dir: Path, ttft_slo_ms: float | None = None,
                 tpot_slo_ms: float | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written: list[Path] = []
    for dataset in sorted({d["dataset"] for d in docs}):
        group = [d for d in docs if d["dataset"] == dataset]
        labels = sorted({d["label"] for d in group})
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        slo_text = ""
        for label in labels:
            runs = [d for d in group if d["label"] == label]
            scored = [rescore(d, ttft_slo_ms, tpot_slo_ms) for d in runs]
            rates = sorted({d["rate"] for d in runs})
            # repeated runs (seeds) of one rate: the mean, with the spread as error bars
            att = [[s["slo_attainment"] * 100 for d, s in zip(runs, scored) if d["rate"] == r] for r in rates]
            good = [[s["goodput"] for d, s in zip(runs, scored) if d["rate"] == r] for r in rates]
            for ax, values in ((ax1, att), (ax2, good)):
                mid = [sum(v) / len(v) for v in values]
                spread = [[m - min(v) for m, v in zip(mid, values)], [max(v) - m for m, v in zip(mid, values)]]
                ax.errorbar(rates, mid, yerr=spread, marker="o", capsize=3, label=label)
            slo_text = f"TTFT <= {scored[0]['ttft_slo_s'] * 1e3:g} ms, TPOT <= {scored[0]['tpot_slo_s'] * 1e3:g} ms"
        ax1.set_xlabel("request rate (req/s)")
        ax1.set_ylabel("SLO attainment (%)")
        ax1.set_ylim(-3, 103)
        ax1.grid(alpha=0.3)
        ax1.legend()
        ax1.set_title(f"{dataset}: SLO attainment ({slo_text})", fontsize=9)
        ax2.set_xlabel("request rate (req/s)")
        ax2.set_ylabel("goodput (req/s meeting the SLO)")
        ax2.grid(alpha=0.3)
        ax2.set_title(f"{dataset}: goodput", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"slo_attainment_{_slug(dataset)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        for rate in sorted({d["rate"] for d in group}):
            runs = [d for d in group if d["rate"] == rate]
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
            for label in sorted({d["label"] for d in runs}):
                # one CDF per label over the requests of all its repeats at this rate
                reqs = [r for d in runs if d["label"] == label
                        for r in d.get("requests") or [] if r.get("finished") and not r.get("error")]
                for ax, key in ((ax1, "ttft_s"), (ax2, "tpot_s")):
                    x, y = cdf(r.get(key) for r in reqs)
                    if x.size:
                        ax.step(x * 1e3, y, where="post", label=label)
            s0 = rescore(runs[0], ttft_slo_ms, tpot_slo_ms)
            for ax, name, slo in ((ax1, "TTFT", s0["ttft_slo_s"]), (ax2, "TPOT", s0["tpot_slo_s"])):
                ax.axvline(slo * 1e3, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo * 1e3:g} ms")
                ax.set_xlabel(f"{name} (ms)")
                ax.set_ylabel("fraction of requests")
                ax.set_ylim(0, 1.02)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
                ax.set_title(f"{dataset} at {rate:g} req/s: {name} CDF", fontsize=9)
            fig.tight_layout()
            path = out_dir / f"latency_cdf_{_slug(dataset)}_rate{rate:g}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def rebuild_report(out_dir: Path, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                   plots: bool = True, report_dir: Path | None = None) -> tuple[Path, list[Path]]:
    """summary.md (and the plots) from every result JSON in ``out_dir``, written to ``report_dir``
    (default ``out_dir``)."""
    out_dir = Path(out_dir)
    docs = load_results(out_dir)
    if not docs:
        raise SystemExit(f"no benchmark results (*.json or *.json.gz of kind {RESULT_KIND}) in {out_dir}")
    report = Path(report_dir) if report_dir else out_dir
    report.mkdir(parents=True, exist_ok=True)
    md = report / "summary.md"
    md.write_text(markdown_table(docs, ttft_slo_ms, tpot_slo_ms))
    pngs = plot_results(docs, report, ttft_slo_ms, tpot_slo_ms) if plots else []
    return md, pngs


def format_row(doc: dict) -> str:
    s = doc["summary"]
    seed = f" seed {doc['seed']}" if doc.get("seed") else ""
    return (f"{doc['label']} {doc['dataset']} {doc['rate']:g} req/s{seed}: {s['completed']}/{s['num_requests']} done, "
            f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s, "
            f"TTFT p50 {_ms(s['ttft_s']['p50'])} ms p99 {_ms(s['ttft_s']['p99'])} ms, "
            f"TPOT p50 {_ms(s['tpot_s']['p50'])} ms p99 {_ms(s['tpot_s']['p99'])} ms, "
            f"SLO attainment {s['slo_attainment'] * 100:.1f}%, goodput {s['goodput']:.2f} req/s"
            + _telemetry_text(doc))


def _telemetry_text(doc: dict) -> str:
    t = (doc.get("gpu_telemetry") or {}).get("summary") or {}
    clock, power = t.get("sm_clock_mhz"), t.get("power_w")
    if not clock or not power:
        return ""
    capped = t.get("power_capped_fraction")
    capped_text = f", power-capped {capped * 100:.0f}% of samples" if capped is not None else ""
    return (f"; while arriving: SM clock p50 {clock['p50']:.0f} MHz, power p50 {power['p50']:.0f} W"
            + capped_text)


# -- workloads shared with the transformers peer -------------------------------------------------

def parse_rates(text: str | None) -> list[float | None]:
    if text is None or not text.strip():
        return [None]
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.lower() in ("native", "trace"):
            out.append(None)
            continue
        try:
            r = float(part)
        except ValueError:
            raise SystemExit(f"--rates expects comma-separated req/s values (e.g. 1,2,4), got {part!r}")
        if not r > 0 or not math.isfinite(r):
            raise SystemExit(f"--rates values must be > 0 req/s, got {part!r}")
        out.append(r)
    return out or [None]


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workload")
    g.add_argument("--dataset", default="sharegpt",
                   help="sharegpt | azure-conv | azure-code | trace:<file.csv> (default sharegpt)")
    g.add_argument("--rates", default=None,
                   help="comma-separated request rates (req/s) to sweep, e.g. 1,2,4; a trace replays its "
                        "own timing unless given (or 'native')")
    n = g.add_mutually_exclusive_group()
    n.add_argument("--num-requests", type=int, help="requests per rate (default 100)")
    n.add_argument("--duration", type=float, help="seconds of arrivals per rate (requests = those arriving in it)")
    g.add_argument("--seed", type=int, default=0, help="seed of lengths, arrivals and prompts (default 0)")
    g.add_argument("--repeats", type=int, default=1,
                   help="runs per rate, with seeds seed, seed+1, ...; the summary averages their SLO "
                        "attainment (default 1)")
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap on each request's output length")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="clip input + output to this (default: the engine's, when --engine-dir is given)")
    g.add_argument("--engine-dir", default=None,
                   help="engine directory: its tokenizer sizes the prompts exactly, its max_model_len clips "
                        "lengths (and --start-server serves it)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (or its directory) instead of the engine's")
    g.add_argument("--ttft-slo-ms", type=float, default=None, help=f"TTFT SLO (default {DEFAULT_TTFT_SLO_MS:g})")
    g.add_argument("--tpot-slo-ms", type=float, default=None, help=f"TPOT SLO (default {DEFAULT_TPOT_SLO_MS:g})")
    g.add_argument("--out", default="bench_results", help="output directory (default bench_results/)")
    g.add_argument("--token-times", action="store_true", help="store every response timestamp in the JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress line")


def workloads_from_args(args, tokenizer, max_model_len) -> list[ds.Workload]:
    if ds.is_trace(args.dataset):
        ds.read_trace(args.dataset[len("trace:"):])  # fail early, with line and column
    elif args.dataset not in ds.DATASETS:
        raise SystemExit(f"--dataset must be one of {', '.join(ds.DATASETS)} or trace:<file.csv>, got {args.dataset!r}")
    rates = parse_rates(args.rates)
    if not ds.is_trace(args.dataset) and None in rates:
        raise SystemExit(f"--rates is required with --dataset {args.dataset} (e.g. --rates 1,2,4)")
    num = args.num_requests
    if num is None and args.duration is None:
        num = 100
    if num is not None and num <= 0:
        raise SystemExit(f"--num-requests must be > 0, got {num}")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    out = []
    for rate in rates:
        for seed in range(args.seed, args.seed + repeats):
            out.append(ds.build_workload(args.dataset, rate, num, args.duration, seed, tokenizer,
                                         max_model_len, args.max_output_tokens))
    return out


def resolve_tokenizer(args):
    """(tokenizer or None, max_model_len or None, a note)."""
    tok, max_len, note = None, args.max_model_len, ""
    if args.tokenizer or args.engine_dir:
        tok = ds.load_tokenizer(args.engine_dir, args.tokenizer)
    else:
        note = ("no --engine-dir/--tokenizer: prompts are made of common words and only approximate "
                "the wanted input lengths")
    if max_len is None and args.engine_dir:
        max_len = ds.engine_max_model_len(args.engine_dir)
    return tok, max_len, note


# -- tritonserver per mode ----------------------------------------------------------------------

class ManagedServer:
    """tritonserver started with the project's launcher, for one mode."""

    def __init__(self, engine_dir: Path, overrides: dict, log_file: Path, model: str = "bullet",
                 start_timeout_s: float = 900.0):
        from bullet_trt.serving.triton import server as srv

        ports: list[int] = []
        while len(set(ports)) < 3:
            ports = [srv.free_port() for _ in range(3)]
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.log_file = log_file
        self.model = model
        self.proc = srv.launch(engine_dir=engine_dir, overrides=overrides, log_file=log_file,
                               http_port=self.http_port, grpc_port=self.grpc_port, metrics_port=self.metrics_port)
        self._wait_ready(start_timeout_s)

    @property
    def url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return ""

    def _wait_ready(self, timeout_s: float) -> None:
        from bullet_trt.serving.triton import server as srv

        try:
            srv.wait_until_ready(self.proc, self.url, timeout_s, self.model, self._log_tail)
        except srv.ServerNotReady as e:
            self.stop()
            raise RuntimeError(f"{e}\n(log {self.log_file})") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the launcher starts it in its own session
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass


# -- runs ---------------------------------------------------------------------------------------

def warmup_requests(workload: ds.Workload, n: int, tokenizer, max_output: int = 8) -> list[ds.BenchRequest]:
    """``n`` requests shaped like the workload's first ones (outputs capped), sent together.

    They exercise the prompt lengths and batch sizes of the run (kernel autotuning, JIT,
    allocator growth) with fresh prompts, so no measured prompt is cached by them.
    """
    b = ds.PromptBuilder(tokenizer, seed=12345)
    out = []
    for i, src in enumerate((workload.requests * (n // max(len(workload.requests), 1) + 1))[:n]):
        req = ds.BenchRequest(i, 0.0, src.input_tokens, min(src.output_tokens, max_output))
        req.prompt, req.prompt_tokens, req.prompt_ids = b.build(src.input_tokens)
        out.append(req)
    return out


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


def warm_up(url: str, model: str, requests: list[ds.BenchRequest]) -> None:
    """Sends warm-up requests before measuring (first-call costs: graphs, JIT, allocator)."""
    from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions

    if not requests:
        return
    res = LoadGenerator(url, LoadGenOptions(model=model, timeout_s=900, drain_timeout_s=900)).run(requests)
    bad = [r.error for r in res.records if not r.ok]
    if bad:
        raise SystemExit(f"warm-up requests to {url} (model {model}) failed: {bad[0]}")


def telemetry_device(args, url: str) -> int | None:
    """Which GPU to sample during the runs: --gpu-telemetry's index, or with ``auto`` device 0
    when the server is on this host (its GPU is then visible here); None for ``off``."""
    choice = str(getattr(args, "gpu_telemetry", "off")).strip().lower()
    if choice == "off":
        return None
    if choice == "auto":
        host = url.rsplit(":", 1)[0].strip("[]").lower()
        return 0 if host in ("localhost", "127.0.0.1", "::1") else None
    try:
        return int(choice)
    except ValueError:
        raise SystemExit(f"--gpu-telemetry must be auto, off or a GPU index, got {choice!r}") from None


def telemetry_fields(sampler: TelemetrySampler, arrivals_s: float | None) -> dict:
    """The result JSON's ``gpu_telemetry`` (summarized over the arrival window), or nothing
    when the sampler had no GPU."""
    if not sampler.available:
        return {}
    return {"gpu_telemetry": {"device_index": sampler.device_index, "interval_s": sampler.interval_s,
                              "summary": summarize_telemetry(sampler.samples, arrivals_s),
                              "samples": sampler.samples}}


def run_sweep(url: str, label: str, workloads: list[ds.Workload], args, out_dir: Path) -> list[dict]:
    from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions

    docs = []
    ttft_slo = args.ttft_slo_ms if args.ttft_slo_ms is not None else DEFAULT_TTFT_SLO_MS
    tpot_slo = args.tpot_slo_ms if args.tpot_slo_ms is not None else DEFAULT_TPOT_SLO_MS
    check_server(url, args.model)
    if workloads:
        warm_up(url, args.model, warmup_requests(workloads[0], args.warmup, getattr(args, "_tokenizer", None)))
    for w in workloads:
        rate_text = f"{w.rate:g} req/s" + (f" seed {w.seed}" if w.seed else "")
        opts = LoadGenOptions(model=args.model, temperature=args.temperature, fixed_output=not args.allow_eos,
                              streams=args.streams, drain_timeout_s=args.drain_timeout_s,
                              timeout_s=args.timeout_s or (w.duration_s + args.drain_timeout_s + 60))
        printer = ProgressPrinter(f"[{label} {dataset_name(w.dataset)} {rate_text}]", enabled=not args.no_progress)
        gen = LoadGenerator(url, opts, on_progress=printer)
        sampler = TelemetrySampler(telemetry_device(args, url)).start()
        try:
            result = gen.run(w.requests)
        finally:
            sampler.stop()
        printer.done()
        telemetry = telemetry_fields(sampler, w.duration_s)
        notes = list(result.notes) + ([args._note] if getattr(args, "_note", "") else [])
        path, doc = write_result(
            out_dir, label=label, dataset=w.dataset, rate=w.rate, seed=w.seed, backend="triton-grpc-stream",
            records=result.records, workload=w, ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo,
            extra={"url": url, "model": args.model, "engine_dir": args.engine_dir,
                   "overrides": getattr(args, "_overrides", {}),
                   "client": {"streams": args.streams, "temperature": args.temperature,
                              "fixed_output": not args.allow_eos}, **telemetry},
            notes=notes, stopped_early=result.stopped_early, token_times=args.token_times)
        print(format_row(doc), flush=True)
        docs.append(doc)
        rebuild_report(out_dir, None, None, plots=not args.no_plots)
        if result.stopped_early == "interrupted":
            raise KeyboardInterrupt
    return docs


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
    c.add_argument("--allow-eos", action="store_true",
                   help="let requests stop at an end token (default: min_tokens = max_tokens, so every request "
                        "generates exactly its workload length)")
    c.add_argument("--streams", type=int, default=1, help="gRPC streams to spread requests over (default 1)")
    c.add_argument("--warmup", type=int, default=8,
                   help="requests sent together before each sweep, shaped like the workload's first ones with "
                        "outputs capped at 8 tokens; not measured (default 8)")
    c.add_argument("--drain-timeout-s", type=float, default=300.0,
                   help="wait at most this long after the last send (default 300)")
    c.add_argument("--timeout-s", type=float, default=0.0,
                   help="bound on one run (default: last arrival + drain timeout + 60 s)")
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
    s.add_argument("--server-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--compare", metavar="DIR", default=None,
                    help="only rebuild summary.md and the plots from the JSON files in DIR (re-scored with "
                         "--ttft-slo-ms / --tpot-slo-ms when given)")
    ap.add_argument("--report-dir", metavar="DIR", default=None,
                    help="with --compare: write summary.md and the plots here instead of into the compared "
                         "directory (one set of runs, reports under several SLOs)")
    return ap


def server_settings(args) -> dict[str, str]:
    """The configuration overrides of the servers `--start-server` starts: the SLOs the run is
    scored against, when given, become the SLOs the spatial policies plan for (a server that
    plans for 50 ms while it is judged at 40 ms would be measured out of its configuration);
    an explicit --set of either still wins."""
    slos = {key: f"{value:g}" for key, value in (("serve.ttft_slo_ms", args.ttft_slo_ms),
                                                 ("serve.tpot_slo_ms", args.tpot_slo_ms)) if value is not None}
    return {**slos, **parse_overrides(args.set)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        md, pngs = rebuild_report(Path(args.compare), args.ttft_slo_ms, args.tpot_slo_ms, plots=not args.no_plots,
                                  report_dir=args.report_dir)
        print(md.read_text())
        for p in pngs:
            print(f"wrote {p}")
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.start_server and not args.engine_dir:
        from bullet_trt.serving.triton import server as srv
        args.engine_dir = str(srv.DEFAULT_ENGINE_DIR)
        if not (srv.DEFAULT_ENGINE_DIR / "engine.yaml").is_file():
            from bullet_trt.tools.build import build_default_engine
            build_default_engine(srv.DEFAULT_ENGINE_DIR)
    try:
        tok, max_len, note = resolve_tokenizer(args)
        workloads = workloads_from_args(args, tok, max_len)
    except (ds.TraceError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"bullet-trt bench serve: {e}")
    args._tokenizer, args._note = tok, note
    if note:
        print(f"bullet-trt bench serve: {note}", file=sys.stderr)
    for w in workloads:
        lens = w.lengths()
        print(f"workload {dataset_name(w.dataset)} at {w.rate:g} req/s: {len(w.requests)} requests over "
              f"{w.duration_s:.1f} s; input mean {lens['input']['mean']:.0f} (median {lens['input']['median']:.0f}), "
              f"output mean {lens['output']['mean']:.0f} (median {lens['output']['median']:.0f}) tokens",
              file=sys.stderr)
    try:
        if not args.start_server:
            args._overrides = {}
            run_sweep(args.url, args.label or "server", workloads, args, out_dir)
        else:
            from bullet_trt.config import load_engine_config
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
                args._overrides = overrides
                label = f"{args.label}-{mode}" if args.label else mode
                log = out_dir / f"server_{_slug(label)}.log"
                print(f"starting tritonserver for mode {mode} (log {log})", file=sys.stderr, flush=True)
                server = ManagedServer(Path(args.engine_dir), overrides, log, args.model, args.server_start_timeout_s)
                try:
                    run_sweep(server.url, label, workloads, args, out_dir)
                finally:
                    server.stop()
    except KeyboardInterrupt:
        print("\ninterrupted: the results measured so far are in " + str(out_dir), file=sys.stderr)
        return 130
    print(f"results: {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
