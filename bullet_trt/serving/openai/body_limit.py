"""Refuses request bodies over a size limit with 413, without holding them in memory.

A declared Content-Length over the limit is refused before the app runs; a chunked body is
counted as it arrives. Either way the rest of the body is read and dropped before the 413 goes
out: a client still sending when the server closes sees a broken pipe, not the 413. Past
DRAIN_FACTOR times the limit the server stops reading and answers at once.
"""
from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bullet_trt.serving.openai.errors import OpenAIError

MAX_BODY_BYTES = 2 * 1024 * 1024
DRAIN_FACTOR = 16


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"

    async def _drain(self, receive: Receive, seen: int) -> None:
        more = True
        while more and seen <= self.max_bytes * DRAIN_FACTOR:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive, 0)
            await OpenAIError(413, self._message(), code="request_too_large").response()(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        await self._drain(receive, seen)
                    # An HTTPException passes FastAPI's body reading (which turns other errors
                    # into 400) on to the error handlers, which answer in OpenAI's shape.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)
