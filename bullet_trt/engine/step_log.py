"""Chunked mode's iteration log (serve.iteration_log): one JSON record per step, in the fields
of the spatial modes' log (spatial/iteration_log.py) that `bullet-trt bench gaps` reads, so that
the GPU's idle between chunked's steps, launched one ahead or not, reads as bullet's does.

A step's window is stamped with the GPU's own timer on its stream, before its first kernel and
after its last (engine/step_clock.py; two clocks in turn, since two steps can be in flight).
Chunked runs on the whole GPU: its records name no SMs (0), as a spatial log on a CPU does.
Phase "decode" for a step of decode rows alone, "mixed" for one with prompt chunks."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from bullet_trt.engine.step_clock import GpuStepClock


@dataclass
class LoggedStep:
    start: float  # time.monotonic() at the launch
    launch_ms: float
    clock: GpuStepClock | None
    stamped: torch.cuda.Event | None  # after the clock's copy to the host


class StepLog:
    def __init__(self, path: str | None, device: torch.device):
        self.file = open(path, "a") if path else None
        self.t0 = time.monotonic()
        self.clocks: list[GpuStepClock] = []
        if self.file is not None and device.type == "cuda":
            self.clocks = [GpuStepClock(device), GpuStepClock(device)]
            for clock in self.clocks:
                clock.warm_up()
            torch.cuda.synchronize(device)

    def launch(self, run):
        """Calls `run()`, a step's launch, between the clock's stamps; returns its result and the
        LoggedStep to `record` once the step's tokens are read (None without a log)."""
        if self.file is None:
            return run(), None
        clock = self.clocks[0] if self.clocks else None
        self.clocks.reverse()
        start = time.monotonic()
        if clock is not None:
            clock.begin()
        result = run()
        stamped = None
        if clock is not None:
            clock.finish()
            stamped = torch.cuda.Event()
            stamped.record()
        return result, LoggedStep(start, (time.monotonic() - start) * 1e3, clock, stamped)

    def record(self, step: LoggedStep | None, decode_rows: int, prompt_chunks: int, tokens: int,
               waiting: int, ahead: bool) -> None:
        if step is None or self.file is None:
            return
        wall_ms = (time.monotonic() - step.start) * 1e3
        rec = {"t": round(step.start - self.t0, 6), "phase": "mixed" if prompt_chunks else "decode",
               "batch": decode_rows + prompt_chunks, "tokens": tokens, "sms": 0, "prefill_sms": 0, "decode_sms": 0,
               "predicted_ms": 0.0, "measured_ms": round(wall_ms, 3), "waiting": waiting,
               "prefilling": prompt_chunks, "decoding": decode_rows, "wall_ms": round(wall_ms, 3)}
        if step.clock is not None:
            step.stamped.synchronize()
            rec["gpu_start_ns"], rec["gpu_end_ns"] = step.clock.window_ns()
            rec["measured_ms"] = round((rec["gpu_end_ns"] - rec["gpu_start_ns"]) / 1e6, 3)
        if ahead:  # launched before the step before it was read: the launch's own host time
            rec["launch_ms"] = round(step.launch_ms, 3)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
