"""One generation as the OpenAI API reports it: text deltas with stop strings cut, token
counts, and the finish reason.

Triton's responses carry no finish reason; it follows from the counts: the output ran to
`max_tokens` or filled the context ("length"), or it ended earlier at an end token or a stop
string ("stop").
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from bullet_trt.serving.openai.request_params import Generation
from bullet_trt.serving.stop_strings import StopStrings
from bullet_trt.serving.openai.triton_stream import TritonStreams


class GenerationRun:
    def __init__(self, streams: TritonStreams, generation: Generation, max_model_len: int):
        self.streams = streams
        self.generation = generation
        self.max_model_len = max_model_len
        self.prompt_tokens = generation.prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[str]:
        g = self.generation
        stop = StopStrings(g.stop)  # the model cuts them too; this keeps the front right on its own
        async with aclosing(self.streams.generate(g.inputs, g.renames)) as pieces:
            async for piece in pieces:
                self.completion_tokens += piece.output_tokens
                if piece.input_tokens is not None:
                    self.prompt_tokens = piece.input_tokens
                text = stop.feed(piece.text)
                if text:
                    yield text
                if stop.stopped:
                    self.finish_reason = "stop"
                    return  # leaving the Triton stream early cancels its request
        tail = stop.flush()
        if tail:
            yield tail
        full = (self.completion_tokens >= g.max_tokens
                or self.prompt_tokens + self.completion_tokens >= self.max_model_len)
        self.finish_reason = "length" if full else "stop"

    async def text(self) -> str:
        return "".join([delta async for delta in self.deltas()])

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
