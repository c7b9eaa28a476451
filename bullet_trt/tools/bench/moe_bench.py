"""`bullet-trt bench moe`: the fused mixture-of-experts kernels, and an MoE engine, against
the GPU's ceilings.

Layers (unless --no-layers): --layers MoE layers of the shape of --arch (default
qwen3-30b-a3b: hidden 2048, 128 experts of 768, top 8; bf16), each with its own random experts
and router, so that a step streams its experts from memory rather than from L2.
- decode: routing and fused_moe of every layer for --batches rows, captured in one CUDA graph
  and replayed (as the engine's decode step runs them). Reported as GB/s of the bytes the step
  must read, which are the experts its rows were routed to, counted per layer (unique experts
  hit) in an eager run of the same inputs, and the routers, against the device-to-device copy
  bandwidth.
- prefill: the same layers for --prefill-tokens-list tokens, eager, and captured in a CUDA graph
  (a slow host sets the eager time: 0.94-0.98 ms a layer at 1024-4096 tokens alike on one whose
  Python ran at half the usual pace). Reported as TFLOP/s of the routed expert GEMMs
  (2 * T * k * 3 * hidden * inter per layer) against the bf16 GEMM rate (8192^3) and against
  torch's two dense GEMMs over all T * k rows at once (what a grouped GEMM could at best reach
  on these shapes).

Engine (with --engine-dir, e.g. `build_engines.py --dummy-weights --arch qwen3-30b-a3b`): the
engine's decode step (random tokens, --batch rows at --ctx, through its CUDA graphs) against
the bytes it reads (the weights outside the experts, the experts its rows reached, counted
per layer in an eager run of the same step, and the KV cache), next to what the performance
model's uniform-routing estimate says; and a prefill of --prefill-tokens against the GEMM
rate over its FLOPs (routed experts only).

The kernels take their tiles from the tuned table of the GPU and layer shape where there is
one (`bullet-trt bench moe-tune` measures it), so the layer table times what serving runs.

--fp8-experts: the layers' experts as FP8 blocks (kernels/fp8_blocks.py; their bytes counted at
one a weight plus the scales) and the engine served with quantization=fp8; --fp8-activations: their
inputs rounded to FP8 too (quantization=fp8-w8a8; the products on FP8 tensor cores), and that
rounding's own kernel timed at each row count of the table against the copy bandwidth.

    bullet-trt bench moe [--engine-dir engines/qwen3-30b-a3b] [--json out.json]
    bash scripts/gpu_run.sh bench moe     # on a GPU machine: builds the dummy engine first

Correctness of the same kernels is tests/gpu/test_fused_moe.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import torch

from bullet_trt.engine.kv_pool import fill_random
from bullet_trt.tools.bench.kernel_bench import copy_gbs, do_bench, gemm_tflops
from bullet_trt.tools.bench.json_output import write_json

DTYPE = torch.bfloat16


def moe_arch(name: str):
    """The preset called ``name``, which must have MoE layers: else a SystemExit naming --arch."""
    from bullet_trt.model.arch import ModelArch
    from bullet_trt.model.presets import PRESETS

    if name not in PRESETS:
        raise SystemExit(f"--arch must be one of {sorted(PRESETS)}")
    arch = ModelArch.from_hf_dict(PRESETS[name], source=name)
    if not arch.moe_layers:
        raise SystemExit(f"--arch {name} has no MoE layers")
    return arch


def moe_layers(arch, count: int, fp8: bool = False,
               fp8_activations: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
    """(gate_up, down, router, fused_moe's FP8 arguments or {}) of `count` layers, random, on the GPU."""
    from bullet_trt.kernels import fp8_blocks

    e, h, inter = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size

    def normal(*shape, std):
        return torch.empty(*shape, dtype=DTYPE, device="cuda").normal_(0.0, std)

    layers = []
    for _ in range(count):
        w_gate_up, w_down = normal(e, 2 * inter, h, std=h ** -0.5), normal(e, h, inter, std=inter ** -0.5)
        scales = {"fp8_activations": True} if fp8_activations else {}
        if fp8 or fp8_activations:
            blocks = fp8_blocks.quantize_experts(w_gate_up, w_down)
            w_gate_up, w_down = blocks.pop("w_gate_up"), blocks.pop("w_down")
            scales.update(blocks)
        layers.append((w_gate_up, w_down, normal(e, h, std=h ** -0.5), scales))
    return layers


def run_layers(ops, layers, x: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    out = x
    for w_gate_up, w_down, router, scales in layers:
        weights, ids = ops.moe_route(x @ router.t(), top_k, renormalize)
        out = ops.fused_moe(x, w_gate_up, w_down, weights, ids, **scales)
    return out


def experts_hit(ops, layers, x: torch.Tensor, top_k: int, renormalize: bool) -> list[int]:
    return [int(ops.moe_route(x @ layer[2].t(), top_k, renormalize)[1].unique().numel())
            for layer in layers]


def graphed(fn, stream=None):
    """fn captured in a CUDA graph (after a warm-up run that compiles its kernels): the
    replay, which is how the engine runs a decode step. ``stream``: capture there (an SM
    partition's, as a worker captures its graphs on each partition's stream)."""
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def layer_table(arch, num_layers: int, batches: list[int], prefill_tokens: list[int], bw: float,
                rate: float, fp8: bool = False, fp8_activations: bool = False) -> dict:
    from bullet_trt.kernels import fp8_blocks, triton_ops as ops

    h, inter, k = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts_per_tok
    expert_bytes = 3 * h * inter * (fp8_blocks.BYTES_PER_WEIGHT if fp8 or fp8_activations else 2)
    layers = moe_layers(arch, num_layers, fp8, fp8_activations)
    out: dict = {"decode": [], "prefill": []}
    for batch in batches:
        x = torch.randn(batch, h, device="cuda").to(DTYPE)
        hits = experts_hit(ops, layers, x, k, arch.norm_topk_prob)
        nbytes = sum(hits) * expert_bytes + num_layers * arch.num_experts * h * 2
        ms = do_bench(graphed(lambda: run_layers(ops, layers, x, k, arch.norm_topk_prob)))
        row = {"batch": batch, "experts_hit_per_layer": round(sum(hits) / num_layers, 1),
               "ms_per_layer": round(ms / num_layers, 4), "GBps": round(nbytes / ms / 1e6, 1),
               "of_copy_bw": round(nbytes / ms / 1e6 / bw, 3)}
        out["decode"].append(row)
        print(json.dumps(row), flush=True)
    for tokens in prefill_tokens:
        x = torch.randn(tokens, h, device="cuda").to(DTYPE)
        flops = num_layers * 2.0 * tokens * k * 3 * h * inter
        ms = do_bench(lambda: run_layers(ops, layers, x, k, arch.norm_topk_prob))
        graphed_ms = do_bench(graphed(lambda: run_layers(ops, layers, x, k, arch.norm_topk_prob)))
        rows = torch.randn(tokens * k, h, device="cuda").to(DTYPE)
        acts = torch.randn(tokens * k, inter, device="cuda").to(DTYPE)
        w1, w2 = (w[0].to(DTYPE).t() for w in layers[0][:2])  # (h, 2 * inter), (inter, h), as bf16
        dense_ms = do_bench(lambda: (rows @ w1, acts @ w2))
        ours = flops / ms / 1e9
        row = {"tokens": tokens, "ms_per_layer": round(ms / num_layers, 4), "TFLOPs": round(ours, 1),
               "of_gemm_rate": round(ours / rate, 3), "graphed_ms_per_layer": round(graphed_ms / num_layers, 4),
               "graphed_TFLOPs": round(flops / graphed_ms / 1e9, 1),
               "dense_gemm_TFLOPs": round(flops / num_layers / dense_ms / 1e9, 1),
               "of_dense_gemm": round(dense_ms * num_layers / ms, 3)}
        out["prefill"].append(row)
        print(json.dumps(row), flush=True)
    if fp8_activations:
        out["rounding"] = rounding_table(arch, batches + prefill_tokens, bw)
    return out


def rounding_table(arch, token_counts: list[int], bw: float) -> list[dict]:
    """quantization=fp8-w8a8's own kernel: the two inputs a layer rounds to FP8 (its tokens'
    hidden states, then each assignment's silu(gate) * up), graphed as decode runs them, in
    GB/s of the bytes moved (bf16 read, FP8 and a float32 scale per 128 written) against the
    copy bandwidth."""
    from bullet_trt.kernels import fp8_blocks, triton_moe

    h, inter, k = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts_per_tok
    rows = []
    for tokens in token_counts:
        inputs = [torch.randn(tokens, h, device="cuda").to(DTYPE),
                  torch.randn(tokens * k, inter, device="cuda").to(DTYPE)]
        nbytes = sum(t.numel() * 3 + t.shape[0] * -(-t.shape[1] // fp8_blocks.BLOCK) * 4 for t in inputs)
        ms = do_bench(graphed(lambda: [triton_moe.quantize_token_groups(t) for t in inputs]))
        row = {"tokens": tokens, "us_per_layer": round(ms * 1e3, 2), "GBps": round(nbytes / ms / 1e6, 1),
               "of_copy_bw": round(nbytes / ms / 1e6 / bw, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- the engine ---------------------------------------------------------------------------------

def engine_table(engine_dir: str, batch: int, ctx: int, prefill_tokens: int, memory_fraction: float,
                 bw: float, rate: float, quantization: str = "none") -> dict:
    from bullet_trt.config import load_engine_config
    from bullet_trt.engine.sampling import SamplingParams
    from bullet_trt.engine.session import BatchItem, TorchSession
    from bullet_trt.engine.shared_state import build_shared_state
    from bullet_trt.model.transformer import SparseMoeBlock
    from bullet_trt.spatial.calibrate import time_ms
    from bullet_trt.spatial.perf_model import ModelCost, PrefillShape

    cfg = load_engine_config(engine_dir, {"kv.gpu_memory_fraction": memory_fraction, "quantization": quantization})
    state, model = build_shared_state(cfg, share=False)
    fill_random(state.kv_pool)
    arch = state.arch
    if not arch.moe_layers:
        raise SystemExit(f"bench moe: {engine_dir} is not a mixture-of-experts model")
    # the --batch rows graphed, as a serving decode step of that many rows is (the dummy engine's
    # buckets stop at 64: its 384 rows once ran eager, 54.6 ms, and said nothing of serving)
    profile = dataclasses.replace(cfg.prefill, max_num_seqs=max(cfg.prefill.max_num_seqs, batch),
                                  cuda_graph_batch_sizes=sorted({*cfg.decode.cuda_graph_batch_sizes, batch}))
    session = TorchSession(model, state.kv_pool, state.block_size, profile)
    bs = state.block_size
    per_seq = -(-ctx // bs)
    # the prefill's blocks may be the decode rows' own: the pool's contents are noise either way
    need = max(batch * per_seq, -(-prefill_tokens // bs))
    if need > state.num_blocks:
        raise SystemExit(f"bench moe: the steps need {need} KV blocks, the pool has {state.num_blocks}; "
                         "lower --batch / --ctx / --prefill-tokens or raise --memory-fraction")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (batch + prefill_tokens,), generator=gen).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    decode = [BatchItem("d", [tokens[i]], ctx - 1, list(range(i * per_seq, (i + 1) * per_seq)), greedy,
                        True, output_index=1) for i in range(batch)]
    prefill = [BatchItem("p", tokens[batch:], 0, list(range(-(-prefill_tokens // bs))), greedy, True)]

    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    hits: list[int] = []

    def count(block, args):  # forward(ops, x): the experts this layer's rows reach
        _, ids = args[0].moe_route(block.gate(args[1]), block.top_k, block.renormalize)
        hits.append(int(ids.unique().numel()))

    handles = [b.register_forward_pre_hook(count) for b in blocks]
    graphs, session.graphs = session.graphs, None  # eager, so that the hooks run
    try:
        session.run(decode)
    finally:
        session.graphs = graphs
        for hnd in handles:
            hnd.remove()
    stream = torch.cuda.current_stream()
    decode_ms = time_ms(lambda: session.run(decode), stream, repeats=10)
    prefill_ms = time_ms(lambda: session.run(prefill), stream, repeats=3)
    cost = ModelCost.of_state(state)
    one_expert = cost.expert_bytes / len(arch.moe_layers)
    kv = cost.kv_bytes_per_token * batch * ctx
    routed = cost.weight_bytes + sum(hits) * one_expert + kv
    modelled = cost.step_weight_bytes(batch) + kv
    shape = PrefillShape.of([prefill_tokens])
    flops = cost.flops_per_token * shape.num_tokens + cost.attn_flops_per_pair * shape.attn_pairs
    row = {"batch": batch, "ctx": ctx, "graphed": session.graphs is not None and session.graphs.bucket(batch) is not None,
           "experts_hit_per_layer": round(sum(hits) / len(hits), 1),
           "perf_model_experts_hit": round(cost.experts_hit(batch), 1),
           "decode_ms": round(decode_ms, 3), "decode_GBps_of_routed": round(routed / decode_ms / 1e6, 1),
           "decode_of_copy_bw": round(routed / decode_ms / 1e6 / bw, 3),
           "perf_model_bytes_over_routed": round(modelled / routed, 3),
           "prefill_tokens": prefill_tokens, "prefill_ms": round(prefill_ms, 3),
           "prefill_TFLOPs": round(flops / prefill_ms / 1e9, 1),
           "prefill_of_gemm_rate": round(flops / prefill_ms / 1e9 / rate, 3)}
    print(json.dumps(row), flush=True)
    return row


def markdown(result: dict, arch_name: str, layers: int, quantization: str = "none") -> str:
    lines = [f"copy {result['copy_GBps']} GB/s, bf16 GEMM {result['gemm_TFLOPs']} TFLOP/s", ""]
    if "layers" in result:
        experts = {"none": "bf16", "fp8": "FP8 experts, bf16 activations",
                   "fp8-w8a8": "FP8 experts, FP8 activations"}[quantization]
        lines += [f"{arch_name} MoE layers ({layers} distinct, {experts}), decode as a CUDA graph",
                  "", "| decode rows | experts hit / layer | ms / layer | GB/s of routed experts | of copy BW |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['experts_hit_per_layer']} | {r['ms_per_layer']} | {r['GBps']} | "
                  f"{r['of_copy_bw']:.0%} |" for r in result["layers"]["decode"]]
        lines += ["", "| prefill tokens | ms / layer | TFLOP/s | of GEMM rate | dense GEMMs, same rows | of them "
                  "| graphed ms / layer | graphed TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {r['ms_per_layer']} | {r['TFLOPs']} | {r['of_gemm_rate']:.0%} | "
                  f"{r['dense_gemm_TFLOPs']} | {r['of_dense_gemm']:.0%} | {r.get('graphed_ms_per_layer', '-')} | "
                  f"{r.get('graphed_TFLOPs', '-')} |" for r in result["layers"]["prefill"]]
        if "rounding" in result["layers"]:
            lines += ["", "| tokens | FP8 rounding of a layer's inputs, us | GB/s | of copy BW |", "|---|---|---|---|"]
            lines += [f"| {r['tokens']} | {r['us_per_layer']} | {r['GBps']} | {r['of_copy_bw']:.0%} |"
                      for r in result["layers"]["rounding"]]
    if "engine" in result:
        r = result["engine"]
        lines += ["", "| engine | value |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in r.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b", help="preset whose MoE layer shape the layer table uses")
    ap.add_argument("--layers", type=int, default=8, help="distinct MoE layers per timed step")
    ap.add_argument("--batches", default="1,8,32,64,128,256", help="decode rows of the layer table")
    ap.add_argument("--prefill-tokens-list", default="512,2048,8192", help="prefill tokens of the layer table")
    ap.add_argument("--no-layers", action="store_true", help="skip the layer table")
    ap.add_argument("--engine-dir", help="an MoE engine to time (its decode step and a prefill)")
    ap.add_argument("--batch", type=int, default=64, help="engine decode rows")
    ap.add_argument("--ctx", type=int, default=512, help="engine decode context per row")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="engine prefill tokens")
    ap.add_argument("--memory-fraction", type=float, default=0.9,
                    help="the engine's kv.gpu_memory_fraction (its weights are most of the GPU)")
    ap.add_argument("--fp8-experts", action="store_true",
                    help="the experts as FP8 blocks: in the layer table, and the engine with quantization=fp8")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="FP8 experts with their inputs rounded to FP8 too (quantization=fp8-w8a8)")
    ap.add_argument("--json", help="write every table's rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench moe needs a CUDA GPU")
    quantization = "fp8-w8a8" if args.fp8_activations else "fp8" if args.fp8_experts else "none"
    arch = moe_arch(args.arch)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    stream = torch.cuda.current_stream()
    result: dict = {"copy_GBps": round(copy_gbs(stream), 1), "gemm_TFLOPs": round(gemm_tflops(stream), 1)}
    print(json.dumps(result), flush=True)
    if args.engine_dir:  # first: the engine's weights need the memory the layers would hold
        result["engine"] = engine_table(args.engine_dir, args.batch, args.ctx, args.prefill_tokens,
                                        args.memory_fraction, result["copy_GBps"], result["gemm_TFLOPs"],
                                        quantization)
        gc.collect()  # the engine's weights and graphs, before the layers take their memory
        torch.cuda.empty_cache()
    if not args.no_layers:
        batches = [int(b) for b in args.batches.split(",") if b]
        tokens = [int(t) for t in args.prefill_tokens_list.split(",") if t]
        result["layers"] = layer_table(arch, args.layers, batches, tokens, result["copy_GBps"],
                                       result["gemm_TFLOPs"], quantization != "none", args.fp8_activations)
    result["quantization"] = quantization
    print(markdown(result, args.arch, args.layers, quantization))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
