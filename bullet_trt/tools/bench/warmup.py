"""Unmeasured requests sent before a sweep, so that first-call costs (kernel autotuning, JIT,
CUDA graphs, allocator growth) stay out of the measured runs."""
from __future__ import annotations

from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.loadgen import LoadGenerator, LoadGenOptions


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


def warm_up(url: str, model: str, requests: list[ds.BenchRequest]) -> None:
    """Sends them and waits; a server that fails one would spoil every measured run, so that ends the sweep."""
    if not requests:
        return
    res = LoadGenerator(url, LoadGenOptions(model=model, timeout_s=900, drain_timeout_s=900)).run(requests)
    bad = [r.error for r in res.records if not r.ok]
    if bad:
        raise SystemExit(f"warm-up requests to {url} (model {model}) failed: {bad[0]}")
