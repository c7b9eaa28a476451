"""The request bodies of /v1/completions and /v1/chat/completions, as pydantic models.

Types are checked here (a wrong type is a 400 naming the field); values' ranges are checked
where every entry checks them, bullet_trt/engine/validation.py. Fields OpenAI defines that
this server does not act on are ignored, as OpenAI-compatible servers commonly do, except
those whose silent neglect would change the answer (penalties, logprobs, n > 1): those are
refused in request_params.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None
    # Extensions other OpenAI-compatible servers (vLLM) accept too.
    top_k: int | None = None
    min_tokens: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool | None = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) go to the chat template as sent.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
