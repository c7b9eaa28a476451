"""A client that goes away ends its generation at once, streaming or not.

Under ASGI 2.4 servers (uvicorn) Starlette's StreamingResponse notices a closed connection
only when the next piece fails to send, and leaves the body iterator for the garbage
collector to close; a generation waiting in the engine's queue would hold its Triton request
(and later its KV blocks) until then. Here a task listens for ``http.disconnect`` next to the
work and cancels it; the body iterator is always closed, and its ``finally`` cancels the
Triton request.
"""
from __future__ import annotations

from typing import Awaitable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientGone (with `work` cancelled) when the client leaves first."""
    result: list[T] = []
    failure: list[Exception] = []

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            try:
                result.append(await work)
            except Exception as e:  # raised below as itself, not inside the task group's ExceptionGroup
                failure.append(e)
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        await _wait_for_disconnect(request.receive)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise ClientGone()
    return result[0]


class CancellingStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection closed under a send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _wait_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
