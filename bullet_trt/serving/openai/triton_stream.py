"""One generation as an async stream of text pieces from the Triton model, over Triton's gRPC
streaming API (each request on its own gRPC stream, so cancelling the stream cancels exactly
that request: Triton marks it cancelled, the model aborts it and its KV blocks return).

The stream is opened with the ``triton_grpc_error`` header: without it an error inside a
gRPC stream carries only a message, with it the stream ends with the error's own status
code (INVALID_ARG, UNAVAILABLE, ...), which is what an HTTP status is chosen by.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from bullet_trt.serving.openai.errors import OpenAIError, invalid
from bullet_trt.serving.triton.frontend import INPUTS
from bullet_trt.serving.triton.request_errors import split_request_id

NUMPY = {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
RETRY_AFTER_S = 1


@dataclass
class Piece:
    text: str
    output_tokens: int  # tokens whose text this piece carries
    input_tokens: int | None
    final: bool


def _inputs(values: dict[str, Any]) -> list:
    out = []
    for name, value in values.items():
        dtype = INPUTS[name][1]
        if dtype == "BYTES":
            items = value if isinstance(value, list) else [value]
            arr = np.array([[v.encode("utf-8") for v in items]], dtype=np.object_)
        else:
            arr = np.array([[value]], dtype=NUMPY[dtype])
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _scalar(result, name: str) -> int | None:
    arr = result.as_numpy(name)
    return None if arr is None or arr.size == 0 else int(arr.reshape(-1)[0])


class TritonStreams:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self._client: grpcaio.InferenceServerClient | None = None
        self._ids = itertools.count()

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        # Created on first use, inside the server's event loop, which grpc.aio binds it to.
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def generate(self, inputs: dict[str, Any], renames: dict[str, str]) -> AsyncIterator[Piece]:
        """Pieces until the final one. Leaving early (a stop string, a client that went away)
        cancels the Triton request; errors come as OpenAIError."""
        done = asyncio.Event()
        request = {"model_name": self.model, "inputs": _inputs(inputs), "request_id": f"oai{next(self._ids)}"}

        async def requests():
            yield request
            await done.wait()  # keep our half open until the answer is complete

        call = self.client.stream_infer(requests(), headers={"triton_grpc_error": "true"})
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    # A request Triton refuses before the model sees it (an unknown model, say)
                    # comes as a message without a status code, even with triton_grpc_error.
                    finished = True
                    raise self._error(None, error.message() or str(error), renames)
                out = result.as_numpy("text_output")
                text = b"".join(out.reshape(-1)).decode("utf-8") if out is not None else ""
                params = result.get_response().parameters
                final = "triton_final_response" in params and params["triton_final_response"].bool_param
                finished = final
                yield Piece(text, _scalar(result, "num_output_tokens") or 0,
                            _scalar(result, "num_input_tokens"), final)
                if final:
                    return
            finished = True
            raise OpenAIError(502, "the Triton stream ended before the final response", type="server_error")
        except grpc.aio.AioRpcError as e:
            finished = True
            raise self._error(e.code(), e.details() or str(e.code()), renames) from None
        finally:
            done.set()
            if not finished:
                call.cancel()

    def _error(self, code: grpc.StatusCode | None, details: str, renames: dict[str, str]) -> OpenAIError:
        # Our own request id names nothing the HTTP client knows, and the message's first word
        # must be the field it is about (errors.invalid).
        details = split_request_id(details)[1]
        # The app has checked the model's name already, so Triton not knowing it means it is not
        # loaded now (it unloads itself when its engine dies); Triton says so as INVALID_ARG.
        if code == grpc.StatusCode.NOT_FOUND or details.startswith("Request for unknown model"):
            return OpenAIError(503, f"Triton does not serve model {self.model!r} now: {details}",
                               type="server_error", code="model_not_ready",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        if code in (grpc.StatusCode.INVALID_ARGUMENT, None):
            return invalid(details, renames=renames)
        if code == grpc.StatusCode.UNAVAILABLE:
            if "failed to connect" in details.lower() or "connection refused" in details.lower():
                return OpenAIError(503, f"Triton at {self.url} is not reachable: {details}", type="server_error",
                                   code="triton_unreachable", headers={"Retry-After": str(RETRY_AFTER_S)})
            # The model refuses work it cannot take now (overload, an engine restarting):
            # a client should come back later, which is what 429 with Retry-After says.
            return OpenAIError(429, details, type="rate_limit_error", code="unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        return OpenAIError(500, details, type="server_error", code=code.name.lower())
