"""The bodies OpenAI's API answers with: completions, chat completions, their stream chunks,
and server-sent events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


@dataclass
class Answer:
    """The fields every object of one answer shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, delta: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if delta:
            body = ({"role": "assistant", "content": text or ""} if first
                    else ({"content": text} if text is not None else {}))
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": [self._choice(text, finish_reason, delta=False)], "usage": usage,
                "system_fingerprint": None}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              with_usage: bool = False) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out = {**head, "choices": [self._choice(text, finish_reason, delta=True, first=first)],
               "system_fingerprint": None}
        if with_usage:
            out["usage"] = None  # stream_options.include_usage: null on all but the last chunk
        return out

    def usage_chunk(self, usage: dict) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage, "system_fingerprint": None}
