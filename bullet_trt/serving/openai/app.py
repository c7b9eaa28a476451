"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions, POST
/v1/chat/completions, in front of the Triton model (Triton stays the one server of the model;
this app only translates)."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from bullet_trt.serving.openai.auth import api_key_check
from bullet_trt.serving.openai.body_limit import MAX_BODY_BYTES, BodyLimit
from bullet_trt.serving.openai.disconnect import CancellingStreamingResponse, ClientGone, unless_disconnected
from bullet_trt.serving.openai.errors import OpenAIError, install_error_handlers, invalid
from bullet_trt.serving.openai.generation_run import GenerationRun
from bullet_trt.serving.openai.request_params import Generation, generation
from bullet_trt.serving.openai.responses import DONE, Answer, sse
from bullet_trt.serving.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from bullet_trt.serving.openai.served_model import ServedModel
from bullet_trt.serving.openai.triton_stream import TritonStreams

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"; nobody reads it


def _message(m: ChatMessage) -> dict[str, Any]:
    out = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        # Text-only templates expect a string; content parts are joined as other servers join them.
        out["content"] = "\n".join(part.text for part in m.content)
    return out


def create_app(model: ServedModel, streams: TritonStreams, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await streams.close()

    app = FastAPI(title="bullet_trt: OpenAI-compatible API", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    authorized = [Depends(api_key_check(api_key))]
    started = int(time.time())

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _exc: ClientGone):
        return Response(status_code=CLIENT_CLOSED)

    def check_model(name: str) -> None:
        if name != model.name:
            raise OpenAIError(404, f"The model {name!r} does not exist; this server serves {model.name!r}",
                              type="not_found_error", param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": model.name, "object": "model", "created": started, "owned_by": "bullet_trt",
                "max_model_len": model.limits.max_model_len}

    @app.get("/health")
    async def health():
        # Without the key: it says only that this process answers (launch.py waits on it).
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=authorized)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=authorized)
    async def get_model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise invalid(f"prompt must be one string (or a list of one): this server answers one prompt "
                              f"per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        gen = generation(body, prompt, model, "prompt")
        return await answer(request, body, gen, Answer(chat=False, model=model.name),
                            echo=prompt if body.echo else "")

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt = model.chat_prompt([_message(m) for m in body.messages])
        gen = generation(body, prompt, model, "messages")
        return await answer(request, body, gen, Answer(chat=True, model=model.name))

    async def answer(request: Request, body, gen: Generation, ans: Answer, echo: str = ""):
        run = GenerationRun(streams, gen, model.limits.max_model_len)
        if not body.stream:
            text = await unless_disconnected(request, run.text())
            return ans.whole(echo + text, run.finish_reason, run.usage())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        deltas = run.deltas()
        # The first piece is awaited before the 200 goes out, so that a refusal (a value the
        # model refuses, an overloaded server) is an HTTP status rather than an event in a 200.
        try:
            first = await unless_disconnected(request, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise

        async def events():
            try:
                if ans.chat or echo:
                    yield sse(ans.chunk(echo, first=True, with_usage=include_usage))
                if first is not None:
                    yield sse(ans.chunk(first, with_usage=include_usage))
                async for delta in deltas:
                    yield sse(ans.chunk(delta, with_usage=include_usage))
                yield sse(ans.chunk(None, run.finish_reason, with_usage=include_usage))
                if include_usage:
                    yield sse(ans.usage_chunk(run.usage()))
            except OpenAIError as e:  # after the 200: the error is an event, as OpenAI sends it
                yield sse(e.body())
            finally:
                await deltas.aclose()
            yield DONE

        return CancellingStreamingResponse(events(), media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache"})

    return app
