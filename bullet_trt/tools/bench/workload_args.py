"""The workload options `bench serve` and `bench hf-peer` share, and the workloads they make:
the same options give both the same requests (lengths, arrivals, prompts)."""
from __future__ import annotations

import argparse
import math

from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.scoring import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS


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
    g.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="every prompt opens with the same words for this many tokens (a shared system prompt; "
                        "what kv.prefix_caching finds); default 0: prompts share nothing")
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
    if getattr(args, "shared_prefix_tokens", 0) < 0:
        raise SystemExit(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    out = []
    for rate in rates:
        for seed in range(args.seed, args.seed + repeats):
            out.append(ds.build_workload(args.dataset, rate, num, args.duration, seed, tokenizer,
                                         max_model_len, args.max_output_tokens,
                                         shared_prefix_tokens=getattr(args, "shared_prefix_tokens", 0)))
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
