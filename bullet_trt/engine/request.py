"""What goes into the engine and what comes out of it, per request."""
from __future__ import annotations

from dataclasses import dataclass, field

from bullet_trt.engine.sampling import SamplingParams


@dataclass
class RequestOutput:
    """The tokens one step added to a request; `finished` is set on the last one.

    finish_reason: "stop" (end id or stop sequence), "length" (max_tokens or the model's
    length limit), "abort" (cancelled), "error" (see `error`).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """One output carrying this one's tokens and then ``later``'s (same request)."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return RequestOutput(self.request_id, self.new_token_ids + later.new_token_ids, logprobs,
                             later.finished, later.finish_reason, later.num_prompt_tokens,
                             later.num_output_tokens, later.error)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merges the outputs of each request into one, in order of first appearance."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        prev = merged.get(out.request_id)
        merged[out.request_id] = out if prev is None else prev.followed_by(out)
    return list(merged.values())


@dataclass
class EngineStats:
    num_waiting: int = 0
    num_waiting_tokens: int = 0  # tokens the waiting requests need prefilled (preempted ones: again)
    num_running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # under tensor parallelism: the fewest of any rank's pool
    kv_blocks_free_by_rank: tuple[int, ...] = ()  # each rank's, rank 0 first (one entry without tensor parallelism)
    tokens_generated: int = 0  # since start
    num_preemptions: int = 0
    # kv.prefix_caching: blocks kept for later prompts (counted in kv_blocks_free too: any
    # allocation may take them back), and the prompt tokens found cached / looked up since start
    kv_blocks_cached: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_prompt_tokens: int = 0
    prefill_sms: int = 0  # SMs of the last prefill / decode iteration (spatial modes)
    decode_sms: int = 0
    # bullet: decode's step beside a prefill is planned for this fraction of the TPOT SLO
    # (serve.tpot_plan_fraction, moved by serve.tpot_plan_auto); 0 in the other modes
    tpot_plan: float = 0.0
    # the spatial modes: the performance model's online correction per phase, measured step
    # time over its calibration's prediction (1: the calibration describes the steps run; a stale
    # one drifts from it); 0 in the other modes
    perf_correction_prefill: float = 0.0
    perf_correction_decode: float = 0.0


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
