"""A request's life from admission to its final output, whatever schedules its steps.

Both engines compose one: the chunked `EngineCore` and the Bullet orchestrator
(bullet_trt/spatial). It owns the sequences in flight, the stopping rules (end id, stop
sequences, min/max tokens, the model's length), the outputs and the ways a request ends
(finish, abort, error), so every mode ends requests the same way. Where a finished request's
KV blocks go back is the scheduler's business: `release` is called with the sequence.
"""
from __future__ import annotations

import time
from typing import Callable

from bullet_trt.engine.request import NewRequest, RequestOutput
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.sequence import SeqStatus, Sequence
from bullet_trt.engine.session import BatchItem, SampleResult
from bullet_trt.engine.validation import RequestLimits, validate_request


class RequestLifecycle:
    def __init__(self, limits: RequestLimits, eos_token_ids: list[int],
                 release: Callable[[Sequence], None]):
        self.limits = limits
        self.eos_token_ids = list(eos_token_ids)
        self.release = release
        self.seqs: dict[str, Sequence] = {}
        self.aborted: list[str] = []
        self.tokens_generated = 0

    def admit(self, req: NewRequest) -> Sequence:
        """A new sequence for the request; RequestError (a ValueError) naming the field and
        the limit when it cannot be served."""
        if req.request_id in self.seqs:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        validate_request(req.prompt_token_ids, req.params, self.limits)
        req.params.resolved_seed()
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params)
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        if request_id in self.seqs:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- a step's work and its results ------------------------------------------------------
    def item(self, seq: Sequence, num_new_tokens: int) -> BatchItem:
        """The next `num_new_tokens` of the sequence as one row of a batch."""
        start = seq.num_cached_tokens
        sample = start + num_new_tokens == seq.num_tokens
        p = seq.params
        n_out = seq.num_outputs
        banned = self._end_ids(p) if sample and n_out < p.min_tokens else []
        return BatchItem(seq.request_id, seq.token_ids(start, num_new_tokens), start, list(seq.block_table),
                         p, sample, output_index=n_out, banned_token_ids=banned)

    def ends_for_certain(self, seq: Sequence) -> bool:
        """Whether the tokens in flight take the sequence to its length limits, so that no
        further step may run it (its position would pass the model's length)."""
        return bool(seq.num_pending) and (seq.num_outputs >= seq.params.max_tokens
                                          or seq.num_tokens >= self.limits.max_model_len)

    def _end_ids(self, p: SamplingParams) -> list[int]:
        if p.ignore_eos:
            return []
        return [p.end_id] if p.end_id is not None else self.eos_token_ids

    def accept(self, seq: Sequence, result: SampleResult) -> None:
        """Takes a sampled token, or ends the sequence by the stopping rules. A token that was
        in flight (`Sequence.num_pending`) must have left that count first."""
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        token = result.token_id
        n_out = len(seq.output_token_ids)
        if token in self._end_ids(p) and n_out >= p.min_tokens:
            self.finish(seq, "stop")
            return
        seq.output_token_ids.append(token)
        if result.logprob is not None:
            seq.output_logprobs.append(result.logprob)
        self.tokens_generated += 1
        n_out += 1
        if n_out >= p.min_tokens and any(s and seq.output_token_ids[-len(s):] == s for s in p.stop_token_ids):
            self.finish(seq, "stop")
        elif n_out >= p.max_tokens or seq.num_known_tokens >= self.limits.max_model_len:
            self.finish(seq, "length")

    def output(self, seq: Sequence) -> RequestOutput:
        """What the caller has not seen yet; a finished sequence leaves the engine here."""
        new = seq.output_token_ids[seq.num_emitted:]
        lps = seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs else None
        seq.num_emitted = len(seq.output_token_ids)
        done = seq.status is SeqStatus.FINISHED
        if done:
            self.seqs.pop(seq.request_id, None)
            if seq.request_id in self.aborted:
                self.aborted.remove(seq.request_id)
        return RequestOutput(seq.request_id, new, lps, done, seq.finish_reason if done else None,
                             seq.num_prompt_tokens, len(seq.output_token_ids))

    # -- endings ----------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.release(seq)

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Ends one request with an error, freeing its blocks; returns its final output."""
        self.finish(seq, "error")
        out = self.output(seq)
        out.error = message
        return out

    def fail_all(self, message: str) -> list[RequestOutput]:
        return [self.fail(seq, message) for seq in list(self.seqs.values())]
