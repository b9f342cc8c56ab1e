"""Turning committed token ids into streamed text, and stop strings.

Decoding token by token breaks multi-byte characters and merges, so the whole
generated sequence is decoded each step and only the new suffix is streamed.
Text that could still be the start of a stop string, or that ends in an
incomplete character, is held back until the next step decides it.
"""
from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""          # the output so far, cut before any stop string
        self._emitted = 0
        self.stopped = False

    def update(self, generated_ids: Sequence[int], final: bool) -> str:
        """Decode the output so far; return the text delta that is safe to send."""
        text = self.tokenizer.decode(list(generated_ids), skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        ready = len(text) if final else max(self._emitted, len(text) - self._hold)
        while not final and ready > self._emitted and text[ready - 1] == "\ufffd":
            ready -= 1   # an incomplete UTF-8 sequence: wait for its next bytes
        delta = text[self._emitted:ready]
        self._emitted = ready
        return delta
