"""Cuts generated text at the first stop string, as OpenAI does (the stop string itself is not
returned), also when it spans two streamed pieces.

The engine stops on the stop words' token ids, which finds most of them; a stop string that
the model writes with other tokens (inside a longer token, say) is found here in the text,
and the caller then ends the request. While streaming, a tail that may be the start of a
stop string is held back until the next piece shows whether it is one.
"""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The part of `piece` (with what was held) that is final; sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return text[:min(hits)]
        keep = self._possible_start(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, at the end of the output."""
        out, self.held = self.held, ""
        return out

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string begins with."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
