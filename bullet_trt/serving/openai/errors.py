"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

OpenAI's client libraries read the status to pick an exception class and show `message`;
`param` names the request field to fix, so every refusal here names one where it can.
"""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# Triton input names (bullet_trt/engine/validation.py and the frontend start each message with
# one) as an OpenAI client knows them.
TRITON_TO_OPENAI = {"text_input": "prompt", "stop_words": "stop", "random_seed": "seed"}
# Fields a message may name; other first words ("KV pool too small ...") name no field.
REQUEST_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                  "seed", "stop", "n", "stream", "stream_options", "frequency_penalty", "presence_penalty",
                  "echo", "logprobs", "top_k", "min_tokens"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _named(message: str, renames: dict[str, str] | None) -> tuple[str | None, str]:
    """The field a validation message is about, by its first word ("top_p must be in (0, 1]...",
    "stop_words[2] is not valid UTF-8..."), and the message with the client's name for it."""
    m = re.match(r"([a-z_]+)(\[\d+\])?\b", message)
    if not m:
        return None, message
    name = {**TRITON_TO_OPENAI, **(renames or {})}.get(m.group(1), m.group(1))
    if name not in REQUEST_FIELDS:
        return None, message
    return name, name + message[len(m.group(1)):]


def invalid(message: str, param: str | None = None, renames: dict[str, str] | None = None) -> OpenAIError:
    named, message = _named(message, renames)
    return OpenAIError(400, message, param=param or named)


def _loc(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = _loc(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            param = None
        detail = first.get("msg", "invalid request")
        message = f"{param}: {detail}" if param else detail
        return OpenAIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return OpenAIError(exc.status_code, str(exc.detail), type=kind, code=code,
                           headers=getattr(exc, "headers", None)).response()
