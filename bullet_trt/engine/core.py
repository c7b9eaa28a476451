"""EngineCore: the chunked-prefill engine. Requests in, per-step token outputs out.

One session in this process runs every step as one hybrid batch: each running sequence's
decode token plus prompt chunks up to the token budget (serve.chunk_size), the vLLM/SGLang
default that Bullet is measured against. It composes the engine's parts: the shared weights
and pool, the block allocator, the batch scheduler, the request lifecycle and the session.
With `decode.overlap_steps` (one GPU) each step is launched before the last one's tokens are
read, as bullet's decode worker does with the same setting (engine/steps_ahead.py).
The Bullet orchestrator (bullet_trt/spatial) composes the same parts in its own way; this
file knows nothing of it.

With parallel.tensor_parallel_size N > 1 this engine is rank 0: it starts N - 1 follower
processes (engine/tp_ranks.py), schedules alone, and its session hands every batch to them
before running it, so that all ranks run each forward together (engine/tp_follower.py).
"""
from __future__ import annotations

import dataclasses
import traceback

from bullet_trt.config import EngineConfig, ProfileConfig
from bullet_trt.engine.batch_scheduler import BatchScheduler, ScheduledChunk
from bullet_trt.engine.lifecycle import RequestLifecycle
from bullet_trt.engine.prefix_cache import engine_allocator, prefix_stats
from bullet_trt.engine.request import EngineStats, NewRequest, RequestOutput
from bullet_trt.engine.sequence import SeqStatus
from bullet_trt.engine.session import TorchSession
from bullet_trt.engine.shared_state import build_shared_state, release_device_memory, request_limits
from bullet_trt.engine.step_failure import FailureStreak, device_usable, last_line, report
from bullet_trt.engine.step_log import StepLog
from bullet_trt.engine.steps_ahead import StepAhead, StepsAhead
from bullet_trt.engine.tp_ranks import LeaderSession, TensorParallelRanks

FOLLOWER = "bullet_trt.engine.tp_follower:run_chunked_follower"


def chunked_profile(cfg: EngineConfig) -> ProfileConfig:
    """One session runs both phases: decode-only steps replay the decode profile's graphs."""
    return dataclasses.replace(cfg.prefill, cuda_graph_batch_sizes=cfg.decode.cuda_graph_batch_sizes,
                               max_num_seqs=max(cfg.prefill.max_num_seqs, cfg.decode.max_num_seqs))


class EngineCore:
    def __init__(self, cfg: EngineConfig, token_budget: int | None = None):
        self.cfg = cfg
        tp = cfg.parallel.tensor_parallel_size > 1
        self.ranks = TensorParallelRanks(cfg, FOLLOWER) if tp else None
        try:
            self._build(cfg, token_budget)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, cfg: EngineConfig, token_budget: int | None) -> None:
        ranks = self.ranks
        self.state, model = build_shared_state(cfg, share=False, tp=ranks.group if ranks else None)
        self.allocator = engine_allocator(self.state.num_blocks, self.state.block_size, ranks is not None,
                                          cfg.kv.prefix_caching)
        max_seqs = cfg.decode.max_num_seqs
        self.scheduler = BatchScheduler(self.allocator, self.state.block_size, max_seqs,
                                        token_budget or cfg.serve.chunk_size)
        self.requests = RequestLifecycle(request_limits(cfg, self.state), self.state.arch.eos_token_ids,
                                         release=self.scheduler.release)
        self.session = TorchSession(model, self.state.kv_pool, self.state.block_size, chunked_profile(cfg))
        self.session.warm_up()
        self.session.capture_graphs()
        self.log = StepLog(cfg.serve.iteration_log or None, self.session.device)
        # the ranks' session hands each batch on and waits: nothing to launch ahead there
        self.ahead = StepsAhead(self.session, self.log) if cfg.decode.overlap_steps and ranks is None else None
        if ranks is not None:
            ranks.pool_ready(self.state.num_blocks)
            self.session = LeaderSession(self.session, ranks, self.allocator)
        self.step_failures = FailureStreak("engine")

    @property
    def eos_token_ids(self) -> list[int]:
        return self.requests.eos_token_ids

    def add_request(self, req: NewRequest) -> None:
        self.scheduler.add(self.requests.admit(req))

    def abort_request(self, request_id: str) -> None:
        self.requests.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.requests.has_unfinished()

    def stats(self) -> EngineStats:
        free = (self.allocator.num_free, *(self.ranks.follower_free_blocks() if self.ranks else ()))
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=sum(s.num_uncached for s in self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_total=self.allocator.num_blocks, kv_blocks_free=min(free),
            kv_blocks_free_by_rank=free,
            tokens_generated=self.requests.tokens_generated, num_preemptions=self.scheduler.num_preemptions,
            **prefix_stats(self.allocator))

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.ranks is not None and not self.has_unfinished():
            # nothing left to carry the last frees to the other ranks
            self.ranks.sync(self.allocator)
        return outputs

    def _step(self) -> list[RequestOutput]:
        reqs = self.requests
        outputs: list[RequestOutput] = []
        for rid in list(reqs.aborted):
            seq = reqs.seqs.get(rid)
            if seq is not None:
                reqs.finish(seq, "abort")
                outputs.append(reqs.output(seq))
        if self.ahead is not None:
            return outputs + self._step_ahead()
        plan = self.scheduler.schedule()
        if not plan:
            return outputs
        chunks = plan.decodes + plan.prefills
        items = [reqs.item(c.seq, c.num_new_tokens) for c in chunks]
        try:
            results, logged = self.log.launch(lambda: self.session.run(items))
        except Exception:
            if not device_usable(self.session.device) or (self.ranks is not None and not self.ranks.alive()):
                raise
            return outputs + self._step_failed(chunks, traceback.format_exc())
        self.step_failures.succeeded()
        self.log.record(logged, len(plan.decodes), len(plan.prefills), sum(c.num_new_tokens for c in chunks),
                        len(self.scheduler.waiting), ahead=False)
        for i, (chunk, res) in enumerate(zip(chunks, results)):
            seq = chunk.seq
            seq.num_cached_tokens += chunk.num_new_tokens
            if i >= len(plan.decodes):
                self.allocator.register_prefix(seq.prompt_token_ids, seq.block_table, seq.num_cached_tokens)
            if res is not None:
                reqs.accept(seq, res)
            if res is not None or seq.status is SeqStatus.FINISHED:
                outputs.append(reqs.output(seq))
        return outputs

    def _step_ahead(self) -> list[RequestOutput]:
        """Launches the next step, then reports the one in flight before it."""
        reqs = self.requests
        plan = self.scheduler.schedule(reqs.ends_for_certain)
        if not plan:
            return self._report_ahead(self.ahead.take_pending())
        chunks = plan.decodes + plan.prefills
        try:
            step = self.ahead.launch(chunks, [reqs.item(c.seq, c.num_new_tokens) for c in chunks], len(plan.decodes))
        except Exception:
            if not device_usable(self.session.device):
                raise
            trace = traceback.format_exc()
            return self._report_ahead(self.ahead.take_pending()) + self._step_failed(chunks, trace)
        return self._report_ahead(step)

    def _report_ahead(self, step: StepAhead | None) -> list[RequestOutput]:
        """The outputs of the step that was in flight (none if none was)."""
        if step is None:
            return []
        reqs = self.requests
        try:
            kept = self.ahead.results(step)
        except Exception:
            if not device_usable(self.session.device):
                raise
            ran = [c for c, lineage in zip(step.chunks, step.lineages) if c.seq.lineage == lineage]
            return self._step_failed(ran, traceback.format_exc())
        self.step_failures.succeeded()
        self.log.record(step.logged, step.num_decodes, len(step.chunks) - step.num_decodes,
                        sum(c.num_new_tokens for c in step.chunks), len(self.scheduler.waiting), ahead=True)
        for seq, computed in step.prompt_chunks():
            self.allocator.register_prefix(seq.prompt_token_ids, seq.block_table, computed)
        outputs = []
        for chunk, res in kept:
            seq = chunk.seq
            if res is not None:
                reqs.accept(seq, res)
            if res is not None or seq.status is SeqStatus.FINISHED:
                outputs.append(reqs.output(seq))
        return outputs

    def _step_failed(self, chunks: list[ScheduledChunk], trace: str) -> list[RequestOutput]:
        """A step that raised with the device still sound ends the requests it carried, with
        the error; the others and later arrivals are served (step_failure.py)."""
        reason = last_line(trace)
        self.step_failures.failed(reason)
        report("hybrid", len(chunks), trace)
        return [self.requests.fail(c.seq, f"step failed in the engine: {reason}")
                for c in chunks if c.seq.status is not SeqStatus.FINISHED]

    def fail_all(self, message: str) -> list[RequestOutput]:
        return self.requests.fail_all(message)

    def close(self) -> None:
        # Drop the pool and weights now rather than at garbage collection, so a following
        # engine in the same process can size its pool from the freed memory.
        if self.ranks is not None:
            self.session.release_graphs()  # before the group (DecodeGraphs.release)
            self.ranks.close()
        self.log.close()
        device = self.state.kv_pool.device
        del self.session, self.state
        release_device_memory(device)
