"""The one place where a request's parameters and prompt are checked against the engine's limits.

Every entry calls it: the Triton frontend (after reading the tensors' types), the CLI, the
offline `LLM` and the engine itself when a request is added. Each error names the field as
the caller knows it and the limit it broke, so a client can fix its request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bullet_trt.engine.kv_pool import blocks_for_tokens
from bullet_trt.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as sent; the message names the field and the limit."""


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # prompt + output tokens of one sequence
    vocab_size: int | None = None
    kv_blocks: int | None = None  # the pool's size; None: not known to the caller
    block_size: int = 16
    max_tokens_cap: int | None = None  # a server's own bound on max_tokens; None: the model's

    @property
    def max_prompt_len(self) -> int:
        return self.max_model_len - 1  # room for at least one generated token

    @property
    def max_tokens_limit(self) -> int:
        return self.max_tokens_cap or self.max_model_len - 1


def validate_params(p: SamplingParams, limits: RequestLimits | None = None) -> SamplingParams:
    lim = limits
    if p.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if lim is not None and p.max_tokens > lim.max_tokens_limit:
        why = "" if lim.max_tokens_cap else f" (max_model_len {lim.max_model_len} minus one prompt token)"
        raise RequestError(f"max_tokens must be <= {lim.max_tokens_limit}{why}, got {p.max_tokens}")
    if p.min_tokens < 0:
        raise RequestError(f"min_tokens must be >= 0, got {p.min_tokens}")
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(p, name)):
            raise RequestError(f"{name} must be a finite number, got {getattr(p, name)}")
    if p.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {p.top_k}")
    if p.seed is not None and not 0 <= p.seed < 2 ** 64:
        raise RequestError(f"seed must be in [0, 2^64), got {p.seed}")
    if p.end_id is not None:
        hi = lim.vocab_size - 1 if lim is not None and lim.vocab_size else None
        if p.end_id < 0 or (hi is not None and p.end_id > hi):
            raise RequestError(f"end_id must be >= 0" + (f" and <= {hi} (the vocabulary size minus one)"
                                                        if hi is not None else "") + f", got {p.end_id}")
    return p


def validate_prompt(token_ids: list[int], limits: RequestLimits, field: str = "prompt") -> None:
    n = len(token_ids)
    if n == 0:
        raise RequestError(f"{field} is empty: it must encode to at least one token")
    if n > limits.max_prompt_len:
        raise RequestError(f"{field} is too long: {n} tokens, the limit is {limits.max_prompt_len} tokens "
                           f"(max_model_len {limits.max_model_len} minus one generated token)")
    if limits.vocab_size:
        bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise RequestError(f"{field} token id {bad} is outside the vocabulary [0, {limits.vocab_size})")


def validate_request(token_ids: list[int], p: SamplingParams, limits: RequestLimits,
                     field: str = "prompt") -> None:
    """Parameters, prompt, and whether the whole sequence can ever fit the KV pool."""
    validate_params(p, limits)
    validate_prompt(token_ids, limits, field)
    if limits.kv_blocks is not None:
        need = blocks_for_tokens(min(len(token_ids) + p.max_tokens, limits.max_model_len), limits.block_size)
        if need > limits.kv_blocks:
            raise RequestError(f"KV pool too small for this request: it needs {need} blocks of "
                               f"{limits.block_size} tokens, the pool has {limits.kv_blocks}")
