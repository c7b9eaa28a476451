"""The decode worker's steps launched one ahead (`decode.overlap_steps`): step N+1 is queued on
the GPU, its input tokens fed on the device from step N's (engine/step_in_flight.py), before the
host reads step N's tokens, reports them and takes the orchestrator's updates. The host's part
of a step then runs while the GPU runs the next one, where before the GPU waited for it.

What this changes for the rest of the worker's loop:
- A row that ended at step N (an end token, a stop sequence the orchestrator sees) has stepped
  once more by then; the orchestrator drops a token of a row that left, as it does for the
  steps a row runs ahead while its leave is on its way.
- A leave is acknowledged only with the report of a step that ended after the leave was taken
  in: then no step in flight holds the row, whose blocks may go to another sequence.
- Fused prompts and a worker's last rows drain the step in flight first. A new split does not:
  the next step is launched on the new split's stream behind a wait for the step in flight's
  end event, and the split's epoch is published once that step is reported, when nothing of
  this worker runs on the old split any more (`move_to`).
- A step's time is taken by CUDA events around it (the host's clock would count the wait for
  the step before), and its window by one of two GPU clocks, one per step in flight.
- What the orchestrator sends while a step runs reaches the step after next, not the next: a
  row that joins waits a step longer, and a new split applies up to two steps after it was
  sent instead of one, so a prefill that starts at once on its partition may share SMs with a
  decode step on the whole GPU for that much longer (`bench overlap` measures it from the
  iteration log; `serve.prefill_waits_for_split` makes the prefill wait for the new split).

With `decode.overlap_launch_late` the next step is launched not right after the one before
but shortly before the step in flight is due to end (`launch_due`: its expected time, the last
step's on the GPU, less a margin and the launches' host time), and the worker takes what the
orchestrator sends until then: a new split or a joining row then reaches the next step, as in
the plain loop, instead of the one after. What it risks is a gap, when a step ends sooner than
the last one took (`bench decode-overlap --launch-late` counts the gaps).

Nothing in a launch may wait for the device, or the launch returns only once its step has run
and nothing is left to overlap: the banned-token mask did, and this loop lost at load until it
filled on the device (engine/sampling._ban; `bench decode-overlap` times both loops and lists
the host's calls). Rows with top-p did too until a kernel redrew the nuclei that outgrow their
candidates on the device (kernels/triton_sample.nucleus_tail_draw); with the torch reference
(CPU) they still read on the host which rows to sort whole.
"""
from __future__ import annotations

import collections
import contextlib
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from bullet_trt.engine.session import BatchItem
from bullet_trt.engine.step_in_flight import StepInFlight, TokenFeed
from bullet_trt.protocol import DecodeStep, RowsLeft, SmSplit
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
from bullet_trt.spatial.decode_step_failure import fail_decode_step


@dataclass
class LaunchedStep:
    ran: list[tuple[int, BatchItem]]
    flight: StepInFlight
    split: SmSplit
    start: float  # time.monotonic() at launch
    total_ctx: int
    rows_without_block: int
    began: torch.cuda.Event | None
    ended: torch.cuda.Event | None
    host_ms: float  # the launch's own host time (the step's time where there are no events)
    clock: object | None  # the GpuStepClock that stamped it

    def index_of(self) -> dict[int, int]:
        return {row_id: i for i, (row_id, _) in enumerate(self.ran)}


# A late launch aims at this share of the step in flight's expected time, less the launches'
# host time: steps of one batch size vary by a few percent, and a step that ends before its
# successor is queued leaves the GPU idle.
LATE_LAUNCH_SHARE = 0.8
LATE_LAUNCH_MARGIN_MS = 1.0


class OverlappedDecode:
    def __init__(self, session, device, part, role: str, set_num_sms, batch: PersistentDecodeBatch, outbox,
                 clocks: list | None, memory=None, publish_epoch: Callable[[int], None] | None = None,
                 launch_late: bool = False):
        self.session, self.device, self.part, self.role = session, device, part, role
        self.set_num_sms, self.batch, self.outbox, self.memory = set_num_sms, batch, outbox, memory
        self.clocks = clocks or []  # two GPU clocks, or none
        self.pending: LaunchedStep | None = None
        self.publish_epoch = publish_epoch  # tells the prefill worker which split decode runs at
        self._epoch_after_report = 0  # a new split's epoch, due once the step on the old one is reported
        self.launch_late = launch_late
        self._launch_ms = collections.deque(maxlen=16)  # the last launches' host time
        # the last reported step: when the host saw it end (the step in flight ran from then
        # at the latest), its time on the GPU and its split
        self._reported: tuple[float, float, SmSplit] | None = None

    def step(self, ran: list[tuple[int, BatchItem]], left: list[int]) -> list[int]:
        """Launches a step over `ran`, then reports the step before it (with the leaves in
        `left`); returns the leaves not yet acknowledged."""
        try:
            launched = self._launch(ran)
        except Exception:
            trace = traceback.format_exc()
            return self._failed(ran, trace, self.drain(left))
        previous, self.pending = self.pending, launched
        self._launch_ms.append(launched.host_ms)
        self.batch.move_on(ran)
        if previous is not None:
            return self._report(previous, left)
        if left:  # no step in flight holds them: the new one left them out
            self.outbox.put(RowsLeft(left))
        return []

    def move_to(self, split: SmSplit, epoch: int) -> None:
        """The turn's updates leave the batch on `split`, numbered `epoch`: publishes the epoch
        now if no step in flight runs on another split, else once that step is reported, which
        the next `step` or `drain` does; the next step is launched on the new split meanwhile,
        queued behind the one in flight on the GPU (`_launch`), so the GPU does not wait for
        the host at a change of split.

        The split compared is the one the turn's updates leave, not each update's: a prefill
        that ends and the next that starts at once on the same partition send decode to the
        whole GPU and back within one turn. Until the thirteenth round of 2026-11-27 each
        change drained the step in flight first, and those drains were nearly every wait left
        between overlapped steps (iteration logs: 1098 steps of ~5900 on one H200, 412 of them
        the to-and-back kind)."""
        if self.pending is None or self.pending.split == split:
            self._publish(epoch)
        else:
            self._epoch_after_report = epoch

    def launch_due(self) -> float | None:
        """With `launch_late`: the time (time.monotonic()) to launch the next step at, so that
        it is queued shortly before the step in flight ends; None: at once (no step in flight or
        none reported yet, or a step in flight on another split than the last one reported,
        whose time says nothing of it)."""
        if not self.launch_late or self.pending is None or self._reported is None:
            return None
        seen_end, window_ms, split = self._reported
        if split != self.pending.split:
            return None
        lead_ms = max(self._launch_ms, default=0.0) + LATE_LAUNCH_MARGIN_MS
        return seen_end + (window_ms * LATE_LAUNCH_SHARE - lead_ms) / 1e3

    def _publish(self, epoch: int) -> None:
        if epoch and self.publish_epoch is not None:
            self.publish_epoch(epoch)

    def drain(self, left: list[int]) -> list[int]:
        """Reports the step in flight, if any, with the leaves in `left`."""
        if self.pending is None:
            return left
        previous, self.pending = self.pending, None
        return self._report(previous, left)

    def _launch(self, ran: list[tuple[int, BatchItem]]) -> LaunchedStep:
        split = self.batch.split
        stream = self.part.stream(split.prefill)
        if self.set_num_sms is not None:
            self.set_num_sms(split.sms_of(self.role))
        rows = [item for _, item in ran]
        feed = None
        if self.pending is not None:
            index = self.pending.index_of()
            fed = [(i, index[row_id]) for i, (row_id, _) in enumerate(ran) if row_id in index]
            feed = TokenFeed(self.pending.flight.tokens, [i for i, _ in fed], [j for _, j in fed])
        clock = None
        if self.clocks:
            clock = self.clocks[0]
            self.clocks.reverse()
        cuda = self.device.type == "cuda"
        began = torch.cuda.Event(enable_timing=True) if cuda else None
        ended = torch.cuda.Event(enable_timing=True) if cuda else None
        start = time.monotonic()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            before = self.pending
            if stream is not None and before is not None and before.ended is not None and before.split != split:
                # A new split's stream: everything of this step, its staged inputs in the graphs'
                # shared buffers and its feed, comes after the step in flight on the old stream.
                stream.wait_event(before.ended)
                if feed is not None:  # read here, freed with its step: kept from the old stream's reuse
                    feed.source.record_stream(stream)
            # the events outside the stamps: the step's time holds its window
            if began is not None:
                began.record()
            if clock is not None:
                clock.begin()
            flight = self.session.launch(rows, feed)
            if clock is not None:
                clock.finish()
            if ended is not None:
                ended.record()
        return LaunchedStep(ran, flight, split, start, sum(it.start_pos + 1 for it in rows),
                            self.batch.waiting_for_block, began, ended, (time.monotonic() - start) * 1e3, clock)

    def _report(self, step: LaunchedStep, left: list[int]) -> list[int]:
        try:
            return self._report_tokens(step, left)
        finally:
            # the step in flight was the last on the old split: it has ended (or failed)
            epoch, self._epoch_after_report = self._epoch_after_report, 0
            self._publish(epoch)

    def _report_tokens(self, step: LaunchedStep, left: list[int]) -> list[int]:
        try:
            if step.ended is not None:
                step.ended.synchronize()
            results = step.flight.results()
        except Exception:
            return self._failed(step.ran, traceback.format_exc(), left)
        measured_ms = step.began.elapsed_time(step.ended) if step.began is not None else step.host_ms
        self._reported = (time.monotonic(), measured_ms, step.split)
        tokens = [r.token_id for r in results]
        self.outbox.put(DecodeStep(
            row_ids=[row_id for row_id, _ in step.ran], token_ids=tokens, logprobs=[r.logprob for r in results],
            left=left, split=step.split, total_ctx=step.total_ctx, start=step.start, measured_ms=measured_ms,
            idle_ms=None, prompt_results=None, prompt_tokens=0,
            gpu_window_ns=step.clock.window_ns() if step.clock is not None else None,
            rows_without_block=step.rows_without_block, launch_ms=step.host_ms))
        # rows still in the batch take their token as the next input on the host, for a step
        # that is not fed from this one (after a drain); a step already fed from it has it
        self.batch.feed(step.ran, tokens)
        if self.memory is not None:
            self.memory.after_step([item for _, item in step.ran])
        return []

    def _failed(self, ran: list[tuple[int, BatchItem]], trace: str, left: list[int]) -> list[int]:
        fail_decode_step(self.device, self.role, self.batch, self.outbox, ran, trace, left)
        return []
