"""SpatialEngine: a prefill worker and a decode worker run at the same time, each on its own
SM partition, over one shared pool; the split is re-chosen at every prefill launch.

It composes the engine's parts (shared weights and pool, block allocator, request
lifecycle) with Bullet's own (partitioner, policy, performance model, workers, decode rows,
iteration log); the engine knows nothing of it. Neither phase waits for the other. The
decode worker keeps its own batch and steps it back to back (decode_batch.py); this loop
accepts its tokens, applies the stopping rules (the lifecycle's), grants blocks and tells it
which rows join (prompts just prefilled) and leave. Whenever the prefill worker is free the
policy picks the split and the prompts to admit. Decode runs on the complement of the
prefill partition while a prefill is in flight, and on the whole GPU otherwise. Modes:
`bullet` (dynamic split), `static` (one fixed split for both phases).

With parallel.tensor_parallel_size N > 1 this orchestrator is rank 0: it starts N - 1 rank
followers (engine/tp_ranks.py, spatial/rank_follower.py), each of which starts a prefill and a
decode worker on its own GPU; each of this orchestrator's workers hands the messages it takes
to the same worker of the other ranks (rank_mirror.py), so the split and the batches it
decides run on every rank in the same iteration.
"""
from __future__ import annotations

import queue
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from bullet_trt.config import ConfigError, EngineConfig
from bullet_trt.engine.kv_pool import blocks_for_tokens
from bullet_trt.engine.lifecycle import RequestLifecycle
from bullet_trt.engine.prefix_cache import engine_allocator, prefix_stats
from bullet_trt.engine.request import EngineStats, NewRequest, RequestOutput
from bullet_trt.engine.sequence import SeqStatus, Sequence
from bullet_trt.engine.session import SampleResult
from bullet_trt.engine.shared_state import build_shared_state, release_device_memory, request_limits
from bullet_trt.engine.step_failure import FailureStreak, last_line, report
from bullet_trt.engine.tp_group import Rendezvous
from bullet_trt.engine.tp_ranks import TensorParallelRanks
from bullet_trt.protocol import (BatchDone, BatchFailed, DecodeStep, DecodeStepFailed, RowsLeft, SmSplit,
                                 WorkerFatal, WorkerPlan)
from bullet_trt.spatial.calibration_store import CalibrationKey, load_perf_model
from bullet_trt.spatial.decode_rows import DecodeRows
from bullet_trt.spatial.iteration_log import IterationLog
from bullet_trt.spatial.partitioners import make_partitioner
from bullet_trt.spatial.perf_model import ModelCost, PerfModel, PrefillShape
from bullet_trt.spatial.policy import Decision, PolicyState, SloConfig, WaitingPrompt, bullet_policy, static_policy
from bullet_trt.spatial.plan_tuner import TpotPlanTuner
from bullet_trt.spatial.queues import SpatialQueues
from bullet_trt.spatial.row_pace import GapMeter, RowPace, rows_step_ms
from bullet_trt.spatial.session_worker import SessionWorker, WorkerDied, worker_profiles


@dataclass
class PrefillJob:
    """Prompts in flight: on the prefill partition, or riding in decode's next step (fused)."""

    seqs: list[Sequence]
    tokens: list[int]  # tokens each prefills, in order
    split: SmSplit
    predicted_ms: float = 0.0
    # The decoding rows the decision counted in a fused step's token budget. The worker's step
    # may hold others: rows that joined or left while the prompts were on their way.
    planned_rows: int = 0


FOLLOWER = "bullet_trt.spatial.rank_follower:run_spatial_follower"
ROLES = ("prefill", "decode")
# Fused jobs out at once: the one a decode step carries, and the next, which is sent while
# that step runs so that it rides in the step right after (with one, the worker had already
# started another step by the time the first came back: prompts rode in every other step).
FUSED_IN_FLIGHT = 2


class SpatialEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        tp = cfg.parallel.tensor_parallel_size > 1
        self.ranks = TensorParallelRanks(cfg, FOLLOWER) if tp else None
        try:
            self._build(cfg)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, cfg: EngineConfig) -> None:
        s = cfg.serve
        ranks = self.ranks
        self.state, model = build_shared_state(cfg, share=True, tp=ranks.group if ranks else None)
        del model  # the workers attach the shared weights
        device = self.state.kv_pool.device
        self.allocator = engine_allocator(self.state.num_blocks, self.state.block_size, ranks is not None,
                                          cfg.kv.prefix_caching)
        self.queues = SpatialQueues(self.allocator, self.state.block_size)
        self.requests = RequestLifecycle(request_limits(cfg, self.state), self.state.arch.eos_token_ids,
                                         release=self._release)
        static = s.mode == "static"
        self.partitioner = make_partitioner(s.partitioner, device,
                                            prefill_sms=s.static_prefill_sms if static else None,
                                            libsmctrl_path=s.libsmctrl_path or None)
        # Without partitioning (CPU) each phase runs on what the OS gives it; the policy still
        # admits by deadline but has no split to choose.
        self.total_sms = self.partitioner.total_sms or 1
        self.splits = self._splits(static)
        self.slo = SloConfig(ttft_ms=s.ttft_slo_ms, tpot_ms=s.tpot_slo_ms, ttft_plan=s.ttft_plan_fraction,
                             tpot_plan=s.tpot_plan_fraction)
        self.perf = self._load_perf_model(device)
        self.plan_tuner = (TpotPlanTuner(s.ttft_slo_ms, s.tpot_slo_ms, s.tpot_plan_fraction,
                                         floor=min(0.7, s.tpot_plan_fraction))
                           if s.tpot_plan_auto else None)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.decode_epoch = ctx.RawValue("q", 0)  # the split epoch the decode worker runs at
        static_split = self.splits[0] if static and self.splits else None
        envs = {role: self._worker_env(role, static_split) for role in ROLES}
        rendezvous = {role: None for role in ROLES}
        if ranks is not None:
            rendezvous = {role: Rendezvous.new(ranks.size) for role in ROLES}
            ranks.group.broadcast(WorkerPlan(self.partitioner.name, self.splits, envs, rendezvous))
        self.prefill, self.decode = (
            SessionWorker(role, self.state, profile, self.partitioner.name, self.splits, envs[role],
                          outbox=self.results, decode_epoch=self.decode_epoch,
                          tp=(rendezvous[role], 0) if ranks is not None else None,
                          gpu_clock=bool(s.iteration_log))
            for role, profile in worker_profiles(cfg).items())
        if self.prefill.piecewise:
            buckets = list(self.prefill.piecewise)
            print(f"bullet_trt: prefill worker: piecewise graphs at {len(buckets)} token buckets "
                  f"({buckets[0]}..{buckets[-1]}) on {max(self.prefill.piecewise.values())} partitions",
                  file=sys.stderr, flush=True)
        if ranks is not None:
            ranks.pool_ready(self.state.num_blocks)
        self.static_split = SmSplit(self.total_sms, static_split)
        self.prefilling: PrefillJob | None = None  # on the prefill partition
        # serve.split_ahead: the split that prompts waiting for a prefill not yet started are
        # expected to get, which decode moves to before it starts
        self.ahead: SmSplit | None = None
        # riding in decode's steps, one job a step in the order sent: the one a step carries
        # now and the next, sent meanwhile so that it rides in the very next step
        self.fused: deque[PrefillJob] = deque()
        self.rows = DecodeRows()
        self.starved: list[Sequence] = []  # decoding, their next block due from acknowledged leaves
        self.lookahead_tokens = cfg.serve.grant_lookahead_tokens
        self.prefill_failures = FailureStreak("prefill")
        self.decode_failures = FailureStreak("decode")
        self.last_sms = (0, 0)  # SMs of the last prefill and the last decode step, for stats
        self.decode_gaps = GapMeter()  # the rows' pace after a prefill (serve.row_tpot_budget)
        gpu_index = (device.index or 0) if device.type == "cuda" else None
        self.log = IterationLog(s.iteration_log or None, gpu_index, self.partitioner.total_sms > 0)

    def _splits(self, static: bool) -> list[int]:
        s = self.cfg.serve
        if self.partitioner.name == "none":
            return []
        if static:
            return self.partitioner.validate_splits([s.static_prefill_sms], "serve.static_prefill_sms")
        low = s.min_phase_sms
        splits = [x for x in self.partitioner.splits()
                  if min((split := SmSplit(self.total_sms, x)).prefill_sms, split.decode_sms) >= low]
        if not splits:
            raise ConfigError(f"serve.min_phase_sms={low} leaves no split of the GPU's "
                              f"{self.total_sms} SMs; lower it")
        return splits

    def _worker_env(self, role: str, static_split: int | None) -> dict:
        env = self.partitioner.worker_env(role, static_split)
        if self.cfg.serve.libsmctrl_path:
            env["LIBSMCTRL_PATH"] = self.cfg.serve.libsmctrl_path
        return env

    def _load_perf_model(self, device) -> PerfModel:
        """The engine directory's calibration for this GPU, else uncalibrated defaults that
        the online correction then pulls toward measured times."""
        arch, shard = self.state.arch, self.state.shard
        cost = ModelCost.of_state(self.state).per_rank(
            shard.size, shard.kv_heads(arch)[1], arch.num_kv_heads)
        key = (CalibrationKey.for_server(self.cfg, arch, torch.cuda.get_device_name(device), self.total_sms,
                                         self.state.dtype) if device.type == "cuda" else None)
        perf, note = load_perf_model(self.cfg.engine_dir, cost, key,
                                     worker_profiles(self.cfg)["prefill"].piecewise_graph_tokens, cpu_sms=self.total_sms)
        print(f"bullet_trt: performance model: {note}", file=sys.stderr, flush=True)
        return perf

    # -- the engine interface ---------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        return self.requests.eos_token_ids

    def add_request(self, req: NewRequest) -> None:
        self.queues.add(self.requests.admit(req))

    def abort_request(self, request_id: str) -> None:
        self.requests.abort(request_id)

    def has_unfinished(self) -> bool:
        # Blocks whose leave the decode worker has not acknowledged are still in use.
        return (self.requests.has_unfinished() or self.prefilling is not None or bool(self.fused)
                or bool(self.rows.unacked))

    def stats(self) -> EngineStats:
        q = self.queues
        free = (self.allocator.num_free, *(self.ranks.follower_free_blocks() if self.ranks else ()))
        return EngineStats(num_waiting=len(q.waiting), num_waiting_tokens=sum(s.num_uncached for s in q.waiting),
                           num_running=len(q.running),
                           kv_blocks_total=self.allocator.num_blocks, kv_blocks_free=min(free),
                           kv_blocks_free_by_rank=free,
                           tokens_generated=self.requests.tokens_generated, num_preemptions=q.num_preemptions,
                           **prefix_stats(self.allocator),
                           prefill_sms=self.last_sms[0], decode_sms=self.last_sms[1],
                           tpot_plan=self.slo.tpot_plan if self.cfg.serve.mode == "bullet" else 0.0,
                           perf_correction_prefill=self.perf.correction["prefill"],
                           perf_correction_decode=self.perf.correction["decode"])

    def fail_all(self, message: str) -> list[RequestOutput]:
        return self.requests.fail_all(message)

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.ranks is not None:
            # the followers count the blocks given and taken back; when idle, before the next stats
            self.ranks.sync(self.allocator, wait=not self.has_unfinished())
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs = self._apply_aborts()
        # A prefill on the partition, and prompts riding in decode's steps (serve.fuse_prefill),
        # which may start while the partition's runs; the static policy never fuses, so in
        # static mode nothing can start beside a prefill and no decision is asked for
        may_fuse = self.cfg.serve.fuse_prefill != "never" and not self._static_split()
        if len(self.fused) < FUSED_IN_FLIGHT and (self.prefilling is None or may_fuse):
            self._launch_prefill()
        self._send_decode_update()
        if self.prefilling is None and not self.fused and not self.rows:
            return outputs
        prefill_in_flight = self.prefilling is not None
        outputs += self._collect()
        if (self.cfg.serve.split_ahead and prefill_in_flight and self.prefilling is None and not self.fused
                and self.queues.waiting):
            # the prefill ended with prompts waiting: decode goes to the split the next one is
            # expected to get, not to the whole GPU until the next call launches it
            self._move_ahead(self._decision(list(self.queues.waiting)))
        # Grants, joins and leaves go out before the caller ships the outputs, so the decode
        # worker's rows seldom wait for a block. Prefill relaunches at the next call, which
        # first takes in the requests that arrived meanwhile.
        self._send_decode_update()
        return outputs

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        if self.ranks is not None:
            self.ranks.close()
        self.log.close()
        device = self.state.kv_pool.device
        del self.state
        release_device_memory(device)

    # -- sequences --------------------------------------------------------------------------
    def _in_prefill(self, seq: Sequence) -> bool:
        return any(job is not None and seq in job.seqs for job in (self.prefilling, *self.fused))

    def _apply_aborts(self) -> list[RequestOutput]:
        """Aborted sequences end now, except those in a prefill: they end when it returns."""
        outputs = []
        for rid in list(self.requests.aborted):
            seq = self.requests.seqs.get(rid)
            if seq is not None and not self._in_prefill(seq):
                self.requests.finish(seq, "abort")
                outputs.append(self.requests.output(seq))
        return outputs

    def _release(self, seq: Sequence) -> None:
        """A finished sequence leaves the decode batch; its blocks return once the worker
        acknowledges (DecodeRows), or now when it never joined."""
        self.rows.leave(seq)
        self.queues.release(seq)
        if self.plan_tuner is not None:
            self._record_tpot(seq)
        if seq in self.starved:
            self.starved.remove(seq)

    def _record_tpot(self, seq: Sequence) -> None:
        """A request that ended with two tokens or more gives the plan's tuner its TPOT."""
        emitted = len(seq.output_token_ids)
        if seq.finish_reason in ("stop", "length") and seq.first_token_time is not None and emitted >= 2:
            self.plan_tuner.record_tpot((time.monotonic() - seq.first_token_time) * 1e3 / (emitted - 1))

    def _join(self, seq: Sequence) -> None:
        """A prefilled sequence becomes a row of the decode worker's batch."""
        if self._ensure_room(seq):
            self.rows.join(seq, self.requests.item(seq, 1))

    def _ensure_room(self, seq: Sequence) -> bool:
        """Blocks for the sequence's next step and a few beyond (so the worker, which runs
        ahead of this loop, need not wait for a grant). When the pool is dry, the newest
        decoding sequences are preempted, but only as many as the blocks still due from
        acknowledged leaves do not cover: a preempted row's blocks come back only once the
        worker acknowledges its leave, so preempting on until the pool itself has room would
        empty the whole batch. A sequence whose block is due waits, `starved`, and gets it when
        the acknowledgement comes (`_free_acknowledged`). False when the sequence itself was
        preempted."""
        q = self.queues
        if q.reserve(seq, min(seq.num_tokens + self.lookahead_tokens, self.requests.limits.max_model_len)):
            return True
        if q.reserve(seq, seq.num_tokens):
            return True
        while (self.allocator.num_free + self.allocator.returned_by(self.rows.unacked.values()) - self._promised(seq)
               < self._short_of(seq)):
            victim = next(s for s in reversed(q.decoding) if s.status is SeqStatus.RUNNING)
            self._preempt(victim)
            if victim is seq:
                return False
        if not q.reserve(seq, seq.num_tokens) and seq not in self.starved:
            self.starved.append(seq)
        return True

    def _short_of(self, seq: Sequence) -> int:
        return blocks_for_tokens(seq.num_tokens, self.queues.block_size) - len(seq.block_table)

    def _promised(self, other_than: Sequence) -> int:
        """Blocks due from acknowledgements that other starved sequences already wait for."""
        return sum(self._short_of(s) for s in self.starved if s is not other_than)

    def _free_acknowledged(self, rows: list[int]) -> None:
        """Blocks of acknowledged leaves go back to the pool, and first to starved rows."""
        self.allocator.release(self.rows.acknowledged(rows))
        for seq in list(self.starved):
            before = len(seq.block_table)
            if not self.queues.reserve(seq, seq.num_tokens):
                break  # first come, first served: the rest wait for the next acknowledgement
            self.starved.remove(seq)
            row = self.rows.row_of.get(seq.request_id)
            if row is not None:
                self.rows.grant(row, seq.block_table[before:])

    def _preempt(self, seq: Sequence) -> None:
        q = self.queues
        self._release(seq)
        seq.status = SeqStatus.WAITING
        q.waiting.insert(0, seq)
        q.num_preemptions += 1

    def _decode_split(self) -> SmSplit:
        """Decode runs beside the prefill partition while a prefill is in flight (always, in
        `static`), else on the whole GPU."""
        if self.cfg.serve.mode == "static":
            return self.static_split
        if self.prefilling is not None:
            return self.prefilling.split
        if self.ahead is not None:
            return self.ahead
        return SmSplit.whole(self.total_sms)

    def _send_decode_update(self) -> None:
        update = self.rows.take_update(self._decode_split())
        if update is not None:
            self.decode.send_update(update)

    # -- prefill ----------------------------------------------------------------------------
    def _decision(self, candidates: list[Sequence]) -> Decision:
        q, s = self.queues, self.cfg.serve
        if self.plan_tuner is not None:
            now = time.monotonic()
            # a preempted sequence waits again, but its TTFT is behind it
            oldest = min((x.arrival_time for x in candidates if x.first_token_time is None), default=now)
            self.slo.tpot_plan = self.plan_tuner.plan(now, (now - oldest) * 1e3)
        decoding = self._running_rows()
        ctx = sum(x.num_tokens for x in decoding)
        state = PolicyState(
            now=time.monotonic(), total_sms=self.total_sms, splits=self.splits,
            decode_batch=len(decoding), decode_total_ctx=ctx,
            waiting=[WaitingPrompt(x.arrival_time, x.num_uncached) for x in candidates],
            max_prefill_tokens=self.cfg.prefill.max_num_batched_tokens,
            max_prefill_seqs=self.cfg.prefill.max_num_seqs,
            free_seq_slots=self.cfg.decode.max_num_seqs - len(q.decoding) - len(q.prefilling),
            decode_slots=self.cfg.decode.max_num_seqs,
            fuse=s.fuse_prefill, fuse_tokens=s.chunk_size, fuse_slices=s.fuse_prompt_slices,
            hold_ms=s.prefill_hold_fraction * self.slo.ttft_ms, batch_tokens=s.prefill_batch_tokens,
            beside_prefill_sms=None if self.prefilling is None else self.prefilling.split.decode_sms,
            row_step_ms=self._row_step_ms(decoding, ctx) if s.row_tpot_budget else None,
            split_ahead=s.split_ahead, ahead_lead_steps=s.split_ahead_lead_steps)
        if self._static_split():
            return static_policy(state, self.slo, self.perf, self.splits[0])
        return bullet_policy(state, self.slo, self.perf)

    def _running_rows(self) -> list[Sequence]:
        return [x for x in self.queues.decoding if x.status is SeqStatus.RUNNING]

    def _row_step_ms(self, decoding: list[Sequence], ctx: int) -> float | None:
        """The longest step beside a prefill that the decoding rows' TPOT affords
        (spatial/row_pace.py), for a prefill as long as the policy lets one batch run."""
        if not decoding:
            return None
        now = time.monotonic()
        rows = [RowPace(x.params.max_tokens, len(x.output_token_ids), now - x.first_token_time)
                for x in decoding if x.first_token_time is not None]
        whole_gpu_ms = self.perf.decode_ms(len(decoding), ctx, self.total_sms)
        later_ms = max(whole_gpu_ms, self.decode_gaps.mean_ms or whole_gpu_ms)
        return rows_step_ms(rows, self.slo.tpot_ms, whole_gpu_ms, later_ms, self.slo.prefill_batch_ms)

    def _static_split(self) -> bool:
        """Whether the static policy decides (static mode with a split to hold)."""
        return self.cfg.serve.mode == "static" and bool(self.splits)

    def _launch_prefill(self) -> None:
        q = self.queues
        if not q.waiting:
            self.ahead = None
            return
        candidates = list(q.waiting)
        decision = self._decision(candidates)
        if self.prefilling is None and not self.fused:
            self._move_ahead(decision)
        if (self.prefilling is not None or self.fused) and not decision.fuse:
            # the partition is taken (the static policy does not know it), or prompts ride in
            # decode's steps on the whole GPU: a split would move them
            return
        batch: list[Sequence] = []
        for i in decision.admit:
            seq = candidates[i]
            if not q.admit(seq):  # one that rode in part already holds its prompt's blocks
                break  # blocks run out: the rest wait for decodes to finish
            batch.append(seq)
        if not batch:
            return
        for seq in batch:
            q.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            q.prefilling.append(seq)
        tokens = (decision.tokens or [x.num_uncached for x in batch])[:len(batch)]
        items = [self.requests.item(x, n) for x, n in zip(batch, tokens)]
        split = SmSplit(self.total_sms, decision.prefill_sms)
        if decision.fuse:
            # timed, predicted and logged as the decode step that carries it
            self.rows.carry_prompts(items)
            self.fused.append(PrefillJob(batch, tokens, split, planned_rows=len(self._running_rows())))
            return
        predicted = self.perf.prefill_ms(PrefillShape.of(tokens), split.prefill_sms)
        self.prefilling = PrefillJob(batch, tokens, split, predicted)
        self.ahead = None
        self._send_decode_update()  # decode's move to the complement gets its epoch now
        wait = self.cfg.serve.prefill_waits_for_split and not split.is_whole
        self.prefill.submit(items, split, after_decode_epoch=self.rows.split_epoch if wait else 0)

    def _move_ahead(self, decision) -> None:
        """While prompts wait for a prefill that has not started, decode runs on the complement
        of the split they are expected to get (serve.split_ahead), so that it has left those SMs
        when the prefill starts: decode's move reaches its steps one or two steps after it is
        sent, and a prefill that started at once on its partition shared SMs with decode's steps
        on the whole GPU for that long. Expected: the split a gathering batch is planned for once
        it is due, or the one a decision admitted prompts to, which the next call launches. The
        split only grows while they wait (the queue does), and a batch once due stays so until
        it starts (its expected start moves with each arrival), so decode does not move back
        and forth."""
        if not self.cfg.serve.split_ahead:
            return
        expected = decision.ahead_sms
        if expected is None and decision.admit and not decision.fuse:
            expected = decision.prefill_sms
        if expected is None:
            if not self.queues.waiting:
                self.ahead = None
        elif self.ahead is None or expected > self.ahead.prefill_sms:
            self.ahead = SmSplit(self.total_sms, expected)

    def _prefilled(self, job: PrefillJob, results: list) -> list[RequestOutput]:
        """The job's sequences, their prompts now cached, start decoding (or finish); one that
        rode in part waits again at the head of the queue for its rest."""
        q, reqs = self.queues, self.requests
        outputs = []
        for seq, n, res in zip(job.seqs, job.tokens, results):
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_cached_tokens += n
            self.allocator.register_prefix(seq.prompt_token_ids, seq.block_table, seq.num_cached_tokens)
            q.prefilling.remove(seq)
            if seq.request_id in reqs.aborted:
                reqs.finish(seq, "abort")  # its blocks go back, however much of its prompt ran
                outputs.append(reqs.output(seq))
                continue
            if seq.num_uncached > 0:
                seq.status = SeqStatus.WAITING
                q.waiting.insert(0, seq)
                continue
            q.decoding.append(seq)
            first = seq.first_token_time is None  # not a preempted sequence prefilled again
            reqs.accept(seq, res)
            if first and self.plan_tuner is not None and seq.first_token_time is not None:
                self.plan_tuner.record_ttft((seq.first_token_time - seq.arrival_time) * 1e3)
            outputs.append(reqs.output(seq))
            if seq.status is not SeqStatus.FINISHED:
                self._join(seq)
        return outputs

    # -- results ----------------------------------------------------------------------------
    def _collect(self) -> list[RequestOutput]:
        """Waits for the next result of either worker, then takes every other one already
        there (when this loop falls behind the decode worker, it catches up in one call)."""
        outputs: list[RequestOutput] = []
        block = True
        while True:
            try:
                msg = self.results.get(timeout=0.5) if block else self.results.get_nowait()
            except queue.Empty:
                if not block:
                    return outputs
                for w in (self.prefill, self.decode):
                    if not w.alive():
                        raise WorkerDied(f"{w.name} worker exited with code {w.proc.exitcode}")
                if self.ranks is not None and not self.ranks.alive():
                    raise WorkerDied("a tensor-parallel rank follower exited")
                continue
            block = False
            received = time.monotonic()
            match msg:
                case BatchDone() if self.prefilling is not None:
                    job, self.prefilling = self.prefilling, None
                    outputs += self._complete_prefill(job, msg, received)
                case BatchFailed(trace=trace) if self.prefilling is not None:
                    job, self.prefilling = self.prefilling, None
                    outputs += self._prefill_failed(job, trace)
                case DecodeStep():
                    outputs += self._complete_decode(msg, received)
                case DecodeStepFailed(trace=trace, rows=rows, carried_prompts=carried):
                    outputs += self._decode_failed(trace, rows, carried)
                case RowsLeft(rows=rows):
                    self._free_acknowledged(rows)
                case WorkerFatal(role=role, trace=trace) | BatchFailed(role=role, trace=trace):
                    raise WorkerDied(f"{role} worker failed:\n{trace}")
                case _:
                    raise WorkerDied(f"unexpected message from a worker: {msg!r}")

    def _complete_prefill(self, job: PrefillJob, done: BatchDone, received: float) -> list[RequestOutput]:
        self.prefill_failures.succeeded()
        sms = job.split.prefill_sms
        self.perf.observe("prefill", job.predicted_ms, done.measured_ms, sms)
        outputs = self._prefilled(job, done.results)
        self.last_sms = (self.partitioner.total_sms and sms, self.last_sms[1])
        self.log.record("prefill", job.split, done.start, received, len(job.seqs), sum(job.tokens),
                        job.predicted_ms, done.measured_ms, self.queues, split_wait_ms=done.waited_ms,
                        gpu_window_ns=done.gpu_window_ns,
                        tpot_plan=self.slo.tpot_plan if self.plan_tuner is not None else None)
        return outputs

    def _prefill_failed(self, job: PrefillJob, trace: str) -> list[RequestOutput]:
        """A prefill batch that raised in the worker (out of GPU memory, say) ends its own
        requests with the error and frees their blocks; the worker caught the error and takes
        the next batch, and every other request goes on (bullet_trt/engine/step_failure.py)."""
        reason = last_line(trace)
        self.prefill_failures.failed(reason)
        report("prefill", len(job.seqs), trace)
        return self._fail_running(job.seqs, f"prefill failed on the engine's prefill worker: {reason}")

    def _decode_failed(self, trace: str, rows: list[int], carried_prompts: bool) -> list[RequestOutput]:
        """A decode step that raised in the worker ends the requests of its rows, and those
        of the prompts it carried; the worker dropped those rows and steps the others on."""
        reason = last_line(trace)
        self.decode_failures.failed(reason)
        seqs = [self.rows.rows[row] for row in rows if row in self.rows.rows]
        if carried_prompts and self.fused:
            seqs += self.fused.popleft().seqs
        report("decode", len(seqs), trace)
        return self._fail_running(seqs, f"decode failed on the engine's decode worker: {reason}")

    def _fail_running(self, seqs: list[Sequence], message: str) -> list[RequestOutput]:
        return [self.requests.fail(seq, message) for seq in seqs if seq.status is SeqStatus.RUNNING]

    def _complete_decode(self, step: DecodeStep, received: float) -> list[RequestOutput]:
        self.decode_failures.succeeded()
        self._free_acknowledged(step.left)
        reqs = self.requests
        outputs = []
        for row, token, logprob in zip(step.row_ids, step.token_ids, step.logprobs):
            seq = self.rows.rows.get(row)
            if seq is None or seq.request_id in reqs.aborted:
                continue  # it left while the worker ran ahead, or it ends at the next step()
            seq.num_cached_tokens += 1
            reqs.accept(seq, SampleResult(token, logprob))
            outputs.append(reqs.output(seq))
            if seq.status is SeqStatus.FINISHED:
                continue
            before = len(seq.block_table)
            if self._ensure_room(seq) and len(seq.block_table) > before:
                self.rows.grant(row, seq.block_table[before:])
        sms = step.split.decode_sms
        self.last_sms = (self.last_sms[0], self.partitioner.total_sms and sms)
        self.decode_gaps.step_done(received)
        rows = len(step.row_ids)
        if step.prompt_results is not None and self.fused:
            job = self.fused.popleft()
            predicted = self.perf.fused_ms(rows, step.total_ctx, PrefillShape.of(job.tokens), sms)
            self.perf.observe("fused", predicted, step.measured_ms, sms)
            outputs += self._prefilled(job, step.prompt_results)
            self.log.record("fused", step.split, step.start, received, rows + len(job.seqs),
                            rows + step.prompt_tokens, predicted, step.measured_ms, self.queues,
                            host_gap_ms=step.idle_ms, gpu_window_ns=step.gpu_window_ns,
                            rows_without_block=step.rows_without_block, prompts=len(job.seqs),
                            planned_rows=job.planned_rows)
            return outputs
        predicted = self.perf.decode_ms(rows, step.total_ctx, sms)
        self.perf.observe("decode", predicted, step.measured_ms, sms)
        self.log.record("decode", step.split, step.start, received, rows, rows, predicted, step.measured_ms,
                        self.queues, host_gap_ms=step.idle_ms, prefill_in_flight=self.prefilling is not None,
                        gpu_window_ns=step.gpu_window_ns, rows_without_block=step.rows_without_block,
                        launch_ms=step.launch_ms)
        return outputs
