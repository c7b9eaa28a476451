"""Spatial orchestration: a prefill worker and a decode worker run at the same time, each on
its own SM partition, over one shared pool; the split is re-chosen at every prefill launch.

Neither phase waits for the other. The decode worker keeps its own batch and steps it back
to back (workers/decode_batch.py); this loop accepts its tokens, applies the stopping rules,
grants blocks and tells it which rows join (prompts just prefilled) and leave. Whenever the
prefill worker is free the policy picks the split and the prompts to admit. Decode runs on
the complement of the prefill partition while a prefill is in flight, and on the whole GPU
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
from bullet_trt.spatial.perf_model import PERF_MODEL_FILE, ModelCost, PerfModel, PrefillShape
from bullet_trt.spatial.policy import (Decision, PolicyState, SloConfig, WaitingPrompt,
                                         bullet_policy, static_policy)
from bullet_trt.engine.session import SampleResult
from bullet_trt.engine.step_failure import FailureStreak, last_line, report
from bullet_trt.spatial.decode_batch import DecodeStep, DecodeUpdate
from bullet_trt.spatial.session_worker import SessionWorker, WorkerDied

_NOT_SENT = object()


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
        from bullet_trt.spatial.partitioners.base import make_partitioner

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
        self.slo = SloConfig(ttft_ms=s.ttft_slo_ms, tpot_ms=s.tpot_slo_ms, ttft_plan=s.ttft_plan_fraction,
                             tpot_plan=s.tpot_plan_fraction)
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
        self.inflight: dict[str, dict] = {}  # the prefill batch in flight
        self.prefill_failures = FailureStreak("prefill")
        self.decode_failures = FailureStreak("decode")
        self.current_prefill_sms: int | None = static_split
        self.last_split = (0, 0)
        # The decode worker steps its own batch (workers/decode_batch.py); here: which
        # sequence each of its rows is, blocks of rows that left awaiting the worker's
        # acknowledgement, and the changes not yet sent.
        self.rows: dict[int, Sequence] = {}
        self.row_of: dict[str, int] = {}
        self.unacked: dict[int, list[int]] = {}
        self.next_row_id = 0
        self.update = DecodeUpdate()
        self.sent_split: object = _NOT_SENT
        self.lookahead_tokens = 4
        self.log = open(s.iteration_log, "a") if s.iteration_log else None
        from bullet_trt.spatial.gpu_monitor import GpuMonitor
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
        # Blocks whose leave the decode worker has not acknowledged are still in use.
        return bool(self.seqs) or bool(self.inflight) or bool(self.unacked)

    def step(self):
        outputs = []
        for rid in self._aborted:
            seq = self.seqs.get(rid)
            if seq is not None and not self._in_prefill(seq):
                self.seqs.pop(rid)
                self._finish(seq, "abort")
                outputs.append(self._output(seq))
        self._aborted = [rid for rid in self._aborted if rid in self.seqs]
        if not self.inflight:  # one prefill at a time: on its partition, or in decode's step
            self._launch_prefill()
        self._send_decode_update()
        if not (self.inflight or self.rows or self.unacked):
            return outputs
        outputs += self._collect()
        # Grants, joins and leaves go out before the caller ships the outputs, so the decode
        # worker's rows seldom wait for a block. Prefill relaunches at the next call, which
        # first takes in the requests that arrived meanwhile.
        self._send_decode_update()
        return outputs

    def _in_prefill(self, seq: Sequence) -> bool:
        return any(seq in job["seqs"] for job in self.inflight.values())

    # -- the decode worker's rows -----------------------------------------------------------
    def _join(self, seq: Sequence) -> None:
        """A prefilled sequence becomes a row of the decode worker's batch."""
        if not self._ensure_room(seq):
            return
        row = self.next_row_id
        self.next_row_id += 1
        self.rows[row] = seq
        self.row_of[seq.request_id] = row
        self.update.joins.append((row, self._item(ScheduledChunk(seq, 1))))

    def _leave(self, seq: Sequence) -> None:
        """Takes a sequence's row out of the decode batch. Its blocks stay reserved until the
        worker acknowledges: it may be stepping that row right now."""
        row = self.row_of.pop(seq.request_id, None)
        if row is None:
            return
        del self.rows[row]
        self.unacked[row] = seq.block_table
        seq.block_table = []
        self.update.leaves.append(row)

    def _ensure_room(self, seq: Sequence) -> bool:
        """Blocks for the sequence's next step and a few beyond (so the worker, which runs
        ahead of this loop, need not wait for a grant); preempts the newest decoding
        sequences when the pool is dry. False when the sequence itself was preempted."""
        q = self.scheduler
        if q.reserve(seq, min(seq.num_tokens + self.lookahead_tokens, self.max_model_len)):
            return True
        while not q.reserve(seq, seq.num_tokens):
            victim = next(s for s in reversed(q.decoding) if s.status is SeqStatus.RUNNING)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._leave(seq)
        super()._finish(seq, reason)

    def _preempt(self, seq: Sequence) -> None:
        q = self.scheduler
        self._leave(seq)
        q.release(seq)
        seq.status = SeqStatus.WAITING
        q.waiting.insert(0, seq)
        q.num_preemptions += 1

    def _decode_split(self) -> int | None:
        """Decode runs beside the prefill partition while a prefill is in flight (always, in
        `static`), else on the whole GPU."""
        if self.cfg.serve.mode == "static" or "prefill" in self.inflight:
            return self.current_prefill_sms
        return None

    def _send_decode_update(self) -> None:
        split = self._decode_split()
        if split != self.sent_split:
            self.update.split = (split,)
            self.sent_split = split
        if self.update:
            self.decode.send_update(self.update)
            self.update = DecodeUpdate()

    # -- prefill ----------------------------------------------------------------------------
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
            free_seq_slots=self.cfg.decode.max_num_seqs - len(q.decoding) - len(q.prefilling),
            decode_slots=self.cfg.decode.max_num_seqs,
            fuse=self.cfg.serve.fuse_prefill, fuse_tokens=self.cfg.serve.chunk_size,
            hold_ms=self.cfg.serve.prefill_hold_fraction * self.slo.ttft_ms,
            batch_tokens=self.cfg.serve.prefill_batch_tokens)
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
        if decision.fuse:
            self.update.prompts += items
            # timed, predicted and logged as the decode step that carries it
            self.inflight["fused"] = dict(seqs=batch, chunks=chunks)
            return
        self.current_prefill_sms = decision.prefill_sms
        sms = self.total_sms if decision.prefill_sms is None else decision.prefill_sms
        shape = PrefillShape.of([c.num_new_tokens for c in chunks])
        self.prefill.submit(items, decision.prefill_sms)
        self.inflight["prefill"] = dict(seqs=batch, chunks=chunks, split=decision.prefill_sms,
                                        predicted=self.perf.prefill_ms(shape, sms), sms=sms,
                                        tokens=shape.num_tokens, start=time.monotonic())

    # -- results ----------------------------------------------------------------------------
    def _collect(self):
        """Waits for the next result of either worker, then takes every other one already
        there (when this loop falls behind the decode worker, it catches up in one call)."""
        outputs = []
        block = True
        while True:
            try:
                name, kind, payload = self.results.get(timeout=0.5) if block else self.results.get_nowait()
            except queue.Empty:
                if not block:
                    return outputs
                for w in (self.prefill, self.decode):
                    if not w.alive():
                        raise WorkerDied(f"{w.name} worker exited with code {w.proc.exitcode}")
                continue
            block = False
            received = time.monotonic()
            if kind == "error" and name == "prefill" and "prefill" in self.inflight:
                outputs += self._prefill_failed(self.inflight.pop("prefill"), payload)
                continue
            if kind in ("error", "fatal"):
                raise WorkerDied(f"{name} worker failed:\n{payload}")
            if kind == "step_failed":
                outputs += self._decode_failed(*payload)
            elif kind == "left":
                self._free_acknowledged(payload)
            elif kind == "step":
                outputs += self._complete_decode(payload, received)
            else:
                results, measured_ms = payload
                job = self.inflight.pop(name)
                job["end"] = received
                outputs += self._complete_prefill(job, results, measured_ms)

    def _free_acknowledged(self, rows: list[int]) -> None:
        for row in rows:
            blocks = self.unacked.pop(row, None)
            if blocks:
                self.allocator.release(blocks)

    def _complete_prefill(self, job: dict, results, measured_ms: float):
        self.prefill_failures.succeeded()
        self.perf.observe("prefill", job["predicted"], measured_ms, job["sms"])
        outputs = self._prefilled(job, results)
        self._record("prefill", job["start"], job["end"], len(job["seqs"]), job["tokens"],
                     job["split"], job["predicted"], measured_ms)
        return outputs

    def _prefill_failed(self, job: dict, trace: str) -> list:
        """A prefill batch that raised in the worker (out of GPU memory, say) ends its own
        requests with the error and frees their blocks; the worker caught the error and takes
        the next batch, and every other request goes on (bullet_trt/engine/step_failure.py)."""
        reason = last_line(trace)
        self.prefill_failures.failed(reason)
        report("prefill", len(job["seqs"]), trace)
        return self._fail_running([c.seq for c in job["chunks"]],
                                  f"prefill failed on the engine's prefill worker: {reason}")

    def _decode_failed(self, trace: str, rows: list[int], carried_prompts: bool) -> list:
        """A decode step that raised in the worker ends the requests of its rows, and those
        of the prompts it carried; the worker dropped those rows and steps the others on."""
        reason = last_line(trace)
        self.decode_failures.failed(reason)
        seqs = [self.rows[row] for row in rows if row in self.rows]
        if carried_prompts and "fused" in self.inflight:
            seqs += self.inflight.pop("fused")["seqs"]
        report("decode", len(seqs), trace)
        return self._fail_running(seqs, f"decode failed on the engine's decode worker: {reason}")

    def _fail_running(self, seqs: list[Sequence], message: str) -> list:
        outputs = []
        for seq in seqs:
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.request_id in self._aborted:
                self._aborted.remove(seq.request_id)
            outputs.append(self._fail(seq, message))
        return outputs

    def _prefilled(self, job: dict, results) -> list:
        """The job's sequences, their prompts now cached, start decoding (or finish)."""
        q = self.scheduler
        outputs = []
        for chunk, res in zip(job["chunks"], results):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_cached_tokens += chunk.num_new_tokens
            q.prefilling.remove(seq)
            q.decoding.append(seq)
            if seq.request_id in self._aborted:
                self._aborted.remove(seq.request_id)
                self.seqs.pop(seq.request_id, None)
                self._finish(seq, "abort")
                outputs.append(self._output(seq))
                continue
            self._accept(seq, res)
            outputs.append(self._output(seq))
            if seq.status is SeqStatus.FINISHED:
                self.seqs.pop(seq.request_id, None)
            else:
                self._join(seq)
        return outputs

    def _complete_decode(self, step: DecodeStep, received: float):
        self.decode_failures.succeeded()
        self._free_acknowledged(step.left)
        outputs = []
        for row, token, logprob in zip(step.row_ids, step.token_ids, step.logprobs):
            seq = self.rows.get(row)
            if seq is None or seq.request_id in self._aborted:
                continue  # it left while the worker ran ahead, or it ends at the next step()
            seq.num_cached_tokens += 1
            self._accept(seq, SampleResult(token, logprob))
            outputs.append(self._output(seq))
            if seq.status is SeqStatus.FINISHED:
                self.seqs.pop(seq.request_id, None)
                continue
            before = len(seq.block_table)
            if self._ensure_room(seq) and len(seq.block_table) > before:
                self.update.grants.append((row, seq.block_table[before:]))
        split = step.prefill_sms
        sms = self.total_sms if split is None else self.total_sms - split
        if step.prompt_results is not None:
            job = self.inflight.pop("fused")
            shape = PrefillShape.of([c.num_new_tokens for c in job["chunks"]])
            predicted = self.perf.fused_ms(len(step.row_ids), step.total_ctx, shape, sms)
            self.perf.observe("fused", predicted, step.measured_ms, sms)
            outputs += self._prefilled(job, step.prompt_results)
            self._record("fused", step.start, received, len(step.row_ids) + len(job["seqs"]),
                         len(step.row_ids) + step.prompt_tokens, split, predicted, step.measured_ms,
                         host_gap_ms=step.idle_ms)
            return outputs
        predicted = self.perf.decode_ms(len(step.row_ids), step.total_ctx, sms)
        self.perf.observe("decode", predicted, step.measured_ms, sms)
        self._record("decode", step.start, received, len(step.row_ids), len(step.row_ids), split,
                     predicted, step.measured_ms, host_gap_ms=step.idle_ms)
        return outputs

    def _record(self, phase: str, start: float, end: float, batch: int, tokens: int,
                split: int | None, predicted: float, measured_ms: float,
                host_gap_ms: float | None = None) -> None:
        total = self.partitioner.total_sms  # 0 without partitioning (CPU)
        prefill_sms = total if split is None else split
        decode_sms = total if split is None else total - split
        stepping = phase in ("decode", "fused")  # a fused step is decode's, prompts riding along
        self.last_split = (prefill_sms if phase == "prefill" else self.last_split[0],
                           decode_sms if stepping else self.last_split[1])
        if self.log is None:
            return
        q = self.scheduler
        rec = {"t": round(start - self.t0, 6), "phase": phase, "batch": batch,
               "tokens": tokens, "sms": prefill_sms if phase == "prefill" else decode_sms,
               "prefill_sms": prefill_sms if split is not None or phase == "prefill" else 0,
               "decode_sms": decode_sms if split is not None or stepping else 0,
               "predicted_ms": round(predicted, 3), "measured_ms": round(measured_ms, 3),
               "waiting": len(q.waiting), "prefilling": len(q.prefilling), "decoding": len(q.decoding),
               **self.gpu_monitor.sample()}
        # wall: from the step's start to its result here (measured_ms plus the IPC); host
        # gap: the decode worker idle since its previous step
        rec["wall_ms"] = round((end - start) * 1e3, 3)
        if host_gap_ms is not None:
            rec["host_gap_ms"] = round(host_gap_ms, 3)
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
