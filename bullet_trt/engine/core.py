"""EngineCore: requests in, per-step token outputs out, over one shared pool.

It owns the sequences, the block allocator and the batch scheduler, and hands each step's
work to an executor (one in-process session, or prefill and decode worker processes).
Stopping rules (end id, stop sequences, min/max tokens, the model's length) live here so
every executor and every mode ends requests the same way.
"""
from __future__ import annotations

import dataclasses
import time
import traceback

from bullet_trt.config import EngineConfig
from bullet_trt.engine.batch_scheduler import BatchScheduler, ScheduledChunk
from bullet_trt.engine.block_allocator import BlockAllocator
from bullet_trt.engine.executor import Executor, LocalExecutor, WorkerExecutor
from bullet_trt.engine.kv_pool import blocks_for_tokens
from bullet_trt.engine.request import EngineStats, NewRequest, RequestOutput
from bullet_trt.engine.sequence import SeqStatus, Sequence
from bullet_trt.engine.session import BatchItem, SampleResult, TorchSession
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.engine.step_failure import FailureStreak, last_line, report


class EngineCore:
    """Continuous batching engine.

    executor: "local" runs prefill and decode as hybrid batches in this process (with
    ``token_budget`` = serve.chunk_size this is chunked prefill); "workers" runs the prefill
    session and the decode session in two processes that share the weights and the pool.
    """

    def __init__(self, cfg: EngineConfig, executor: str = "local", token_budget: int | None = None):
        self.cfg = cfg
        self.state, model = build_shared_state(cfg, share=(executor != "local"))
        self.eos_token_ids = list(self.state.arch.eos_token_ids)
        self.max_model_len = cfg.max_model_len
        self.allocator = BlockAllocator(self.state.num_blocks)
        if token_budget is None:
            token_budget = cfg.serve.chunk_size if cfg.serve.mode == "chunked" else cfg.prefill.max_num_batched_tokens
        max_seqs = cfg.decode.max_num_seqs
        self.scheduler = BatchScheduler(self.allocator, self.state.block_size, max_seqs, token_budget)
        if executor == "local":
            # One session runs both phases: decode-only steps replay the decode profile's graphs.
            profile = dataclasses.replace(cfg.prefill, cuda_graph_batch_sizes=cfg.decode.cuda_graph_batch_sizes,
                                          max_num_seqs=max(cfg.prefill.max_num_seqs, max_seqs))
            session = TorchSession(model, self.state.kv_pool, self.state.block_size, profile)
            session.warm_up()
            session.capture_graphs()
            self.executor: Executor = LocalExecutor(session)
        elif executor == "none":  # a subclass drives its own workers
            del model
        elif executor == "workers":
            del model
            self.executor = WorkerExecutor(self.state, cfg.prefill, cfg.decode)
        else:
            raise ValueError(f"executor must be local, workers or none, got {executor!r}")
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        self.tokens_generated = 0
        self.step_failures = FailureStreak("engine")

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, req: NewRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: text_input must encode to at least one token")
        if n > self.cfg.max_prompt_len:
            raise ValueError(f"prompt has {n} tokens; the limit is {self.cfg.max_prompt_len} "
                             f"(max_model_len {self.max_model_len} minus one generated token)")
        req.params.validate()
        if req.request_id in self.seqs:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        vocab = self.state.arch.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        need = blocks_for_tokens(min(n + req.params.max_tokens, self.max_model_len), self.state.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(f"KV pool too small for this request: it needs {need} blocks of "
                             f"{self.state.block_size} tokens, the pool has {self.allocator.num_blocks}")
        req.params.resolved_seed()
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params)
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        if request_id in self.seqs:
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            kv_blocks_total=self.allocator.num_blocks, kv_blocks_free=self.allocator.num_free,
            tokens_generated=self.tokens_generated, num_preemptions=self.scheduler.num_preemptions)

    # -- stepping ---------------------------------------------------------------------------
    def _item(self, chunk: ScheduledChunk) -> BatchItem:
        seq = chunk.seq
        start = seq.num_cached_tokens
        tokens = seq.token_ids(start, chunk.num_new_tokens)
        sample = chunk.completes_prompt
        banned: list[int] = []
        p = seq.params
        if sample and len(seq.output_token_ids) < p.min_tokens:
            banned = self._end_ids(seq)
        return BatchItem(seq.request_id, tokens, start, list(seq.block_table), p, sample,
                         output_index=len(seq.output_token_ids), banned_token_ids=banned)

    def _end_ids(self, seq: Sequence) -> list[int]:
        if seq.params.ignore_eos:
            return []
        return [seq.params.end_id] if seq.params.end_id is not None else self.eos_token_ids

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.release(seq)

    def _accept(self, seq: Sequence, result: SampleResult) -> None:
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        token = result.token_id
        n_out = len(seq.output_token_ids)
        if token in self._end_ids(seq) and n_out >= p.min_tokens:
            self._finish(seq, "stop")
            return
        seq.output_token_ids.append(token)
        if result.logprob is not None:
            seq.output_logprobs.append(result.logprob)
        self.tokens_generated += 1
        n_out += 1
        if n_out >= p.min_tokens and any(
                s and seq.output_token_ids[-len(s):] == s for s in p.stop_token_ids):
            self._finish(seq, "stop")
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_emitted:]
        lps = seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs else None
        seq.num_emitted = len(seq.output_token_ids)
        done = seq.status is SeqStatus.FINISHED
        return RequestOutput(seq.request_id, new, lps, done, seq.finish_reason if done else None,
                             seq.num_prompt_tokens, len(seq.output_token_ids))

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid in self._aborted:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._finish(seq, "abort")
                outputs.append(self._output(seq))
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if not plan:
            return outputs
        pre_items = [self._item(c) for c in plan.prefills]
        dec_items = [self._item(c) for c in plan.decodes]
        try:
            pre_res, dec_res = self.executor.run(pre_items, dec_items)
        except Exception:
            if not self.executor.recoverable():
                raise
            return outputs + self._step_failed(plan.prefills + plan.decodes, traceback.format_exc())
        self.step_failures.succeeded()
        for chunk, res in list(zip(plan.prefills, pre_res)) + list(zip(plan.decodes, dec_res)):
            seq = chunk.seq
            seq.num_cached_tokens += chunk.num_new_tokens
            if res is not None:
                self._accept(seq, res)
            if res is not None or seq.status is SeqStatus.FINISHED:
                outputs.append(self._output(seq))
                if seq.status is SeqStatus.FINISHED:
                    self.seqs.pop(seq.request_id, None)
        return outputs

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Ends one request with an error, freeing its blocks; returns its final output."""
        self.seqs.pop(seq.request_id, None)
        self._finish(seq, "error")
        out = self._output(seq)
        out.error = message
        return out

    def _step_failed(self, chunks: list[ScheduledChunk], trace: str) -> list[RequestOutput]:
        """A step that raised with the device still sound ends the requests it carried, with
        the error; the others and later arrivals are served (step_failure.py)."""
        reason = last_line(trace)
        self.step_failures.failed(reason)
        report("hybrid", len(chunks), trace)
        return [self._fail(c.seq, f"step failed in the engine: {reason}")
                for c in chunks if c.seq.status is not SeqStatus.FINISHED]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every request with an error (used when an executor dies)."""
        return [self._fail(seq, message) for seq in list(self.seqs.values())]

    def close(self) -> None:
        if hasattr(self, "executor"):
            self.executor.close()
        # Drop the pool and weights now rather than at garbage collection, so a following
        # engine in the same process can size its pool from the freed memory.
        device = self.state.kv_pool.device
        del self.executor, self.state
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()


def create_engine(cfg: EngineConfig) -> EngineCore:
    """The engine for cfg.serve.mode: `chunked` hybrid batches in one session, or `bullet` /
    `static` spatial sharing between a prefill and a decode worker."""
    if cfg.serve.mode == "chunked":
        return EngineCore(cfg, executor="local", token_budget=cfg.serve.chunk_size)
    from bullet_trt.spatial.orchestrator import SpatialEngineCore
    return SpatialEngineCore(cfg)
