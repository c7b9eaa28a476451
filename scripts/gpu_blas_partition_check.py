"""Do GEMM kernels get chosen for the SMs of a green partition, or for the whole GPU?

cuBLAS picks tile shapes and split-K from the device's SM count; on a green-context partition
that count is wrong, and a grid sized for 132 SMs can run in two waves on 100. This times the
Llama-3.1-8B decode step (graph replay), a prefill and the projection GEMMs on partitions of
several sizes under three settings: cuBLAS (torch's default), cuBLASLt, and cuBLASLt told the
partition's SM count (torch._C._set_sm_carveout_experimental, i.e.
CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET). Prints one JSON row per measurement and a summary.

    python scripts/gpu_blas_partition_check.py --engine-dir /tmp/engines/llama-3.1-8b [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from bullet_trt.spatial.calibrate import measurement_setup, profile_items, time_ms

SETTINGS = ("cublas", "cublaslt", "cublaslt+sm_target")
# (name, K, N) of Llama-3.1-8B's projections, q/k/v and gate/up fused as the engine runs them
GEMMS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
         ("lm_head", 4096, 128256))


def apply(setting: str, total_sms: int, sms: int) -> None:
    torch.backends.cuda.preferred_blas_library("cublas" if setting == "cublas" else "cublaslt")
    carveout = total_sms - sms if setting.endswith("sm_target") and sms < total_sms else None
    torch._C._set_sm_carveout_experimental(carveout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--sms", default="32,64,100")
    ap.add_argument("--json")
    args = ap.parse_args()
    from bullet_trt.engine.cuda_graphs import DecodeGraphs
    from bullet_trt.kernels import ops_for

    cfg, state, session, streams = measurement_setup(args.engine_dir, [int(x) for x in args.sms.split(",")],
                                                     {"kv.gpu_memory_fraction": 0.6, "decode.max_num_seqs": 256,
                                                      "decode.cuda_graph_batch_sizes": [64, 224]})
    total = max(streams)
    set_num_sms = getattr(ops_for(state.kv_pool.device), "set_num_sms", None)
    bs = state.block_size
    decodes = {"decode_b64_ctx1024": profile_items([1024] * 64, True, bs),
               "decode_b224_ctx512": profile_items([512] * 224, True, bs)}
    prefill = profile_items([256, 256], False, bs)
    rows, retired = [], []
    for sms, stream in sorted(streams.items()):
        if set_num_sms:
            set_num_sms(sms)
        for setting in SETTINGS:
            apply(setting, total, sms)
            if session.graphs is not None:  # recapture: a graph keeps the GEMMs chosen at capture
                g = session.graphs
                retired.append(g)  # a graph pool is not reused once captured into
                session.graphs = DecodeGraphs(g.model, g.kv_pool, g.block_size, g.batch_sizes, g.max_model_len)
            row = {"sms": sms, "setting": setting}
            for name, items in decodes.items():
                row[name] = round(time_ms(lambda: session.run(items), stream, repeats=10), 3)
            row["prefill_2x256"] = round(time_ms(lambda: session.run(prefill), stream, repeats=5), 3)
            for m in (64, 224, 512):
                for name, k, n in GEMMS:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    ms = time_ms(lambda: torch.nn.functional.linear(x, w), stream, repeats=20)
                    row[f"{name}_m{m}_GBps"] = round((n * k + m * k + m * n) * 2 / ms / 1e6, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    apply("cublas", total, total)
    print("\nSMs | setting | decode B64 ctx1024 ms | decode B224 ctx512 ms | prefill 2x256 ms")
    for r in rows:
        print(f"{r['sms']} | {r['setting']} | {r['decode_b64_ctx1024']} | {r['decode_b224_ctx512']} | {r['prefill_2x256']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
