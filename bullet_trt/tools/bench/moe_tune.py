"""`bullet-trt bench moe-tune`: the fused MoE kernels' tuned tile table for this GPU and one
MoE layer shape (bullet_trt/kernels/moe_tiles.py reads it).

For each of --tokens token counts, one layer of the shape of --arch (its experts random, so
that they stream from memory; routing from a random router) runs ``fused_moe`` with every
tile of the search space, captured in a CUDA graph as the decode step runs it, timed by
Triton's bench (L2 flushed between runs). The fastest tile per token count is the table's row,
next to the untuned tile's time (triton_moe.untuned_forms).

The search space is 192 tiles (384 with --fp8-experts, each also with its operands swapped);
``--shard I/N`` times every N-th of them from the I-th, so N
GPUs of one machine share the work, each writing its timings with --json; ``--merge`` joins
the parts (they must name the same GPU, layer and SM count) into the table:

    bullet-trt bench moe-tune --shard 0/4 --json part0.json     # ... one per GPU
    bullet-trt bench moe-tune --merge part*.json --out-dir bullet_trt/kernels/moe_tile_tables
    bullet-trt bench moe-tune --out-dir bullet_trt/kernels/moe_tile_tables   # one GPU: all of it

With ``--sms N`` every tile runs on a green-context partition of N SMs (decode's side of a
split, or prefill's where decode never gets N), as a bullet worker runs its steps, and the table
is that partition's (``moe_tiles``: kernels planning for N SMs take it). Each row also carries
the time of the tile the kernels took before the table (``before_ms``: on a partition, the
nearest table's, the whole GPU's where it is the only one), so the table says what it gains.

``--fp8-experts`` tunes the layer with its experts as FP8 blocks (quantization=fp8): a table of
its own (dtype float8_e4m3fn in its name), which FP8 experts take; without one they run the
untuned tiles. ``--fp8-activations`` tunes them with FP8 inputs too (quantization=fp8-w8a8; dtype
float8_e4m3fn_w8a8).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from bullet_trt.kernels import moe_tiles
from bullet_trt.tools.bench.json_output import write_json

TOKENS = "1,8,16,32,64,96,128,192,256,320,384,448,512,640,768,1024,1536,2048,3072,4096,8192"


def tile_space(swapped: bool = False) -> list[dict]:
    """Every tile tried: 16..128-row blocks (an expert sees from one row in small decode
    batches to hundreds in prefill), GROUP_M 1 or 8 (whether row blocks of one expert walk its
    columns together, keeping its weights in L2 for the next block); ``swapped``: each also with
    its operands swapped (SWAP_AB; searched for FP8 experts, whose weights are converted in
    registers before the product)."""
    plain = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)
             for m, n, k, g, w, s in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (1, 8),
                                                       (4, 8), (3, 4))]
    return plain + [{**tile, moe_tiles.SWAP_AB: 1} for tile in plain] if swapped else plain


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must be I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise SystemExit(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def layer_shape(arch, fp8: bool = False, fp8_activations: bool = False) -> dict:
    """``dtype``: the experts' weights', with ``_w8a8`` where the activations are FP8 too
    (moe_tiles.dtype_label)."""
    weights = "float8_e4m3fn" if fp8 or fp8_activations else "bfloat16"
    return {"experts": arch.num_experts, "inter": arch.moe_intermediate_size, "hidden": arch.hidden_size,
            "top_k": arch.num_experts_per_tok, "dtype": moe_tiles.dtype_label(weights, fp8_activations)}


def partition(sms: int):
    """A green-context stream whose kernels get ``sms`` SMs, and the SMs it really has:
    decode's side of a split where decode can get that many, else prefill's."""
    import torch

    from bullet_trt.spatial.partitioners import make_partitioner

    part = make_partitioner("green", torch.device("cuda", torch.cuda.current_device()))
    total, offered = part.total_sms, part.splits()
    if total - sms in offered:
        role, split = "decode", total - sms
    elif sms in offered:
        role, split = "prefill", sms
    else:
        raise SystemExit(f"bench moe-tune: --sms {sms} is no partition of this GPU's {total} SMs: green "
                         f"gives either side {offered[0]}..{offered[-1]} step {part.granularity}")
    part.prepare(role, [split])
    return part, part.stream(split), part.actual_sms(split)[0 if role == "prefill" else 1]


def time_tiles(arch, tokens_list: list[int], tiles: list[dict], stream=None, fp8: bool = False,
               fp8_activations: bool = False) -> list[dict]:
    """{tokens, tile, ms} (or error) for every token count and tile, captured and replayed on
    ``stream`` (an SM partition's) when given; ``fp8``: the experts as FP8 blocks."""
    import contextlib

    import torch

    from bullet_trt.kernels import triton_moe
    from bullet_trt.tools.bench.kernel_bench import do_bench
    from bullet_trt.tools.bench.moe_bench import DTYPE, graphed, moe_layers

    (w_gate_up, w_down, router, scales), = moe_layers(arch, 1, fp8, fp8_activations)
    k = arch.num_experts_per_tok
    out = []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        try:
            for tokens in tokens_list:
                x = torch.randn(tokens, arch.hidden_size, device="cuda").to(DTYPE)
                weights, ids = triton_moe.moe_route(x @ router.t(), k, arch.norm_topk_prob)
                for tile in tiles:
                    triton_moe.MOE_TILE_OVERRIDE = tile
                    row = {"tokens": tokens, "tile": tile}
                    try:
                        replay = graphed(lambda: triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids, **scales),
                                         stream)
                        row["ms"] = round(do_bench(replay, warmup_ms=10, rep_ms=40), 5)
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit the GPU is a result
                        row["error"] = str(e)[:160]
                    out.append(row)
                best = min((r for r in out if r["tokens"] == tokens and "ms" in r), key=lambda r: r["ms"],
                           default=None)
                print(json.dumps({"tokens": tokens, "best": best}), flush=True)
        finally:
            triton_moe.MOE_TILE_OVERRIDE = None
    return out


def kernels_tiles(arch, tokens_list: list[int], fp8: bool = False, fp8_activations: bool = False) -> dict[int, dict]:
    """The tile each token count takes now, at the SM count the kernels plan for (the tables
    already there: on a partition, the nearest one's)."""
    import torch

    from bullet_trt.kernels import fp8_blocks, triton_moe

    weights = fp8_blocks.FP8 if fp8 or fp8_activations else torch.bfloat16
    return {t: triton_moe.moe_config(torch.bfloat16, t, arch.num_experts_per_tok, arch.num_experts,
                                     arch.moe_intermediate_size, arch.hidden_size, torch.device("cuda"), weights,
                                     fp8_activations)
            for t in tokens_list}


def untuned_tiles(arch, tokens_list: list[int], fp8_activations: bool = False) -> dict[int, dict]:
    """The tile each token count takes without a table."""
    import torch

    from bullet_trt.kernels import triton_moe

    return {t: triton_moe.untuned_config(torch.bfloat16, t, arch.num_experts_per_tok, arch.num_experts,
                                         fp8_activations)
            for t in tokens_list}


def merge(parts: list[dict]) -> dict:
    """The table from the parts' timings: one GPU model, one layer shape, one SM count."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("device", "layer", "sms"):
            if part.get(key) != first.get(key):
                raise SystemExit(f"--merge: the parts differ in {key}: {first.get(key)} vs {part.get(key)}")
    timings = [t for part in parts for t in part["timings"]]
    untuned = {int(t): tile for part in parts for t, tile in part["untuned"].items()}
    before = {int(t): tile for part in parts for t, tile in part.get("before", {}).items()}
    table = {"device": first["device"], "layer": first["layer"], "tuned_on": first["tuned_on"]}
    if first.get("sms") is not None:
        table["sms"] = first["sms"]
    return {**table, "tiles_timed": len({json.dumps(t["tile"], sort_keys=True) for t in timings}),
            "rows": moe_tiles.best_rows(timings, untuned, before)}


def write_table(table: dict, out_dir: str) -> Path:
    moe_tiles.parse_table(table, "the merged table")  # what the kernels will read back
    layer = table["layer"]
    name = moe_tiles.table_name(table["device"], layer["experts"], layer["inter"], layer["hidden"],
                                layer["top_k"], layer["dtype"], table.get("sms"))
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def markdown(table: dict) -> str:
    where = f"on {table['sms']} SMs" if table.get("sms") is not None else "on the whole GPU"
    lines = [f"{table['device']} {where}, layer {table['layer']}, {table['tiles_timed']} tiles timed", "",
             "| tokens | tile (M, N, K, group, warps, stages) | ms | untuned ms | untuned / tuned "
             "| before ms | before / tuned |", "|---|---|---|---|---|---|---|"]
    for row in table["rows"]:
        t = row["tile"]
        cells = []
        for key in ("untuned_ms", "before_ms"):
            ms = row.get(key)
            cells += [str(ms) if ms else "-", f"{ms / row['ms']:.2f}x" if ms else "-"]
        swapped = ", swapped" if t.get(moe_tiles.SWAP_AB) else ""
        lines.append(f"| {row['tokens']} | {t['BLOCK_M']}, {t['BLOCK_N']}, {t['BLOCK_K']}, {t['GROUP_M']}, "
                     f"{t['num_warps']}, {t['num_stages']}{swapped} | {row['ms']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench moe-tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b", help="preset whose MoE layer shape is tuned")
    ap.add_argument("--tokens", default=TOKENS, help="token counts the table has rows for")
    ap.add_argument("--shard", default="0/1", help="I/N: time every N-th tile from the I-th")
    ap.add_argument("--sms", type=int, help="tune on a green-context partition of this many SMs (default: "
                    "the whole GPU)")
    ap.add_argument("--fp8-experts", action="store_true", help="tune the experts as FP8 blocks (quantization=fp8)")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="tune FP8 experts with FP8 inputs (quantization=fp8-w8a8): a table of their own")
    ap.add_argument("--json", help="write this shard's timings here (for --merge)")
    ap.add_argument("--merge", nargs="+", metavar="PART", help="join these shards' timings into the table")
    ap.add_argument("--out-dir", help="write the table (named by GPU and layer) into this directory")
    args = ap.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
    else:
        parts = [tune(args)]
        write_json(args.json, parts[0])
    if args.merge or parse_shard(args.shard)[1] == 1:
        table = merge(parts)
        print(markdown(table))
        if args.out_dir:
            print(f"wrote {write_table(table, args.out_dir)}")
    return 0


def tune(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench moe-tune needs a CUDA GPU (or --merge)")
    from bullet_trt.kernels import sm_budget
    from bullet_trt.tools.bench.moe_bench import moe_arch

    arch = moe_arch(args.arch)
    index, count = parse_shard(args.shard)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    fp8 = args.fp8_experts or args.fp8_activations
    tiles = tile_space(swapped=fp8)[index::count]
    part, stream, sms = None, None, None
    if args.sms is not None:
        part, stream, sms = partition(args.sms)
    sm_budget.set_num_sms(sms)  # what the kernels plan for, as a worker on that partition sets it
    where = f"on {sms} SMs" if sms is not None else "on the whole GPU"
    print(f"{torch.cuda.get_device_name()} {where}: {len(tiles)} tiles x {len(tokens)} token counts", flush=True)
    try:
        result = {"device": torch.cuda.get_device_name(), "layer": layer_shape(arch, fp8, args.fp8_activations),
                  "sms": sms, "tuned_on": time.strftime("%Y-%m-%d"), "shard": args.shard,
                  "timings": time_tiles(arch, tokens, tiles, stream, fp8, args.fp8_activations),
                  "untuned": untuned_tiles(arch, tokens, args.fp8_activations),
                  "before": kernels_tiles(arch, tokens, fp8, args.fp8_activations)}
    finally:
        sm_budget.set_num_sms(None)
        if part is not None:
            part.close()  # its green context outlives every step queued on its stream
    return result


if __name__ == "__main__":
    raise SystemExit(main())
