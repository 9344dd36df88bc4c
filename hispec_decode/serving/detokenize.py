"""Token ids to streamed text, with stop strings.

:class:`TextStream` turns the tokens the engine commits into text deltas. It decodes a short
window of recent tokens rather than the whole output each time (the offsets technique of
Hugging Face's text streamer and vLLM): a token that ends in the middle of a UTF-8 character,
or whose leading space depends on its neighbour, yields its text once the next token makes it
whole. With stop strings it holds back a tail that could still grow into one, and cuts the text
before the first stop string found (OpenAI's behaviour: the stop string is not returned).
"""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"  # what decoding gives for a partial UTF-8 character


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string's longest proper prefix
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded so far (before the stop string, once one is found)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False
        self.num_tokens = 0  # tokens that count as output: up to the one that completed a stop string
        self._prefix = 0  # ids[_prefix:_read] decode to the last emitted context
        self._read = 0
        self._prefix_text = ""  # decoded ids[_prefix:_read]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, tokens: list[int]) -> str:
        """Feed committed tokens; returns the text that may be sent now ("" while held back)."""
        for token in tokens:
            if self.stopped:
                break
            self.ids.append(token)
            self.num_tokens += 1
            full = self._decode(self.ids[self._prefix :])
            if len(full) > len(self._prefix_text) and not full.endswith(INCOMPLETE):
                self.text += full[len(self._prefix_text) :]
                self._prefix, self._read = self._read, len(self.ids)
                self._prefix_text = self._decode(self.ids[self._prefix : self._read])
            self._find_stop()
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text once the output has ended (a held-back tail, an incomplete character)."""
        if not self.stopped and self._read < len(self.ids):
            self.text += self._decode(self.ids[self._prefix :])[len(self._prefix_text) :]
            self._read = len(self.ids)
            self._find_stop()
        return self._take(final=True)

    def _find_stop(self) -> None:
        if self.stopped or not self.stop:
            return
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
