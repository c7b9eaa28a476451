"""A step whose sampled tokens have not reached the host yet, and the device-side feed of those
tokens into the step after it.

A graphed decode step leaves the GPU idle while the host reads its tokens, hands them on and
prepares the next step: 1.8-2.5 ms a step at 512+ rows on an H200, 5-6.5% of decode's time
(iteration logs of 2026-11-26 and -27). Nothing of the next step but its input tokens depends on
those tokens (positions, blocks and sampling state move on by one), so the next step can be
launched first, taking those inputs from the last step's output on the device (`TokenFeed`),
and the host reads the last step's tokens while the GPU runs the next one.

The tokens leave the device through a pinned buffer by a copy queued right behind the step's
sampling, with an event after it: reading them waits for that event only, not for the step
queued after. Two buffers alternate (`Readback`), since a step's tokens are read while the next
step's copy is queued; a third step is launched only after the first one's tokens were read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bullet_trt.kernels.host_to_device import device_tensor


@dataclass(slots=True)  # a decode step makes one per row
class SampleResult:
    token_id: int
    logprob: float | None = None


@dataclass
class TokenFeed:
    """Input tokens taken on the device from an earlier step's sampled tokens: the step's item
    `rows[i]` feeds `source[src[i]]` instead of its host-side input token."""
    source: torch.Tensor  # int64 (B_prev,), on the session's device
    rows: list[int]
    src: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        """Overwrites those rows of a step's (one token per row) input ids, in the stream order
        of the current stream."""
        if not self.rows:
            return
        # through pinned memory: queued behind the step in flight instead of waiting for it
        rows = device_tensor(self.rows, torch.long, input_ids.device)
        src = device_tensor(self.src, torch.long, input_ids.device)
        input_ids.index_copy_(0, rows, self.source.index_select(0, src))


class Readback:
    """A pinned host buffer that a step's tokens and log-probabilities are copied into behind
    the step, and the event that says they arrived."""

    def __init__(self, rows: int):
        self.tokens = torch.empty(rows, dtype=torch.long).pin_memory()
        self.logprobs = torch.empty(rows, dtype=torch.float32).pin_memory()
        self.arrived = torch.cuda.Event()

    def queue(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queues the copies on the current stream; returns the host views they land in."""
        n = tokens.shape[0]
        if n > self.tokens.shape[0]:  # a step larger than any graph (eager): a buffer that fits
            self.tokens = torch.empty(n, dtype=torch.long).pin_memory()
            self.logprobs = torch.empty(n, dtype=torch.float32).pin_memory()
        host_tokens = self.tokens[:n]
        host_tokens.copy_(tokens, non_blocking=True)
        host_lps = None
        if logprobs is not None:
            host_lps = self.logprobs[:n]
            host_lps.copy_(logprobs, non_blocking=True)
        self.arrived.record()
        return host_tokens, host_lps


class StepInFlight:
    """A launched step: its sampled tokens on the device (`tokens`, for the next step's feed)
    and, once `results()` is called, on the host as one SampleResult (or None) per item."""

    def __init__(self, num_items: int, rows: list[int], want_logprobs: list[bool], tokens: torch.Tensor | None,
                 logprobs: torch.Tensor | None, readback: Readback | None = None):
        self.num_items = num_items
        self.rows = rows  # the items that sampled, in the order of `tokens`
        self.want_logprobs = want_logprobs
        self.tokens = tokens
        self._logprobs = logprobs
        self._readback = readback
        self._host = None
        if readback is not None and tokens is not None:
            self._host = readback.queue(tokens, logprobs)

    def results(self) -> list[SampleResult | None]:
        out: list[SampleResult | None] = [None] * self.num_items
        if not self.rows:
            return out
        if self._host is not None:
            self._readback.arrived.synchronize()
            tokens, lps = self._host
        else:
            tokens, lps = self.tokens, self._logprobs
        tokens = tokens.tolist()
        lps = lps.tolist() if lps is not None else [None] * len(tokens)
        for row, tok, lp, want in zip(self.rows, tokens, lps, self.want_logprobs):
            out[row] = SampleResult(tok, lp if want else None)
        return out
