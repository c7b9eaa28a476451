"""The request an error response ends, named in its message: ``[request id: <id>] <message>``.

Triton's gRPC stream (ModelStreamInfer) carries an error response as its message alone, and
tritonclient hands the stream callback that error without the response's id. A client that
sends many requests over one stream could not tell which of them an error ends, and would
wait for a final response that has already come. So every error that ends a request starts
with the id the client gave that request (``request_id=`` of ``async_stream_infer``): the
model writes it with `with_request_id`, clients read it with `split_request_id`. The form is
the one tritonserver itself puts before the errors it raises for a request (a wrong input
type, say), so one parser reads both.

A request without an id keeps its message as it is. So does one whose id holds ``]``, which
would end the id early when read back: such a request's errors name no request, as before.
"""
from __future__ import annotations

PREFIX = "[request id: "
_END = "] "


def with_request_id(message: str, request_id: str | None) -> str:
    """`message` with the prefix naming `request_id`; unchanged for no id, an id holding "]",
    or a message that already names this id."""
    if not request_id or "]" in request_id:
        return message
    if split_request_id(message)[0] == request_id:
        return message
    return f"{PREFIX}{request_id}{_END}{message}"


def split_request_id(message: str) -> tuple[str | None, str]:
    """(the id the prefix names, the message after it), or (None, message) without one."""
    if not message.startswith(PREFIX):
        return None, message
    end = message.find(_END, len(PREFIX))
    rid = message[len(PREFIX):end]
    if end < 0 or not rid or "]" in rid:
        return None, message
    return rid, message[end + len(_END):]
