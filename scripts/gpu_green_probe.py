"""Probes two questions about green-context partitions on this GPU.

1. `gemm`: for every split s, run a bf16 GEMM and an elementwise op on the group's stream and
   on the remainder's stream; report which fail (cuBLAS on small or odd-sized partitions).
2. `pair ROLE_A ROLE_B`: two processes (run under MPS) loop GEMMs on the given sides of one
   split (group/remainder/full) and report iterations per second, alone and together.
   Disjoint partitions keep their alone rates when run together; shared SMs slow both.

    python scripts/gpu_green_probe.py gemm
    python scripts/gpu_green_probe.py pair group remainder   # under MPS
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from bullet_trt.spatial.partitioners.green import create_green_stream, device_sm_resource, split_once


def stream_for(side: str, split: int):
    dev, res = device_sm_resource(0)
    if side == "full":
        return torch.cuda.Stream(), None, int(res.sm.smCount)
    group, rem = split_once(res, split)
    r = group if side == "group" else rem
    ctx, s = create_green_stream(dev, r, side)
    return torch.cuda.get_stream_from_external(s), ctx, int(r.sm.smCount)


def gemm_table() -> None:
    torch.zeros(1, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    x = torch.randn(1 << 24, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)  # a k_proj weight
    rows = []
    for split in range(8, 132, 8):
        for side in ("group", "remainder"):
            s, ctx, n = stream_for(side, split)
            row = {"split": split, "side": side, "sms": n}
            for name, fn in (("elementwise", lambda: x.mul_(1.0)), ("gemm", lambda: a @ b),
                             ("gemm_m16", lambda: a[:16] @ b),
                             ("linear_m1", lambda: torch.nn.functional.linear(a[:1], w)),
                             ("linear_m3", lambda: torch.nn.functional.linear(a[:3], w))):
                try:
                    with torch.cuda.stream(s):
                        fn()
                    s.synchronize()
                    row[name] = "ok"
                except Exception as e:  # noqa: BLE001 - the probe reports every failure
                    row[name] = f"FAIL {type(e).__name__}: {str(e)[:80]}"
                    torch.cuda.synchronize()
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if any(str(v).startswith("FAIL") for v in r.values())]
    print(f"gemm probe: {len(rows) - len(bad)} ok, {len(bad)} with failures", flush=True)


def loop(side: str, split: int, start_at: float, seconds: float) -> None:
    s, ctx, n = stream_for(side, split)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ b
    s.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    it, t0 = 0, time.time()
    with torch.cuda.stream(s):
        while time.time() - t0 < seconds:
            for _ in range(5):
                a @ b
            s.synchronize()
            it += 5
    print(json.dumps({"side": side, "sms": n, "gemm_per_s": round(it / (time.time() - t0), 1)}), flush=True)


def pair(side_a: str, side_b: str, split: int = 64) -> None:
    def spawn(side, start):
        return subprocess.Popen([sys.executable, __file__, "loop", side, str(split), str(start), "3"],
                                stdout=subprocess.PIPE, text=True)
    for label, sides in (("alone", [side_a]), ("alone", [side_b]), ("together", [side_a, side_b])):
        start = time.time() + 15
        procs = [spawn(sd, start) for sd in sides]
        outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        print(json.dumps({"run": label, "split": split, "results": outs}), flush=True)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "gemm":
        gemm_table()
    elif cmd == "pair":
        pair(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 64)
    elif cmd == "loop":
        loop(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
