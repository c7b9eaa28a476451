"""Offline API: generate from an engine directory without Triton.

    from bullet_trt import LLM, SamplingParams
    llm = LLM("engines/default")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))[0].text)
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from bullet_trt.config import load_engine_config
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.model.tokenizer import Tokenizer
from bullet_trt.serving.modes import create_engine
from bullet_trt.serving.text_stream import TextStream


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None


class LLM:
    def __init__(self, engine_dir: str, **overrides):
        """overrides: dotted config keys (``serve.mode="bullet"``); the engine is the one
        serving builds for serve.mode (chunked, bullet or static)."""
        self.cfg = load_engine_config(engine_dir, overrides)
        self.tokenizer = Tokenizer(self.cfg.tokenizer_path)
        self.engine = create_engine(self.cfg)
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.generate_token_ids([self.tokenizer.encode(p) for p in prompts], sampling)

    def generate_token_ids(self, prompts: list[list[int]],
                           sampling: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        if not isinstance(sampling, list):
            sampling = [sampling or SamplingParams()] * len(prompts)
        order = []
        streams: dict[str, TextStream] = {}
        for ids, params in zip(prompts, sampling):
            params = copy.deepcopy(params)
            if params.stop and not params.stop_token_ids:
                params.stop_token_ids = self.tokenizer.stop_sequences(params.stop)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(NewRequest(rid, list(ids), params))
            order.append(rid)
            streams[rid] = TextStream(self.tokenizer, params.stop, params.min_tokens)
        # Text as the server makes it (serving/text_stream.py): the same pieces, and a stop
        # string ends the output, without itself, at the token that completed it.
        tokens = {rid: [] for rid in order}
        texts = {rid: [] for rid in order}
        lps = {rid: [] for rid in order}
        reasons: dict[str, str | None] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                rid, stream = out.request_id, streams[out.request_id]
                if rid in reasons:
                    continue  # stopped on a string: this is the engine's answer to the abort
                before = stream.num_tokens
                texts[rid].append(stream.extend(out.new_token_ids))
                used = stream.num_tokens - before
                tokens[rid] += out.new_token_ids[:used]
                if out.new_logprobs:
                    lps[rid] += out.new_logprobs[:used]
                if stream.stopped:
                    reasons[rid] = "stop"
                    if not out.finished:
                        self.engine.abort_request(rid)
                elif out.finished:
                    texts[rid].append(stream.finish())
                    reasons[rid] = "stop" if stream.stopped else out.finish_reason
        return [Completion(rid, list(ids), tokens[rid], "".join(texts[rid]),
                           reasons.get(rid), lps[rid] if p.logprobs else None)
                for rid, ids, p in zip(order, prompts, sampling)]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
