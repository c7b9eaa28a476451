"""`bullet-trt bench steps-ahead`: chunked mode's plain loop against its steps launched one ahead
(`decode.overlap_steps`, engine/steps_ahead.py), on one GPU, without a server.

    bullet-trt bench steps-ahead --engine-dir engines/llama-3.1-8b [--requests 1024] [--per-step 4]
        [--prompt 256] [--output 128] [--chunk 1024] [--set KEY=VALUE ...] [--json out.json]

Both loops are the chunked engine's own (`EngineCore`) over the same load: `--per-step` new
requests before each step until `--requests` have come, each a prompt of `--prompt` random
tokens generating `--output` tokens greedily with ends ignored, so that steps mix prompt
chunks with hundreds of decode rows as a loaded server's do and both loops run the same
batches. Each loop serves the load twice, the first as warm-up (graph capture, compilation,
the allocator), and the second is timed: its wall time, steps, the period a step and output
tokens a second, and on a GPU the steps' own time (the windows the engine's iteration log
stamps on the GPU's timer, engine/step_log.py) and the share of the wall time the GPU ran none
(`gpu_idle_share`: the host's part that the loop left exposed). The ratio of the periods is what launching ahead gains at
this load, against the plain loop measured in the same run; both must produce the same tokens
(the command exits 1 if they do not). Decode graphs up to 1024 rows and piecewise graphs up to the chunk, as the
serving benchmarks set them.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.tools.bench.iteration_records import load
from bullet_trt.tools.bench.json_output import write_json

DECODE_GRAPHS = "[1,2,4,8,16,32,48,64,96,128,160,192,256,320,384,448,512,640,768,896,1024]"


def serve_load(core, prompts: list[list[int]], output: int, per_step: int) -> tuple[dict[str, list[int]], int]:
    """Runs the load through `core`; returns each request's tokens and the steps taken."""
    params = SamplingParams(max_tokens=output, min_tokens=output, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    arrived = steps = 0
    while arrived < len(prompts) or core.has_unfinished():
        for ids in prompts[arrived:arrived + per_step]:
            rid = f"r{arrived}"
            core.add_request(NewRequest(rid, list(ids), params))
            tokens[rid] = []
            arrived += 1
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    return tokens, steps


def run_loop(engine_dir: str, overrides: dict, prompts: list[list[int]], output: int, per_step: int) -> dict:
    from bullet_trt import LLM

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"  # the engine's own iteration log stamps each step on the GPU
        with LLM(engine_dir, **overrides, **({"serve.iteration_log": str(log)} if cuda else {})) as llm:
            core = llm.engine
            serve_load(core, prompts, output, per_step)  # warm-up: every graph and kernel form met once
            warm_steps = len(load(log)) if cuda else 0
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens, steps = serve_load(core, prompts, output, per_step)
            wall = time.perf_counter() - start
            stats = core.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total, "a loop left KV blocks held"
        timed_steps = load(log)[warm_steps:] if cuda else []
    busy = sum(r["gpu_end_ns"] - r["gpu_start_ns"] for r in timed_steps) / 1e9 if cuda else None
    out_tokens = sum(len(t) for t in tokens.values())
    result = {"wall_s": round(wall, 3), "steps": steps, "period_ms": round(wall / steps * 1e3, 3),
              "output_tokens_per_s": round(out_tokens / wall, 1), "tokens": tokens}
    if busy is not None:
        result.update(gpu_busy_s=round(busy, 3), gpu_idle_share=round(1 - busy / wall, 4))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench steps-ahead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--per-step", type=int, default=4, help="new requests before each step")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens a request")
    ap.add_argument("--output", type=int, default=128, help="output tokens a request")
    ap.add_argument("--chunk", type=int, default=1024, help="serve.chunk_size: tokens a step")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more engine overrides")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from bullet_trt.config import load_engine_config, parse_overrides
    from bullet_trt.model.arch import ModelArch

    vocab = ModelArch.from_checkpoint(load_engine_config(args.engine_dir).checkpoint_path).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    overrides = {"serve.mode": "chunked", "serve.chunk_size": args.chunk}
    if torch.cuda.is_available():
        overrides.update({"decode.max_num_seqs": 1024, "decode.cuda_graph_batch_sizes": DECODE_GRAPHS,
                          "prefill.piecewise_graph_tokens": str([t for t in (128, 256, 512, 1024, 2048, 4096)
                                                                 if t <= args.chunk] or [args.chunk])})
    overrides.update(parse_overrides(args.set))
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "requests": args.requests, "per_step": args.per_step, "prompt": args.prompt, "output": args.output,
              "chunk": args.chunk, "overrides": overrides}
    plain = run_loop(args.engine_dir, {**overrides, "decode.overlap_steps": False}, prompts, args.output, args.per_step)
    ahead = run_loop(args.engine_dir, {**overrides, "decode.overlap_steps": True}, prompts, args.output, args.per_step)
    same = plain.pop("tokens") == ahead.pop("tokens")
    report.update(plain=plain, ahead=ahead, same_tokens=same,
                  ahead_over_plain=round(plain["period_ms"] / ahead["period_ms"], 4))
    print(f"chunked, {args.requests} requests ({args.per_step} a step, {args.prompt} prompt + {args.output} output "
          f"tokens), chunk {args.chunk}, {report['device']}")
    print("| loop | steps | period (ms a step) | output tok/s | GPU idle share of the wall time |\n|---|---|---|---|---|")
    for name, r in (("plain", plain), ("launched one ahead", ahead)):
        print(f"| {name} | {r['steps']} | {r['period_ms']} | {r['output_tokens_per_s']} | {r.get('gpu_idle_share', '-')} |")
    print(f"launched one ahead / plain: {report['ahead_over_plain']}x; same tokens: {same}")
    if args.json:
        write_json(args.json, report)
    return 0 if same else 1
