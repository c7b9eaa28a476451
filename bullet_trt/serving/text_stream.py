"""A request's output as text: token ids in, final pieces of text out.

Every front end that streams text needs the same two steps after the engine, in this order:
incremental detokenization (bullet_trt.model.tokenizer.IncrementalDetokenizer: a piece never
ends inside a UTF-8 character) and stop strings (stop_strings.py: the output ends where the
first one begins). The pieces join to exactly the text a non-streaming response carries, and
`num_tokens` counts the tokens that text came from: with stop strings the tokens are taken one
at a time, so a request that stops on a string reports the same tokens however the engine's
outputs were merged before they got here.

Stop strings are looked for only in text that arrives once `min_tokens` tokens exist, as the
engine looks for end ids and stop token ids only from then on.
"""
from __future__ import annotations

from bullet_trt.model.tokenizer import IncrementalDetokenizer
from bullet_trt.serving.stop_strings import StopStrings


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, min_tokens: int = 0,
                 skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = StopStrings(list(stop or []))
        self.min_tokens = min_tokens
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        """True once a stop string was found: the output is complete, later tokens are not part of it."""
        return self.stop.stopped

    def push(self, token_id: int) -> str:
        """The text that became final with this token ("" when it is held back)."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        piece = self.detok.step([token_id])
        if self.num_tokens < self.min_tokens:
            return self.stop.flush() + piece  # not searched yet, so nothing is held
        return self.stop.feed(piece)

    def extend(self, token_ids: list[int]) -> str:
        """The text that became final with these tokens; stops at the token that completes a
        stop string (`num_tokens` then counts only the tokens up to it)."""
        if not self.stop.stops:  # nothing to stop at: one decode for all of them
            if self.stopped or not token_ids:
                return ""
            self.num_tokens += len(token_ids)
            return self.detok.step(list(token_ids))
        pieces = []
        for token in token_ids:
            pieces.append(self.push(token))
            if self.stopped:
                break
        return "".join(pieces)

    def finish(self) -> str:
        """What is left once the engine ended the output (nothing after a stop string)."""
        if self.stopped:
            return ""
        tail = self.detok.flush()
        if self.num_tokens < self.min_tokens:
            return self.stop.flush() + tail
        return self.stop.feed(tail) + self.stop.flush()
