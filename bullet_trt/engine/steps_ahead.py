"""Chunked steps launched one ahead (`decode.overlap_steps` in chunked mode): step N+1 is
scheduled and queued on the GPU before the host reads step N's tokens, as SGLang's overlapped
scheduler does, so that the host's part of a step (scheduling, building the batch, reading and
handing on the tokens) runs while the GPU runs the next one.

What step N+1 needs of step N's tokens is only its decode rows' input tokens: those are taken
from step N's sampled tokens on the device (`TokenFeed`). Everything else is known on the host
when N is launched: the sequences advance by the tokens N writes, and each token N samples
counts as in flight (`Sequence.num_pending`) until it is read. What stays unknown is whether a
sampled token ends its sequence (an end id or a stop sequence): such a sequence is run once more
by N+1 and that result dropped (`Sequence.lineage`). Lengths are known, so a sequence that its
tokens in flight take to `max_tokens` or the model's length sits the next step out.

The engine runs every step on one stream, so blocks that a sequence gives back while a step in
flight still writes them go only to steps launched later, which the GPU runs after it.
"""
from __future__ import annotations

from dataclasses import dataclass

from bullet_trt.engine.batch_scheduler import ScheduledChunk
from bullet_trt.engine.session import BatchItem, SampleResult
from bullet_trt.engine.step_in_flight import StepInFlight, TokenFeed
from bullet_trt.engine.step_log import LoggedStep, StepLog


@dataclass
class StepAhead:
    chunks: list[ScheduledChunk]
    lineages: list[int]  # each chunk's sequence's lineage at launch
    flight: StepInFlight
    num_decodes: int  # the first chunks, one token each
    logged: LoggedStep | None
    computed: list[int]  # each chunk's sequence's tokens in the pool once the step has run

    def prompt_chunks(self):
        """(sequence, tokens computed) of the step's prompt chunks whose sequences it still
        runs: what kv.prefix_caching may keep once the step has succeeded."""
        n = self.num_decodes
        for chunk, lineage, computed in zip(self.chunks[n:], self.lineages[n:], self.computed[n:]):
            if chunk.seq.lineage == lineage:
                yield chunk.seq, computed

    def token_index(self) -> dict[str, int]:
        """Request id -> index of the token its chunk sampled in `flight.tokens`."""
        return {self.chunks[row].seq.request_id: k for k, row in enumerate(self.flight.rows)}


class StepsAhead:
    def __init__(self, session, log: StepLog):
        self.session, self.log = session, log
        self.pending: StepAhead | None = None

    def launch(self, chunks: list[ScheduledChunk], items: list[BatchItem], num_decodes: int) -> StepAhead | None:
        """Queues a step over `chunks` (their batch rows `items`, decodes first), fed on the
        device from the step in flight; returns the step that was in flight, for `results`."""
        feed = None
        if self.pending is not None:
            index = self.pending.token_index()
            fed = [(i, index[c.seq.request_id]) for i, c in enumerate(chunks)
                   if c.seq.num_pending and c.seq.request_id in index]
            feed = TokenFeed(self.pending.flight.tokens, [i for i, _ in fed], [k for _, k in fed])
        flight, logged = self.log.launch(lambda: self.session.launch(items, feed))
        for chunk, item in zip(chunks, items):
            seq = chunk.seq
            seq.num_cached_tokens += chunk.num_new_tokens
            if item.sample:
                seq.num_pending += 1
        previous = self.pending
        self.pending = StepAhead(chunks, [c.seq.lineage for c in chunks], flight, num_decodes, logged,
                                 [c.seq.num_cached_tokens for c in chunks])
        return previous

    def take_pending(self) -> StepAhead | None:
        previous, self.pending = self.pending, None
        return previous

    @staticmethod
    def results(step: StepAhead) -> list[tuple[ScheduledChunk, SampleResult | None]]:
        """The step's chunks whose sequences are still the ones it ran, each with its result
        (None for a chunk that did not sample); each sampled token leaves the in-flight count.
        Waits for the step's tokens."""
        results = step.flight.results()
        kept = []
        for chunk, lineage, res in zip(step.chunks, step.lineages, results):
            seq = chunk.seq
            if seq.lineage != lineage:  # ended or preempted since: its tokens went with its blocks
                continue
            if res is not None:
                seq.num_pending -= 1
            kept.append((chunk, res))
        return kept
