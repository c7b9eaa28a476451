"""Spatial orchestration: a prefill worker and a decode worker run at the same time, each on
its own SM partition, over one shared pool; the split is re-chosen at every prefill launch.

The loop never waits for one phase to launch the other. Whenever the decode worker is free it
gets the next step of every decoding sequence (new arrivals from prefill join here); whenever
the prefill worker is free the policy picks the split and the prompts to admit. Decode runs
on the complement of the prefill partition while a prefill is in flight, and on the whole GPU
otherwise. Modes: `bullet` (dynamic split), `static` (one fixed split for both phases).
"""
from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from bullet_trt.config import ConfigError, EngineConfig
from bullet_trt.engine.core import EngineCore
from bullet_trt.engine.sequence import Sequence, SeqStatus
from bullet_trt.engine.batch_scheduler import ScheduledChunk
from bullet_trt.scheduler.perf_model import PERF_MODEL_FILE, ModelCost, PerfModel, PrefillShape
from bullet_trt.scheduler.policy import (Decision, PolicyState, SloConfig, WaitingPrompt,
                                         bullet_policy, static_policy)
from bullet_trt.workers.session_worker import SessionWorker, WorkerDied


@dataclass
class SpatialQueues:
    """Sequences by phase. `waiting` need a prefill; `decoding` hold their KV and step."""

    allocator: object
    block_size: int
    waiting: list[Sequence] = field(default_factory=list)
    prefilling: list[Sequence] = field(default_factory=list)
    decoding: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def running(self) -> list[Sequence]:
        return self.prefilling + self.decoding

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.num_cached_tokens = 0
        for q in (self.waiting, self.prefilling, self.decoding):
            if seq in q:
                q.remove(seq)

    def reserve(self, seq: Sequence, total_tokens: int) -> bool:
        return self.allocator.grow(seq.block_table, total_tokens, self.block_size)


class SpatialEngineCore(EngineCore):
    def __init__(self, cfg: EngineConfig):
        super().__init__(cfg, executor="none")
        from bullet_trt.sm.partitioner import make_partitioner

        s = cfg.serve
        device = self.state.kv_pool.device
        static = s.mode == "static"
        self.partitioner = make_partitioner(s.partitioner, device,
                                            prefill_sms=s.static_prefill_sms if static else None,
                                            libsmctrl_path=s.libsmctrl_path or None)
        # Without partitioning (CPU) each phase runs on what the OS gives it; the policy still
        # admits by deadline but has no split to choose.
        self.total_sms = self.partitioner.total_sms or 1
        if self.partitioner.name == "none":
            splits: list[int] = []
        elif static:
            splits = self.partitioner.validate_splits([s.static_prefill_sms], "serve.static_prefill_sms")
        else:
            low = s.min_phase_sms
            splits = [x for x in self.partitioner.splits() if x >= low and self.total_sms - x >= low]
            if not splits:
                raise ConfigError(f"serve.min_phase_sms={low} leaves no split of the GPU's "
                                  f"{self.total_sms} SMs; lower it")
        self.splits = splits
        total = self.total_sms
        self.slo = SloConfig(ttft_ms=s.ttft_slo_ms, tpot_ms=s.tpot_slo_ms)
        self.perf = self._load_perf_model(cfg, total, device)
        self.scheduler = SpatialQueues(self.allocator, self.state.block_size)
        self.results = mp.get_context("spawn").Queue()
        kind = self.partitioner.name
        static_split = splits[0] if static and splits else None
        workers = {}
        for role, profile in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            env = self.partitioner.worker_env(role, static_split)
            if s.libsmctrl_path:
                env["LIBSMCTRL_PATH"] = s.libsmctrl_path
            workers[role] = SessionWorker(role, self.state, profile, kind, splits, env,
                                          outbox=self.results)
        self.prefill, self.decode = workers["prefill"], workers["decode"]
        self.inflight: dict[str, dict] = {}
        self.current_prefill_sms: int | None = static_split
        self.last_split = (0, 0)
        self.last_decode_end: float | None = None
        self.log = open(s.iteration_log, "a") if s.iteration_log else None
        from bullet_trt.sm.gpu_monitor import GpuMonitor
        gpu_index = (device.index or 0) if device.type == "cuda" else None
        self.gpu_monitor = GpuMonitor(gpu_index)
        self.t0 = time.monotonic()

    def _load_perf_model(self, cfg: EngineConfig, total_sms: int, device) -> PerfModel:
        """The calibrated model of the engine directory, else uncalibrated defaults that the
        online correction then pulls toward measured times."""
        cost = ModelCost.from_arch(self.state.arch, self.state.kv_pool.element_size())
        path = cfg.resolve_path(PERF_MODEL_FILE)
        if path.is_file():
            return PerfModel.load(path, cost)
        return PerfModel.default(cost, total_sms, on_gpu=device.type == "cuda")

    # -- the loop ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self.inflight)

    def step(self):
        outputs = []
        for rid in self._aborted:
            seq = self.seqs.get(rid)
            if seq is not None and not self._in_flight(seq):
                self.seqs.pop(rid)
                self._finish(seq, "abort")
                outputs.append(self._output(seq))
        self._aborted = [rid for rid in self._aborted if rid in self.seqs]
        self._launch_idle_phases()
        if not self.inflight:
            return outputs
        outputs += self._collect(block=True)
        # Decode relaunches at once: its worker computes while the caller ships these
        # outputs instead of idling until the next step() call. Prefill waits for that call,
        # which first takes in the requests that arrived meanwhile.
        if "decode" not in self.inflight:
            self._launch_decode()
        return outputs

    def _launch_idle_phases(self) -> None:
        if "decode" not in self.inflight:
            self._launch_decode()
        if "prefill" not in self.inflight:
            self._launch_prefill()

    def _in_flight(self, seq: Sequence) -> bool:
        return any(seq in job["seqs"] for job in self.inflight.values())

    def _launch_decode(self) -> None:
        q = self.scheduler
        batch: list[Sequence] = []
        for seq in list(q.decoding):
            if len(batch) >= self.cfg.decode.max_num_seqs:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            while not q.reserve(seq, seq.num_tokens):
                victim = next((s for s in reversed(q.decoding) if s not in batch), None)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING and seq in q.decoding:
                batch.append(seq)
        if not batch:
            return
        split = self.current_prefill_sms if "prefill" in self.inflight or self.cfg.serve.mode == "static" else None
        chunks = [ScheduledChunk(s, 1) for s in batch]
        items = [self._item(c) for c in chunks]
        total_ctx = sum(s.num_tokens for s in batch)
        sms = self.total_sms if split is None else self.total_sms - split
        predicted = self.perf.decode_ms(len(batch), total_ctx, sms)
        self.decode.submit(items, split)
        self.inflight["decode"] = dict(seqs=batch, chunks=chunks,
                                       predicted=predicted, split=split, tokens=len(batch),
                                       start=time.monotonic(), after=self.last_decode_end)

    def _preempt(self, seq: Sequence) -> None:
        q = self.scheduler
        q.release(seq)
        seq.status = SeqStatus.WAITING
        q.waiting.insert(0, seq)
        q.num_preemptions += 1

    def _decision(self, candidates: list[Sequence]) -> Decision:
        q = self.scheduler
        now = time.monotonic()
        decoding = [s for s in q.decoding if s.status is SeqStatus.RUNNING]
        state = PolicyState(
            now=now, total_sms=self.total_sms, splits=self.splits,
            decode_batch=len(decoding), decode_total_ctx=sum(s.num_tokens for s in decoding),
            waiting=[WaitingPrompt(s.arrival_time, s.num_uncached) for s in candidates],
            max_prefill_tokens=self.cfg.prefill.max_num_batched_tokens,
            max_prefill_seqs=self.cfg.prefill.max_num_seqs,
            free_seq_slots=self.cfg.decode.max_num_seqs - len(q.decoding) - len(q.prefilling))
        if self.cfg.serve.mode == "static" and self.splits:
            return static_policy(state, self.slo, self.perf, self.splits[0])
        return bullet_policy(state, self.slo, self.perf)

    def _launch_prefill(self) -> None:
        q = self.scheduler
        if not q.waiting:
            return
        decision = self._decision(list(q.waiting))
        batch: list[Sequence] = []
        candidates = list(q.waiting)
        for i in decision.admit:
            seq = candidates[i]
            if not q.reserve(seq, seq.num_tokens):
                break  # blocks run out: the rest wait for decodes to finish
            batch.append(seq)
        if not batch:
            return
        for seq in batch:
            q.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            q.prefilling.append(seq)
        chunks = [ScheduledChunk(s, s.num_uncached) for s in batch]
        items = [self._item(c) for c in chunks]
        self.current_prefill_sms = decision.prefill_sms
        sms = self.total_sms if decision.prefill_sms is None else decision.prefill_sms
        shape = PrefillShape.of([c.num_new_tokens for c in chunks])
        self.prefill.submit(items, decision.prefill_sms)
        self.inflight["prefill"] = dict(seqs=batch, chunks=chunks, split=decision.prefill_sms,
                                        predicted=self.perf.prefill_ms(shape, sms),
                                        tokens=shape.num_tokens, start=time.monotonic())

    def _collect(self, block: bool):
        outputs = []
        while True:
            try:
                name, kind, payload = self.results.get(timeout=0.5 if block else 0.0)
            except queue.Empty:
                for w in (self.prefill, self.decode):
                    if not w.alive():
                        raise WorkerDied(f"{w.name} worker exited with code {w.proc.exitcode}")
                if block:
                    continue
                return outputs
            if kind != "ok":
                raise WorkerDied(f"{name} worker failed:\n{payload}")
            results, measured_ms = payload
            job = self.inflight.pop(name)
            job["end"] = time.monotonic()
            outputs += self._complete(name, job, results, measured_ms)
            return outputs

    def _complete(self, phase: str, job: dict, results, measured_ms: float):
        q = self.scheduler
        self.perf.observe(phase, job["predicted"], measured_ms)
        outputs = []
        for chunk, res in zip(job["chunks"], results):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_cached_tokens += chunk.num_new_tokens
            if phase == "prefill":
                q.prefilling.remove(seq)
                q.decoding.append(seq)
            if seq.request_id in self._aborted:
                self._aborted.remove(seq.request_id)
                self.seqs.pop(seq.request_id, None)
                self._finish(seq, "abort")
                outputs.append(self._output(seq))
                continue
            if res is not None:
                self._accept(seq, res)
                outputs.append(self._output(seq))
                if seq.status is SeqStatus.FINISHED:
                    self.seqs.pop(seq.request_id, None)
        self._record(phase, job, measured_ms)
        return outputs

    def _record(self, phase: str, job: dict, measured_ms: float) -> None:
        if phase == "decode":
            self.last_decode_end = job["end"]
        total = self.partitioner.total_sms  # 0 without partitioning (CPU)
        split = job["split"]
        prefill_sms = total if split is None else split
        decode_sms = total if split is None else total - split
        self.last_split = (prefill_sms if phase == "prefill" else self.last_split[0],
                           decode_sms if phase == "decode" else self.last_split[1])
        if self.log is None:
            return
        q = self.scheduler
        rec = {"t": round(job["start"] - self.t0, 6), "phase": phase, "batch": len(job["seqs"]),
               "tokens": job["tokens"], "sms": prefill_sms if phase == "prefill" else decode_sms,
               "prefill_sms": prefill_sms if split is not None or phase == "prefill" else 0,
               "decode_sms": decode_sms if split is not None or phase == "decode" else 0,
               "predicted_ms": round(job["predicted"], 3), "measured_ms": round(measured_ms, 3),
               "waiting": len(q.waiting), "prefilling": len(q.prefilling), "decoding": len(q.decoding),
               **self.gpu_monitor.sample()}
        # wall: submit to result as the orchestrator sees it (measured_ms plus the IPC);
        # host gap: from the previous decode result to this launch (the decode worker idles)
        rec["wall_ms"] = round((job["end"] - job["start"]) * 1e3, 3)
        if phase == "decode" and job.get("after") is not None:
            rec["host_gap_ms"] = round((job["start"] - job["after"]) * 1e3, 3)
        self.log.write(json.dumps(rec) + "\n")
        self.log.flush()

    def stats(self):
        st = super().stats()
        st.prefill_sms, st.decode_sms = self.last_split
        return st

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        if self.log is not None:
            self.log.close()
        device = self.state.kv_pool.device
        del self.state
        if device.type == "cuda":
            torch.cuda.empty_cache()
