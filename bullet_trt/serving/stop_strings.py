"""Finds stop strings in generated text as it streams, wherever the tokens split them.

The engine also stops on a stop word's token ids, but a model rarely writes a string with
the very tokens that encoding it alone gives ("lo w" may come as "lo" + " w", or inside
"slow"), so the text is the authority: a stop string ends the output where it begins, and is
not part of it. While streaming, a tail that may be the start of a stop string is held back
until the next text shows whether it is one, so no client ever sees part of a stop string.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of what was held plus `text` that is final; at a stop string, the text
        before it, and `stopped` turns true (later calls return nothing)."""
        if self.stopped:
            return ""
        text = self.held + text
        if not self.stops:
            self.held = ""
            return text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return text[:min(hits)]
        keep = self._possible_start(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the output has ended without a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string begins with."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
