"""bullet-trt doctor: what this GPU offers for SM partitioning, and a measurement.

    python -m bullet_trt.tools.doctor [--json out.json] [--prefill-sms 64] [--cross-process auto]
                                   [--gemm-n 4096] [--gemm-seconds 2]

Reports the GPU (name, driver/CUDA versions, SMs, memory and utilization from NVML),
the MPS daemon and whether this process is an MPS client, which partitioners work,
the green-context splits with the SM counts each really got, and a MEASUREMENT of one
split (prefill = the group, decode = the remainder of one split call):

- in one process on two green streams (always): the SM-id probe (native/libbullet_smid.so,
  or a Triton kernel without it) runs on each partition alone and on both at once; the
  report gives the SM ids each side ran on (disjoint?) and whether they ran concurrently;
- in two spawned processes, one per role, when an MPS daemon answers (the production
  layout: prefill and decode workers as MPS clients; `--cross-process always` runs it
  without MPS too, which shows time slicing). %smid is NOT a physical SM id across MPS
  clients (measured on an H200: group and remainder reported [0-63] and [0-67] while a
  throughput test showed them disjoint), so the SM-id sets are only reported there, and
  disjointness is judged by THROUGHPUT: each process runs a bf16 GEMM loop on its
  partition alone, then both at once on group + remainder, then both on the group (the
  control: the same SMs). Disjoint = together >= 1.3 x control and each side keeps
  >= 60 % of its alone rate; concurrent = together > 1.2 x the faster side alone.

In one process concurrency is judged from the probe's own records, not from wall time:
each block spins on %globaltimer for the same time whether or not it is descheduled, so
it also records the iterations it managed (work) and the gaps in its timer reads (time it
was not running). Concurrent = the two windows overlap, each side did about the work it
did alone, and neither side was descheduled.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

from bullet_trt.spatial.gpu_monitor import nvml_handle
from bullet_trt.spatial.partitioners import make_partitioner, native
from bullet_trt.spatial.partitioners.base import KINDS

GAP_NS = 20_000  # same threshold as native/smid_probe.cu
OVERLAP_MIN = 0.8
WORK_MIN = 0.8
# cross-process throughput verdict (GEMM loops of two MPS clients)
DISJOINT_VS_CONTROL = 1.3   # together(group + remainder) >= 1.3 x together(group + group)
KEEP_MIN = 0.6              # each side keeps >= 60 % of its alone rate (power/clock limits cost ~25 %)
CONCURRENT_VS_ALONE = 1.2   # together > 1.2 x the faster side alone (time slicing gives ~1.0)
SMID_XP_NOTE = ("%smid is not a physical SM id across MPS clients (MPS renumbers SMs per client): these "
                "SM-id sets are no evidence of shared or disjoint SMs; the GEMM throughput test decides")


# ---------------------------------------------------------------------------------------
# probe: native library, or a Triton kernel doing the same
# ---------------------------------------------------------------------------------------
try:  # the Triton fallback probe (GPU machines ship triton; CPU machines may not)
    import triton
    import triton.language as tl

    from bullet_trt.kernels.triton_clock import globaltimer
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:
    @triton.jit
    def _smid():
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def bullet_smid_triton(out_ptr, spin_ns, gap_ns):
        """Same records as native/smid_probe.cu, one program (1 warp) per block."""
        pid = tl.program_id(0)
        sm0 = _smid()
        t0 = globaltimer()
        now = t0
        prev = t0
        iters = t0 * 0
        max_gap = t0 * 0
        gaps = t0 * 0
        while now - t0 < spin_ns:
            now = globaltimer()
            d = now - prev
            max_gap = tl.maximum(max_gap, d)
            gaps += tl.where(d > gap_ns, d, 0)
            prev = now
            iters += 1
        sm1 = _smid()
        base = out_ptr + pid.to(tl.int64) * 7
        tl.store(base + 0, sm0.to(tl.int64))
        tl.store(base + 1, t0)
        tl.store(base + 2, now)
        tl.store(base + 3, iters)
        tl.store(base + 4, max_gap)
        tl.store(base + 5, gaps)
        tl.store(base + 6, sm1.to(tl.int64))
else:
    bullet_smid_triton = None


def _triton_kernel():
    if bullet_smid_triton is None:
        raise ImportError("triton is not installed")
    return bullet_smid_triton


class Probe:
    """Launches the SM-id probe on a stream: 'native' (libbullet_smid.so) or 'triton'."""

    def __init__(self, kind: str = "auto", device="cuda") -> None:
        import torch

        self.device = torch.device(device)
        self.native_error = ""
        if kind in ("auto", "native"):
            try:
                native.smid_lib()
                self.kind = "native"
                return
            except native.NativeLibraryMissing as e:
                if kind == "native":
                    raise
                self.native_error = str(e)
        try:
            _triton_kernel()
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"no SM-id probe: {self.native_error or 'native probe not requested'}; "
                               f"Triton unavailable ({type(e).__name__}: {e})") from e
        self.kind = "triton"

    def alloc(self, blocks: int):
        import torch

        return torch.zeros((blocks, native.SMID_FIELDS), dtype=torch.int64, device=self.device)

    def launch(self, stream, records, spin_us: int) -> None:
        """Asynchronous launch on `stream`; `records` from alloc() and already initialized."""
        import torch

        blocks = records.shape[0]
        if self.kind == "native":
            native.smid_launch(stream, blocks, spin_us, records)
        else:
            with torch.cuda.stream(stream):
                _triton_kernel()[(blocks,)](records, int(spin_us) * 1000, GAP_NS, num_warps=1)

    def run(self, stream, blocks: int, spin_us: int) -> list[list[int]]:
        import torch

        rec = self.alloc(blocks)
        torch.cuda.synchronize(self.device)
        self.launch(stream, rec, spin_us)
        stream.synchronize()
        return rec.cpu().tolist()


def summarize(records: list[list[int]]) -> dict[str, Any]:
    """One side's probe records -> SM set, time window, work and descheduling."""
    smids = sorted({int(r[0]) for r in records})
    start = min(r[1] for r in records)
    end = max(r[2] for r in records)
    windows = [r[2] - r[1] for r in records]
    return {
        "blocks": len(records), "sm_ids": smids, "n_sms": len(smids),
        "start_ns": int(start), "end_ns": int(end), "window_ms": round((end - start) / 1e6, 3),
        "iters_median": int(statistics.median(r[3] for r in records)),
        "max_gap_us": round(max(r[4] for r in records) / 1e3, 1),
        "descheduled_fraction": round(statistics.mean(r[5] / w if w else 0.0 for r, w in zip(records, windows)), 4),
        "migrated_blocks": sum(1 for r in records if r[0] != r[6]),
    }


def compare(prefill: dict, decode: dict, prefill_alone: dict | None, decode_alone: dict | None,
            prefill_sms: int, decode_sms: int) -> dict[str, Any]:
    """Disjointness and concurrency of the two sides of a simultaneous run."""
    a, b = set(prefill["sm_ids"]), set(decode["sm_ids"])
    overlap_ns = max(0, min(prefill["end_ns"], decode["end_ns"]) - max(prefill["start_ns"], decode["start_ns"]))
    shortest = max(1, min(prefill["end_ns"] - prefill["start_ns"], decode["end_ns"] - decode["start_ns"]))
    out: dict[str, Any] = {
        "disjoint": not (a & b), "shared_sm_ids": sorted(a & b),
        "prefill_within_partition": len(a) <= prefill_sms, "decode_within_partition": len(b) <= decode_sms,
        "window_overlap_fraction": round(overlap_ns / shortest, 3),
        "max_descheduled_fraction": max(prefill["descheduled_fraction"], decode["descheduled_fraction"]),
    }
    ratios = []
    for name, both, alone in (("prefill", prefill, prefill_alone), ("decode", decode, decode_alone)):
        if alone and alone["iters_median"]:
            r = round(both["iters_median"] / alone["iters_median"], 3)
            out[f"{name}_work_vs_alone"] = r
            ratios.append(r)
    out["concurrent"] = bool(out["window_overlap_fraction"] >= OVERLAP_MIN
                             and out["max_descheduled_fraction"] <= 1 - WORK_MIN
                             and all(r >= WORK_MIN for r in ratios))
    return out


def _overlap(w1: tuple[float, float], w2: tuple[float, float]) -> float:
    """Overlap of two (start, end) windows as a fraction of the shorter one."""
    both = max(0.0, min(w1[1], w2[1]) - max(w1[0], w2[0]))
    return both / max(1e-9, min(w1[1] - w1[0], w2[1] - w2[0]))


def throughput_verdict(group_alone: float, remainder_alone: float, split_group: float, split_remainder: float,
                       control_a: float, control_b: float, window_overlap: float = 1.0) -> dict[str, Any]:
    """Disjointness and concurrency of two processes from GEMM rates (iterations/s).

    group_alone / remainder_alone: each partition with the other process idle;
    split_group + split_remainder: both at once on the group and the remainder of one split;
    control_a + control_b: both at once on the group (the same SMs: one partition's capacity);
    window_overlap: how much the two timed windows of each together-phase overlapped (min).
    """
    together, control = split_group + split_remainder, control_a + control_b
    keep_g = split_group / group_alone if group_alone > 0 else 0.0
    keep_r = split_remainder / remainder_alone if remainder_alone > 0 else 0.0
    fastest = max(group_alone, remainder_alone)
    timed_together = window_overlap >= OVERLAP_MIN
    return {
        "together_it_s": round(together, 1), "control_it_s": round(control, 1),
        "together_vs_control": round(together / control, 3) if control > 0 else None,
        "group_keeps_vs_alone": round(keep_g, 3), "remainder_keeps_vs_alone": round(keep_r, 3),
        "together_vs_fastest_alone": round(together / fastest, 3) if fastest > 0 else None,
        "window_overlap_fraction": round(window_overlap, 3),
        "disjoint": bool(timed_together and control > 0 and together >= DISJOINT_VS_CONTROL * control
                         and keep_g >= KEEP_MIN and keep_r >= KEEP_MIN),
        "concurrent": bool(timed_together and fastest > 0 and together > CONCURRENT_VS_ALONE * fastest),
        "rule": (f"disjoint: together >= {DISJOINT_VS_CONTROL} x control and each side >= {KEEP_MIN:.0%} of "
                 f"alone; concurrent: together > {CONCURRENT_VS_ALONE} x fastest alone; both need the "
                 f"timed windows to overlap >= {OVERLAP_MIN:.0%}"),
    }


def gemm_operands(n: int, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn((n, n), device=device, dtype=torch.bfloat16, generator=g)
    return a, b, torch.empty((n, n), device=device, dtype=torch.bfloat16)


def gemm_loop(stream, ops, seconds: float, start_at: float | None = None, batch: int = 8) -> dict[str, Any]:
    """bf16 GEMMs on `stream` for about `seconds` (from wall-clock `start_at`): iterations/s.

    Keeps up to 3 batches in flight (events), so the GPU never waits for the CPU; the count
    includes the batches in flight when time is up and the clock stops when they finish.
    """
    import torch

    a, b, c = ops
    if start_at is not None:
        while (wait := start_at - time.time()) > 0:
            time.sleep(min(wait, 0.002))
    wall0, t0 = time.time(), time.perf_counter()
    inflight, done = [], 0
    with torch.cuda.stream(stream):
        while True:
            for _ in range(batch):
                torch.mm(a, b, out=c)
            ev = torch.cuda.Event()
            ev.record(stream)
            inflight.append(ev)
            if len(inflight) > 3:
                inflight.pop(0).synchronize()
                done += batch
            if time.perf_counter() - t0 >= seconds:
                break
    for ev in inflight:
        ev.synchronize()
        done += batch
    elapsed = time.perf_counter() - t0
    n = a.shape[0]
    return {"iters": done, "seconds": round(elapsed, 4), "it_per_s": round(done / elapsed, 1),
            "tflops": round(2 * n ** 3 * done / elapsed / 1e12, 1), "start": wall0, "end": wall0 + elapsed}


# ---------------------------------------------------------------------------------------
# report sections
# ---------------------------------------------------------------------------------------
def gpu_info(index: int) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {
        "index": index, "name": p.name, "sm_count": p.multi_processor_count,
        "compute_capability": f"{p.major}.{p.minor}", "memory_total_gib": round(p.total_memory / 2**30, 2),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    }
    try:
        from bullet_trt.spatial.partitioners.cuda_driver import driver_version

        v = driver_version()
        info["cuda_driver_version"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        info["cuda_driver_version"] = f"unknown ({type(e).__name__}: {e})"
    try:
        import cuda.bindings

        info["cuda_bindings"] = cuda.bindings.__version__
    except Exception:  # noqa: BLE001
        info["cuda_bindings"] = None
    info["nvml"] = nvml_info(index)
    return info


def nvml_info(index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import pynvml
    except ImportError as e:
        return {"error": f"nvidia-ml-py not installed: {e}"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        return {"error": f"nvmlInit: {e}"}

    def grab(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - not every field exists on every GPU
            out[key] = f"n/a ({type(e).__name__})"

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    h = nvml_handle(pynvml, index)
    grab("driver_version", lambda: text(pynvml.nvmlSystemGetDriverVersion()))
    grab("cuda_driver_version", lambda: (lambda v: f"{v // 1000}.{v % 1000 // 10}")(
        pynvml.nvmlSystemGetCudaDriverVersion()))
    grab("name", lambda: text(pynvml.nvmlDeviceGetName(h)))

    def mem():
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {"total_gib": round(m.total / 2**30, 2), "used_gib": round(m.used / 2**30, 2),
                "free_gib": round(m.free / 2**30, 2)}

    grab("memory", mem)
    grab("utilization_percent", lambda: (lambda u: {"sm": u.gpu, "memory": u.memory})(
        pynvml.nvmlDeviceGetUtilizationRates(h)))
    grab("compute_mode", lambda: int(pynvml.nvmlDeviceGetComputeMode(h)))
    grab("mig_mode", lambda: list(pynvml.nvmlDeviceGetMigMode(h)))
    grab("sm_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    grab("max_sm_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))
    return out


def mps_info(index: int) -> dict[str, Any]:
    from bullet_trt.spatial.partitioners import mps_daemon

    info = mps_daemon.mps_client_evidence(index)
    info["is_client"] = mps_daemon.is_mps_client(index)
    info["private_pipe_dir"], info["private_log_dir"] = mps_daemon.private_dirs()
    info["active_thread_percentage"] = os.environ.get(mps_daemon.ENV_PCT)
    return info


def partitioner_availability(device, libsmctrl_path: str | None, prefill_sms: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("green", "mps", "libsmctrl", "none"):
        try:
            p = make_partitioner(kind, device, prefill_sms=prefill_sms, libsmctrl_path=libsmctrl_path)
            out[kind] = {"available": True, "total_sms": p.total_sms, "granularity": p.granularity,
                         "splits": p.splits()}
            if kind == "mps":
                out[kind]["note"] = ("static split through CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the SM sets "
                                     "may overlap; needs the workers to be MPS clients")
        except Exception as e:  # noqa: BLE001 - report, don't fail
            out[kind] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    return out


def pick_split(total_sms: int, granularity: int, wanted: int) -> int:
    s = wanted // granularity * granularity
    if s <= 0 or s >= total_sms:
        s = max(granularity, total_sms // 2 // granularity * granularity)
    return s


def measure_in_process(probe: Probe, gp_prefill, gp_decode, split: int, spin_us: int) -> dict[str, Any]:
    """Both roles' green streams of one split in this process: alone, then together."""
    import torch

    pf_sms, dc_sms = gp_prefill.actual_sms(split)
    sa, sb = gp_prefill.stream(split), gp_decode.stream(split)
    ba, bb = 2 * pf_sms, 2 * dc_sms
    total = gp_prefill.total_sms
    probe.run(gp_prefill.stream(None), 2 * total, 2000)  # warm-up (Triton compiles here)
    full = summarize(probe.run(gp_prefill.stream(None), 2 * total, 20_000))
    alone_a = summarize(probe.run(sa, ba, spin_us))
    alone_b = summarize(probe.run(sb, bb, spin_us))
    ra, rb = probe.alloc(ba), probe.alloc(bb)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    probe.launch(sa, ra, spin_us)
    probe.launch(sb, rb, spin_us)
    sa.synchronize()
    sb.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    both_a, both_b = summarize(ra.cpu().tolist()), summarize(rb.cpu().tolist())
    return {
        "mode": "one process, two green streams of one split",
        "split": {"prefill_requested": split, "prefill_sms": pf_sms, "decode_sms": dc_sms},
        "spin_ms": spin_us / 1e3, "full_device_sms_seen": full["n_sms"],
        "prefill_alone": alone_a, "decode_alone": alone_b, "prefill": both_a, "decode": both_b,
        "wall_ms_both": round(wall_ms, 2),
        "verdict": compare(both_a, both_b, alone_a, alone_b, pf_sms, dc_sms),
    }


# GEMM phases of the cross-process measurement: name -> {role: stream key}. "own" is the
# role's partition (prefill: group, decode: remainder); "group" is the split's group.
GEMM_PHASES = (
    ("group_alone", {"prefill": "own"}),
    ("remainder_alone", {"decode": "own"}),
    ("split", {"prefill": "own", "decode": "own"}),
    ("control", {"prefill": "group", "decode": "group"}),
)


def _sync_start(barrier, start_at, lead: bool, delay: float = 0.25) -> float:
    """Both children meet, the lead picks a wall-clock start time, both read it."""
    barrier.wait(40)
    if lead:
        start_at.value = time.time() + delay
    barrier.wait(40)
    return start_at.value


def _cross_child(role: str, index: int, split: int, spin_us: int, probe_kind: str, gemm_n: int,
                 gemm_seconds: float, barrier, start_at, queue) -> None:
    """One role of the cross-process measurement (spawned)."""
    out: dict[str, Any] = {"role": role, "pid": os.getpid()}
    parts = []
    try:
        import torch

        from bullet_trt.spatial.partitioners.green import GreenPartitioner
        from bullet_trt.spatial.partitioners.mps_daemon import is_mps_client

        torch.cuda.set_device(index)
        device = f"cuda:{index}"
        torch.zeros(1, device=device)
        gp = GreenPartitioner(device)
        parts.append(gp)
        gp.prepare(role, [split])
        pf, dc = gp.actual_sms(split)
        mine = pf if role == "prefill" else dc
        stream = gp.stream(split)
        streams = {"own": stream, "group": stream}
        if role == "decode":  # the control phase puts decode on the group too
            gg = GreenPartitioner(device)
            parts.append(gg)
            gg.prepare("prefill", [split])
            streams["group"] = gg.stream(split)
        probe = Probe(probe_kind, device)
        probe.run(stream, 2 * mine, 2000)  # warm-up
        ops = None
        if gemm_seconds > 0:
            ops = gemm_operands(gemm_n, device)
            for s in {id(v): v for v in streams.values()}.values():  # cuBLAS handles, clocks up
                gemm_loop(s, ops, 0.2)
        out.update(mps_client=is_mps_client(index), partition_sms=mine, probe=probe.kind)
        barrier.wait(40)
        if role == "prefill":
            out["alone"] = summarize(probe.run(stream, 2 * mine, spin_us))
        barrier.wait(40)
        if role == "decode":
            out["alone"] = summarize(probe.run(stream, 2 * mine, spin_us))
        barrier.wait(40)
        t0 = time.perf_counter()
        out["both"] = summarize(probe.run(stream, 2 * mine, spin_us))
        out["both_wall_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        if ops is not None:
            out["gemm"] = {}
            for phase, who in GEMM_PHASES:
                at = _sync_start(barrier, start_at, role == "prefill")
                if role in who:
                    out["gemm"][phase] = gemm_loop(streams[who[role]], ops, gemm_seconds, at)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
    for p in parts:  # free the contexts (MPS limits client contexts per GPU)
        try:
            p.close()
        except Exception:  # noqa: BLE001
            pass
    queue.put(out)


def cross_throughput(pf: dict, dc: dict, gemm_n: int, gemm_seconds: float) -> dict[str, Any]:
    """The children's GEMM records -> rates and the throughput verdict."""
    g, d = pf["gemm"], dc["gemm"]
    rates = {
        "group_alone": g["group_alone"]["it_per_s"],
        "remainder_alone": d["remainder_alone"]["it_per_s"],
        "split": {"prefill_group": g["split"]["it_per_s"], "decode_remainder": d["split"]["it_per_s"]},
        "control": {"prefill_group": g["control"]["it_per_s"], "decode_group": d["control"]["it_per_s"]},
    }
    overlap = min(_overlap((g[p]["start"], g[p]["end"]), (d[p]["start"], d[p]["end"])) for p in ("split", "control"))
    verdict = throughput_verdict(rates["group_alone"], rates["remainder_alone"], rates["split"]["prefill_group"],
                                 rates["split"]["decode_remainder"], rates["control"]["prefill_group"],
                                 rates["control"]["decode_group"], overlap)
    return {"gemm": f"{gemm_n}^3 bf16 torch.mm", "seconds_per_phase": gemm_seconds, "it_per_s": rates,
            "tflops": {"group_alone": g["group_alone"]["tflops"], "remainder_alone": d["remainder_alone"]["tflops"]},
            "records": {"prefill": g, "decode": d}, "verdict": verdict}


def measure_cross_process(index: int, split: int, spin_us: int, probe_kind: str, mps_running: bool,
                          timeout: float = 60.0, gemm_n: int = 4096, gemm_seconds: float = 2.0) -> dict[str, Any]:
    """Prefill and decode in two spawned processes (MPS clients when the daemon runs).

    SM-id probe (reported only: MPS renumbers SM ids per client) and the GEMM throughput
    test, whose verdict becomes `verdict` (disjoint / concurrent); gemm_seconds <= 0 skips
    it (then `verdict["disjoint"]` is None and concurrency comes from the probe).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue, start_at = ctx.Barrier(2), ctx.Queue(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_cross_child, args=(role, index, split, spin_us, probe_kind, gemm_n, gemm_seconds,
                                                    barrier, start_at, queue), daemon=True)
             for role in ("prefill", "decode")]
    for p in procs:
        p.start()
    results: dict[str, dict] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < 2 and time.monotonic() < end:
            try:
                r = queue.get(timeout=max(0.1, min(5.0, end - time.monotonic())))
            except Exception:  # noqa: BLE001 - queue.Empty: check the children are alive
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[r["role"]] = r
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    out: dict[str, Any] = {
        "mode": "two processes" + (" (MPS clients)" if mps_running else " (no MPS daemon: time slicing expected)"),
        "children": results,
    }
    missing = [r for r in ("prefill", "decode") if r not in results]
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    if missing or errors:
        out["error"] = f"missing results from {missing}" if missing else ""
        out["child_errors"] = errors
        return out
    pf, dc = results["prefill"], results["decode"]
    out["split"] = {"prefill_requested": split, "prefill_sms": pf["partition_sms"], "decode_sms": dc["partition_sms"]}
    out["mps_clients"] = {"prefill": pf["mps_client"], "decode": dc["mps_client"]}
    sv = compare(pf["both"], dc["both"], pf.get("alone"), dc.get("alone"), pf["partition_sms"], dc["partition_sms"])
    sv["note"] = SMID_XP_NOTE
    out["smid_verdict"] = sv
    if gemm_seconds > 0:
        out["throughput"] = cross_throughput(pf, dc, gemm_n, gemm_seconds)
        v = dict(out["throughput"]["verdict"])
    else:
        v = {"disjoint": None, "concurrent": sv["concurrent"],
             "rule": "throughput test skipped (gemm_seconds <= 0): disjointness not measured, concurrency from "
                     "the probe"}
    v["probe_concurrent"] = sv["concurrent"]
    out["verdict"] = v
    return out


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def _resolve_device(device) -> str:
    import torch

    device = str(device or "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_doctor(device="auto", partitioner_kind: str = "auto", json_out: str | None = None, *,
               prefill_sms: int = 64, spin_ms: float = 100.0, cross_process: str = "auto",
               libsmctrl_path: str | None = None, probe_kind: str = "auto",
               gemm_n: int = 4096, gemm_seconds: float = 2.0,
               print_report: bool = False) -> dict[str, Any]:
    """Runs every check; returns the report dict (and writes it as JSON to json_out)."""
    import torch

    device = _resolve_device(device)
    libsmctrl_path = libsmctrl_path or os.environ.get("LIBSMCTRL_PATH") or None
    report: dict[str, Any] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                              "device": device, "partitioner_requested": partitioner_kind,
                              "problems": [], "notes": []}
    problems, notes = report["problems"], report["notes"]
    try:
        report["partitioner_selected"] = make_partitioner(partitioner_kind, device, prefill_sms=prefill_sms,
                                                          libsmctrl_path=libsmctrl_path).name
    except Exception as e:  # noqa: BLE001
        report["partitioner_selected"] = None
        problems.append(f"serve.partitioner={partitioner_kind}: {type(e).__name__}: {e}")
    if device.split(":")[0] != "cuda" or not torch.cuda.is_available():
        report["gpu"] = None
        report["partitioners"] = partitioner_availability("cpu", libsmctrl_path, prefill_sms)
        notes.append("no CUDA device: only the 'none' partitioner applies")
        return _finish(report, json_out, print_report)

    index = torch.device(device).index or 0
    torch.cuda.set_device(index)
    torch.zeros(1, device=f"cuda:{index}")
    report["gpu"] = gpu_info(index)
    report["mps"] = mps_info(index)
    if not report["mps"]["daemon_running"]:
        notes.append("no MPS daemon answers at CUDA_MPS_PIPE_DIRECTORY: two worker processes would "
                     "time-slice (start one with scripts/start_mps.sh)")
    report["partitioners"] = partitioner_availability(device, libsmctrl_path, prefill_sms)

    from bullet_trt.spatial.partitioners.green import GreenPartitioner

    try:
        # Every split for the prefill role (what a worker prepares at start-up; each split's
        # record also carries the remainder's SM count), the measured split for decode.
        gp_prefill, gp_decode = GreenPartitioner(device), GreenPartitioner(device)
        gp_prefill.prepare("prefill")
        split = pick_split(gp_prefill.total_sms, gp_prefill.granularity, prefill_sms)
        gp_decode.prepare("decode", [split])
        dp = gp_prefill.describe()
        report["green"] = {"total_sms": gp_prefill.total_sms, "granularity": gp_prefill.granularity,
                           "contexts_created": len(dp["splits"]) + 1,
                           "create_ms_all_prefill_splits": dp["create_ms"], "splits": dp["splits"]}
    except Exception as e:  # noqa: BLE001
        report["green"] = {"error": f"{type(e).__name__}: {e}"}
        problems.append(f"green contexts: {type(e).__name__}: {e}")
        return _finish(report, json_out, print_report)

    spin_us = int(spin_ms * 1000)
    meas: dict[str, Any] = {}
    report["measurement"] = meas
    try:
        probe = Probe(probe_kind, f"cuda:{index}")
        meas["probe"] = probe.kind
        if probe.native_error:
            meas["native_probe_error"] = probe.native_error
    except Exception as e:  # noqa: BLE001
        meas["error"] = f"{type(e).__name__}: {e}"
        problems.append(f"no SM-id probe: {e}")
        return _finish(report, json_out, print_report)

    try:
        ip = measure_in_process(probe, gp_prefill, gp_decode, split, spin_us)
        meas["in_process"] = ip
        v = ip["verdict"]
        if not v["disjoint"]:
            problems.append(f"in-process: prefill and decode green streams shared SMs {v['shared_sm_ids']}")
        if not (v["prefill_within_partition"] and v["decode_within_partition"]):
            problems.append("in-process: a side ran on more SMs than its partition")
        if not v["concurrent"]:
            problems.append("in-process: the two green streams did not run concurrently")
    except Exception as e:  # noqa: BLE001
        meas["in_process"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        problems.append(f"in-process measurement failed: {e}")

    for gp in (gp_prefill, gp_decode):  # free the contexts (MPS limits client contexts per GPU)
        try:
            gp.close()
        except Exception as e:  # noqa: BLE001
            notes.append(f"closing green contexts: {e}")
    running = bool(report["mps"]["daemon_running"])
    if cross_process == "always" or (cross_process == "auto" and running):
        xp = measure_cross_process(index, split, spin_us, meas["probe"], running, gemm_n=gemm_n,
                                   gemm_seconds=gemm_seconds)
        meas["cross_process"] = xp
        if "verdict" in xp:
            v, sv = xp["verdict"], xp["smid_verdict"]
            if running and not all(xp["mps_clients"].values()):
                problems.append("cross-process: the daemon runs but a child is not an MPS client")
            if sv["shared_sm_ids"]:
                notes.append(f"cross-process: the SM-id sets overlap ({_sms(sv['shared_sm_ids'])}), but {SMID_XP_NOTE}")
            if v["disjoint"] is None:
                notes.append("cross-process: disjointness not measured (--gemm-seconds 0)")
            elif running and not v["disjoint"]:
                problems.append(
                    f"cross-process: GEMM throughput says prefill (group) and decode (remainder) share SMs: together "
                    f"{v['together_it_s']} it/s vs control (both on the group) {v['control_it_s']} it/s, keeps "
                    f"{v['group_keeps_vs_alone']}/{v['remainder_keeps_vs_alone']} of alone ({v['rule']})")
            if running and not v["concurrent"]:
                problems.append("cross-process: the two MPS clients did not run concurrently "
                                f"(together {v.get('together_it_s')} it/s; {v['rule']})")
            if running and v["concurrent"] and not v["probe_concurrent"]:
                notes.append("cross-process: the SM-id probe did not look concurrent (window overlap "
                             f"{sv['window_overlap_fraction']}, descheduled {sv['max_descheduled_fraction']}) "
                             "although the GEMM throughput did")
            if not running and v["concurrent"]:
                notes.append("cross-process without MPS looked concurrent (unexpected)")
        else:
            problems.append(f"cross-process measurement failed: {xp.get('error') or xp.get('child_errors')}")
    else:
        meas["cross_process"] = {"skipped": "no MPS daemon (use --cross-process always to run it anyway)"
                                 if cross_process == "auto" else "--cross-process never"}
    return _finish(report, json_out, print_report)


def _finish(report: dict, json_out: str | None, print_report: bool) -> dict:
    report["ok"] = not report["problems"]
    if json_out:
        text = json.dumps(report, indent=2, default=str)
        if json_out == "-":
            print(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
            with open(json_out, "w") as f:
                f.write(text + "\n")
    if print_report:
        print(format_report(report))
    return report


def _sms(ids: list[int]) -> str:
    """Compact SM-id list: 0-15,32-47."""
    if not ids:
        return "-"
    parts, start, prev = [], ids[0], ids[0]
    for x in ids[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


def _side(name: str, s: dict) -> str:
    return (f"    {name:<15} {s['n_sms']:>3} SMs [{_sms(s['sm_ids'])}]  window {s['window_ms']} ms  "
            f"work {s['iters_median']}  descheduled {s['descheduled_fraction']:.1%}  max gap {s['max_gap_us']} us")


def _measurement_lines(m: dict) -> list[str]:
    lines = [f"  {m['mode']}: split prefill {m['split']['prefill_sms']} / decode {m['split']['decode_sms']} SMs"]
    for key in ("prefill_alone", "decode_alone", "prefill", "decode"):
        if key in m:
            lines.append(_side(key.replace("_", " ") + (" (both)" if "alone" not in key else ""), m[key]))
    children = m.get("children", {})
    for role in ("prefill", "decode"):
        c = children.get(role, {})
        if "alone" in c:
            lines.append(_side(f"{role} alone", c["alone"]))
        if "both" in c:
            lines.append(_side(f"{role} (both)", c["both"]))
    if "smid_verdict" in m:  # cross-process: SM ids reported, throughput decides
        sv = m["smid_verdict"]
        extra = "  ".join(f"{k}={sv[k]}" for k in ("prefill_work_vs_alone", "decode_work_vs_alone") if k in sv)
        lines.append(f"    probe: SM ids shared [{_sms(sv['shared_sm_ids'])}] (not evidence: {SMID_XP_NOTE})")
        lines.append(f"    probe: concurrent={sv['concurrent']}  window overlap={sv['window_overlap_fraction']}  {extra}")
        if "throughput" in m:
            lines += _throughput_lines(m["throughput"])
        v = m["verdict"]
        lines.append(f"    verdict (throughput): disjoint={v['disjoint']}  concurrent={v['concurrent']}")
    else:
        v = m["verdict"]
        extra = "  ".join(f"{k}={v[k]}" for k in ("prefill_work_vs_alone", "decode_work_vs_alone") if k in v)
        lines.append(f"    disjoint={v['disjoint']}  concurrent={v['concurrent']}  "
                     f"window overlap={v['window_overlap_fraction']}  {extra}")
    if "mps_clients" in m:
        lines.append(f"    MPS clients: {m['mps_clients']}")
    return lines


def _throughput_lines(t: dict) -> list[str]:
    r, v = t["it_per_s"], t["verdict"]
    sp, ct = r["split"], r["control"]
    return [
        f"    GEMM {t['gemm']}, {t['seconds_per_phase']} s per phase, iterations/s:",
        f"      alone:                     group {r['group_alone']}  remainder {r['remainder_alone']}  "
        f"(TFLOP/s {t['tflops']['group_alone']} / {t['tflops']['remainder_alone']})",
        f"      together group+remainder:  {sp['prefill_group']} + {sp['decode_remainder']} = {v['together_it_s']}  "
        f"(keeps {v['group_keeps_vs_alone']:.0%} / {v['remainder_keeps_vs_alone']:.0%} of alone)",
        f"      control group+group:       {ct['prefill_group']} + {ct['decode_group']} = {v['control_it_s']}",
        f"      together/control {v['together_vs_control']} (disjoint needs >= {DISJOINT_VS_CONTROL})  "
        f"together/fastest alone {v['together_vs_fastest_alone']} (concurrent needs > {CONCURRENT_VS_ALONE})  "
        f"window overlap {v['window_overlap_fraction']}",
    ]


def format_report(r: dict) -> str:
    out = [f"bullet-trt doctor  {r['time']}  host {r['host']}  device {r['device']}"]
    g = r.get("gpu")
    if g:
        nv = g.get("nvml", {})
        out.append(f"GPU {g['index']}: {g['name']}  cc {g['compute_capability']}  {g['sm_count']} SMs  "
                   f"{g['memory_total_gib']} GiB")
        out.append(f"  driver {nv.get('driver_version')}  CUDA driver {g['cuda_driver_version']}  "
                   f"torch {g['torch']} (CUDA {g['torch_cuda']})  cuda.bindings {g['cuda_bindings']}")
        out.append(f"  memory {nv.get('memory')}  utilization {nv.get('utilization_percent')}  "
                   f"SM clock {nv.get('sm_clock_mhz')}/{nv.get('max_sm_clock_mhz')} MHz  "
                   f"compute mode {nv.get('compute_mode')}  MIG {nv.get('mig_mode')}")
    else:
        out.append("GPU: none (CPU run)")
    m = r.get("mps")
    if m:
        out.append(f"MPS: daemon {'running' if m['daemon_running'] else 'not running'} at {m['pipe_dir']}  "
                   f"servers {m['daemon_servers']}  this process a client: {m['is_client']} "
                   f"(device attribute {m['device_attribute_mps_enabled']}, in daemon client list "
                   f"{m['pid_in_daemon_clients']})")
    out.append(f"partitioner: requested {r['partitioner_requested']} -> {r.get('partitioner_selected')}")
    for kind, a in (r.get("partitioners") or {}).items():
        out.append(f"  {kind:<10} " + ("available" if a["available"] else f"unavailable: {a['error']}"))
    gr = r.get("green")
    if gr and "splits" in gr:
        out.append(f"green splits prefill->actual/decode (granularity {gr['granularity']}, "
                   f"{len(gr['splits'])} contexts in {gr['create_ms_all_prefill_splits']} ms): " + "  ".join(
            f"{s['requested']}->{s['prefill_sms']}/{s['decode_sms']}" for s in gr["splits"]))
    meas = r.get("measurement") or {}
    if meas:
        out.append(f"measurement (probe: {meas.get('probe')}):")
        for key in ("in_process", "cross_process"):
            m2 = meas.get(key)
            if not m2:
                continue
            if "verdict" in m2:
                out += _measurement_lines(m2)
            else:
                out.append(f"  {key}: {m2.get('skipped') or m2.get('error') or m2.get('child_errors')}")
    for n in r.get("notes", []):
        out.append(f"note: {n}")
    for p in r.get("problems", []):
        out.append(f"PROBLEM: {p}")
    out.append("doctor: OK" if r.get("ok") else "doctor: problems found")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--partitioner", default="auto", choices=KINDS, help="serve.partitioner to check")
    ap.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here ('-': stdout)")
    ap.add_argument("--prefill-sms", type=int, default=64, help="split to measure (prefill SMs)")
    ap.add_argument("--spin-ms", type=float, default=100.0, help="probe spin time per block")
    ap.add_argument("--cross-process", default="auto", choices=("auto", "always", "never"),
                    help="two-process measurement: auto = only when an MPS daemon answers")
    ap.add_argument("--libsmctrl-path", default=None, help="serve.libsmctrl_path (else env LIBSMCTRL_PATH)")
    ap.add_argument("--probe", default="auto", choices=("auto", "native", "triton"))
    ap.add_argument("--gemm-n", type=int, default=4096, help="cross-process throughput test: GEMM size (bf16)")
    ap.add_argument("--gemm-seconds", type=float, default=2.0,
                    help="cross-process throughput test: seconds per phase (4 phases; 0 skips it)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    args = ap.parse_args(argv)
    report = run_doctor(args.device, args.partitioner, args.json_out, prefill_sms=args.prefill_sms,
                        spin_ms=args.spin_ms, cross_process=args.cross_process,
                        libsmctrl_path=args.libsmctrl_path, probe_kind=args.probe,
                        gemm_n=args.gemm_n, gemm_seconds=args.gemm_seconds, print_report=args.json_out != "-")
    return 1 if (args.strict and report["problems"]) else 0


if __name__ == "__main__":
    # Run through the imported module so spawned children unpickle bullet_trt.tools.doctor._cross_child.
    from bullet_trt.tools.doctor import main as _main

    sys.exit(_main())
