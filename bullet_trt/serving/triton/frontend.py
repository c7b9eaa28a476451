"""Turns the input tensors of one Triton request into an engine request, or a clear error.

Tensor names follow the TensorRT-LLM backend (see docs/serving.md). Every check names the
input and the limit it broke, so a client can fix its request without reading our code.
This module reads the tensors' types and shapes; the values' ranges are checked where every
entry checks them, bullet_trt/engine/validation.py. It knows nothing about Triton itself: it reads a ``{name: numpy array}`` mapping,
which keeps it testable without a server.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.validation import (RequestError, RequestLimits, validate_params,
                                          validate_prompt)

# name -> (numpy dtype kinds accepted, Triton type name for messages)
_BOOL = ("b", "BOOL")
_INT = ("iu", "INT32")
_UINT64 = ("iu", "UINT64")
_FP = ("fiu", "FP32")
_BYTES = ("OSU", "BYTES")

INPUTS: dict[str, tuple[str, str]] = {
    "text_input": _BYTES,
    "max_tokens": _INT,
    "stream": _BOOL,
    "temperature": _FP,
    "top_p": _FP,
    "top_k": _INT,
    "seed": _UINT64,
    "random_seed": _UINT64,
    "stop_words": _BYTES,
    "bad_words": _BYTES,
    "end_id": _INT,
    "pad_id": _INT,
    "min_tokens": _INT,
    "min_length": _INT,
    "exclude_input_in_output": _BOOL,
    "return_num_input_tokens": _BOOL,
    "return_num_output_tokens": _BOOL,
    "return_log_probs": _BOOL,
    # Sent by Triton's OpenAI frontend when a client sets them; only the neutral value works.
    "frequency_penalty": _FP,
    "presence_penalty": _FP,
}
LIST_INPUTS = ("stop_words", "bad_words")
MAX_STOP_WORDS = 16


@dataclass
class FrontendLimits:
    request: RequestLimits  # the engine's limits, checked by engine/validation.py
    default_max_tokens: int = 64
    exclude_input_in_output: bool = True  # default when the request does not say


@dataclass
class ParsedRequest:
    text: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_log_probs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _shape(a: np.ndarray) -> str:
    return "[" + ",".join(str(d) for d in a.shape) + "]"


def _check_dtype(name: str, a: np.ndarray) -> None:
    kinds, tname = INPUTS[name]
    if a.dtype.kind not in kinds:
        raise RequestError(f"{name} must have datatype {tname}, got numpy dtype {a.dtype}")


def _scalar(name: str, a: np.ndarray):
    _check_dtype(name, a)
    if a.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {_shape(a)}")
    return a.reshape(-1)[0]


def _utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, np.bytes_):
        value = bytes(value)
    if not isinstance(value, (bytes, bytearray)):
        raise RequestError(f"{name} must be a UTF-8 string (BYTES), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8: byte 0x{value[e.start]:02x} at offset {e.start} "
                           f"({e.reason})") from None


def _int(name: str, a: np.ndarray) -> int:
    return int(_scalar(name, a))


def _float(name: str, a: np.ndarray) -> float:
    v = float(_scalar(name, a))
    if not math.isfinite(v):  # named here: past this point it is just a sampling value
        raise RequestError(f"{name} must be a finite number, got {v}")
    return v


def _bool(name: str, a: np.ndarray) -> bool:
    return bool(_scalar(name, a))


def _words(name: str, a: np.ndarray) -> list[str]:
    _check_dtype(name, a)
    words = [_utf8(f"{name}[{i}]", w) for i, w in enumerate(a.reshape(-1).tolist())]
    return [w for w in words if w]


class Frontend:
    """Parses and validates requests; `tokenizer` needs encode() and stop_sequences()."""

    def __init__(self, tokenizer, limits: FrontendLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def _check_prompt_bytes(self, text: str) -> None:
        """A prompt too long in bytes for any tokenization to fit is refused before it is
        tokenized: a megabyte takes the tokenizer about a second, during which this model
        starts no other request."""
        per_token = getattr(self.tokenizer, "max_token_bytes", None)
        if not per_token:
            return
        limit = self.limits.request.max_prompt_len
        n = len(text.encode("utf-8"))
        if n > limit * per_token:
            raise RequestError(f"text_input is too long: {n} bytes, more than the limit of {limit} tokens can "
                               f"hold (no token of this model is longer than {per_token} bytes)")

    def parse(self, inputs: Mapping[str, np.ndarray]) -> ParsedRequest:
        lim = self.limits
        unknown = sorted(set(inputs) - set(INPUTS))
        if unknown:
            raise RequestError(f"unknown input {unknown[0]!r}; known inputs: {', '.join(INPUTS)}")
        inputs = {k: np.asarray(v) for k, v in inputs.items()}
        if "text_input" not in inputs:
            raise RequestError("text_input is missing: send the prompt as a BYTES tensor named text_input")
        text = _utf8("text_input", _scalar("text_input", inputs["text_input"]))
        if not text:
            raise RequestError("text_input is empty: the prompt must hold at least one character")
        self._check_prompt_bytes(text)

        p = SamplingParams(max_tokens=_int("max_tokens", inputs["max_tokens"]) if "max_tokens" in inputs
                           else lim.default_max_tokens)
        sampling_given = any(k in inputs for k in ("temperature", "top_k", "top_p"))
        # Like the TensorRT-LLM backend: no sampling input at all means greedy decoding.
        p.temperature = _float("temperature", inputs["temperature"]) if "temperature" in inputs \
            else (1.0 if sampling_given else 0.0)
        if "top_p" in inputs:
            p.top_p = _float("top_p", inputs["top_p"])
        if "top_k" in inputs:
            p.top_k = _int("top_k", inputs["top_k"])
        for name in ("seed", "random_seed"):
            if name in inputs and p.seed is None:
                p.seed = _int(name, inputs[name])
        mins = [_int(n, inputs[n]) for n in ("min_tokens", "min_length") if n in inputs]
        p.min_tokens = min(mins) if any(m < 0 for m in mins) else max(mins, default=0)
        if "end_id" in inputs:
            p.end_id = _int("end_id", inputs["end_id"])
        if "pad_id" in inputs:
            _int("pad_id", inputs["pad_id"])  # accepted for compatibility; padding is never needed
        if "stop_words" in inputs:
            p.stop = _words("stop_words", inputs["stop_words"])
            if len(p.stop) > MAX_STOP_WORDS:
                raise RequestError(f"stop_words holds {len(p.stop)} words; the limit is {MAX_STOP_WORDS}")
            p.stop_token_ids = self.tokenizer.stop_sequences(p.stop) if p.stop else []
        if "bad_words" in inputs:
            bad = _words("bad_words", inputs["bad_words"])
            if bad:
                raise RequestError(f"bad_words is not supported by bullet_trt (got {len(bad)} word(s)); "
                                   "send it empty or leave it out")
        for name in ("frequency_penalty", "presence_penalty"):
            if name in inputs and _float(name, inputs[name]) != 0.0:
                raise RequestError(f"{name} is not supported by bullet_trt: it must be 0, "
                                   f"got {_float(name, inputs[name])}")
        flags = {n: _bool(n, inputs[n]) for n in
                 ("stream", "exclude_input_in_output", "return_num_input_tokens",
                  "return_num_output_tokens", "return_log_probs") if n in inputs}
        p.logprobs = flags.get("return_log_probs", False)
        validate_params(p, lim.request)
        ids = self.tokenizer.encode(text)
        validate_prompt(ids, lim.request, field="text_input")
        return ParsedRequest(
            text=text, prompt_token_ids=ids, params=p,
            stream=flags.get("stream", False),
            exclude_input_in_output=flags.get("exclude_input_in_output", lim.exclude_input_in_output),
            return_num_input_tokens=flags.get("return_num_input_tokens", False),
            return_num_output_tokens=flags.get("return_num_output_tokens", False),
            return_log_probs=p.logprobs,
        )
