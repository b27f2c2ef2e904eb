"""TextStream: the text of a growing list of tokens, released only once it is final.

Two things keep text back: a trailing incomplete UTF-8 character (a multi-byte character split
across tokens decodes to U+FFFD until its last byte arrives), and a tail that could still become a
stop string. A stop string is matched in the decoded text, so across token boundaries, and is
never released: the text ends just before it. The one detokenizer of the project: `trtspec run`'s
stream and `Generator.stream_text` (decode_pieces) and the server (serve/jobs.py) all use it.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""            # everything released so far
        self.stopped = False      # a stop string was found: the text is final

    def feed(self, ids: list[int]) -> str:
        """Add a step's tokens; returns the newly released text ("" if nothing is final yet)."""
        if self.stopped:
            return ""
        self.ids += ids
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(full[: min(hits)])
        end = len(full.rstrip("\ufffd"))
        end -= max((k for s in self.stops for k in range(1, min(len(s), end + 1))
                    if full.endswith(s[:k], 0, end)), default=0)
        return self._release(full[:max(end, len(self.text))])

    def finish(self) -> str:
        """The generation ended: release whatever was held back."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _release(self, upto: str) -> str:
        new = upto[len(self.text):]
        self.text = upto
        return new
