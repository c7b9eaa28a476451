"""One JSONL record per prefill batch and decode step (serve.iteration_log), for the SM-split
timeline (`bullet-trt plot`) and for checking the policy against what ran."""
from __future__ import annotations

import json
import time

from bullet_trt.protocol import SmSplit
from bullet_trt.spatial.gpu_monitor import GpuMonitor


class IterationLog:
    def __init__(self, path: str | None, gpu_index: int | None, partitioned: bool):
        self.file = open(path, "a") if path else None
        self.gpu = GpuMonitor(gpu_index) if path else None
        # Without partitioning (CPU) the records say 0 SMs rather than a made-up count.
        self.partitioned = partitioned
        self.t0 = time.monotonic()

    def record(self, phase: str, split: SmSplit, start: float, end: float, batch: int, tokens: int,
               predicted_ms: float, measured_ms: float, queues, host_gap_ms: float | None = None,
               prefill_in_flight: bool | None = None, split_wait_ms: float | None = None,
               gpu_window_ns: tuple[int, int] | None = None, rows_without_block: int | None = None,
               tpot_plan: float | None = None, launch_ms: float | None = None, prompts: int | None = None,
               planned_rows: int | None = None) -> None:
        if self.file is None:
            return
        stepping = phase in ("decode", "fused")  # a fused step is decode's, prompts riding along
        scale = 1 if self.partitioned else 0
        rec = {"t": round(start - self.t0, 6), "phase": phase, "batch": batch, "tokens": tokens,
               "sms": scale * (split.prefill_sms if phase == "prefill" else split.decode_sms),
               "prefill_sms": scale * split.prefill_sms if not split.is_whole or phase == "prefill" else 0,
               "decode_sms": scale * split.decode_sms if not split.is_whole or stepping else 0,
               "predicted_ms": round(predicted_ms, 3), "measured_ms": round(measured_ms, 3),
               "waiting": len(queues.waiting), "prefilling": len(queues.prefilling),
               "decoding": len(queues.decoding), **self.gpu.sample()}
        # wall: from the step's start to its result here (measured_ms plus the IPC); host
        # gap: the decode worker idle since its previous step
        rec["wall_ms"] = round((end - start) * 1e3, 3)
        if host_gap_ms is not None:
            rec["host_gap_ms"] = round(host_gap_ms, 3)
        if prefill_in_flight is not None:  # a decode step that ended while a prefill batch ran
            rec["prefill_in_flight"] = prefill_in_flight
        if split_wait_ms is not None:  # a prefill's wait for decode to reach the complement
            rec["split_wait_ms"] = round(split_wait_ms, 3)
        if rows_without_block:  # rows that sat this step out waiting for a block grant
            rec["rows_without_block"] = rows_without_block
        if tpot_plan is not None:  # the plan decode's step had beside this prefill (serve.tpot_plan_auto)
            rec["tpot_plan"] = tpot_plan
        if launch_ms is not None:  # a decode step launched ahead: its launch's host time
            rec["launch_ms"] = round(launch_ms, 3)
        if prompts is not None:  # a fused step: the prompts that rode in it (batch counts them with the rows)
            rec["prompts"] = prompts
        if planned_rows is not None:  # ... and the rows its token budget counted when the prompts were admitted
            rec["planned_rows"] = planned_rows
        if gpu_window_ns is not None:  # the step as the GPU ran it, one clock for both workers
            rec["gpu_start_ns"], rec["gpu_end_ns"] = gpu_window_ns
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
