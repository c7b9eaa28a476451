"""What an OpenAI request asks the Triton model for: its input tensors.

Values are checked here by bullet_trt/engine/validation.py, the check every entry shares, so
that a bad value is a 400 naming the OpenAI field (`max_completion_tokens`, `messages`)
instead of the Triton input it becomes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.validation import RequestError, validate_params, validate_prompt
from bullet_trt.serving.openai.errors import invalid
from bullet_trt.serving.openai.schemas import ChatCompletionRequest, CompletionRequest
from bullet_trt.serving.openai.served_model import ServedModel
from bullet_trt.serving.triton.frontend import MAX_STOP_WORDS

# OpenAI's own default for /v1/completions; chat completions run to the end of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class Generation:
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stop: list[str]
    inputs: dict[str, Any]  # Triton input name -> value
    renames: dict[str, str] = field(default_factory=dict)  # validation's names -> the client's


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n not in (None, 1):
        raise invalid(f"n must be 1: bullet_trt generates one choice per request, got {req.n}", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value not in (None, 0):
            raise invalid(f"{name} is not supported by bullet_trt: it must be 0, got {value}", name)
    if req.logprobs not in (None, False, 0):
        raise invalid("logprobs is not supported by this server", "logprobs")


def _stop_words(stop: str | list[str] | None) -> list[str]:
    words = [w for w in ([stop] if isinstance(stop, str) else list(stop or [])) if w]
    if len(words) > MAX_STOP_WORDS:
        raise invalid(f"stop holds {len(words)} strings; the limit is {MAX_STOP_WORDS}", "stop")
    return words


def _refuse_too_many_bytes(prompt: str, model: ServedModel, prompt_field: str) -> None:
    # Tokenizing holds the GIL, so this server's event loop, for about a second per megabyte;
    # a prompt with more bytes than the longest token times the token limit cannot fit anyway.
    per_token = getattr(model.tokenizer, "max_token_bytes", None)
    limit = model.limits.max_prompt_len
    n = len(prompt.encode("utf-8"))
    if per_token and n > limit * per_token:
        raise invalid(f"{prompt_field} is too long: {n} bytes, more than the limit of {limit} tokens can hold "
                      f"(no token of this model is longer than {per_token} bytes)", prompt_field)


def generation(req: CompletionRequest | ChatCompletionRequest, prompt: str, model: ServedModel,
               prompt_field: str) -> Generation:
    _refuse_unsupported(req)
    stop = _stop_words(req.stop)
    limits = model.limits
    max_field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    renames = {"max_tokens": max_field, "text_input": prompt_field, "prompt": prompt_field}
    if not prompt:  # it would still encode to a BOS token
        raise invalid(f"{prompt_field} is empty: it must hold at least one character", prompt_field)
    _refuse_too_many_bytes(prompt, model, prompt_field)
    ids = model.tokenizer.encode(prompt)
    try:
        validate_prompt(ids, limits, field=prompt_field)
        asked = getattr(req, max_field)
        if asked is not None:
            max_tokens = asked
        elif isinstance(req, CompletionRequest):
            max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, limits.max_tokens_limit)
        else:
            max_tokens = min(limits.max_model_len - len(ids), limits.max_tokens_limit)
        params = SamplingParams(max_tokens=max_tokens,
                                temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop,
                                top_k=req.top_k or 0, min_tokens=req.min_tokens or 0)
        validate_params(params, limits)
    except RequestError as e:
        raise invalid(str(e), renames=renames) from None
    # Triton always streams to this front end: the non-streaming answer is the joined pieces
    # (the model guarantees they join to its non-streaming text), and a stop string found in
    # the text can end the request early.
    inputs: dict[str, Any] = {"text_input": prompt, "max_tokens": params.max_tokens, "stream": True,
                              "temperature": params.temperature, "top_p": params.top_p,
                              "return_num_input_tokens": True, "return_num_output_tokens": True}
    if params.seed is not None:
        inputs["seed"] = params.seed
    if params.top_k:
        inputs["top_k"] = params.top_k
    if params.min_tokens:
        inputs["min_tokens"] = params.min_tokens
    if stop:
        inputs["stop_words"] = stop
    return Generation(prompt, len(ids), params.max_tokens, stop, inputs, renames)
