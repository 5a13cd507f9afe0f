"""Token ids -> text, incrementally: a streaming detokenizer and a stop-string matcher.

Both look only at the new tokens (plus a few tokens of context) on every step, so the cost
of a step does not grow with the length of the output."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes half a UTF-8 character to


class IncrementalDecoder:
    """Decodes a growing list of token ids, returning only the new text each time.

    A window of already-emitted tokens is decoded together with the new ones, so tokenizers
    whose pieces depend on their neighbours (leading spaces, byte fallback) decode the same
    as a full `decode`. Text ending in half a UTF-8 character is held back until the rest
    arrives; if it never does (the generation ended mid-character), `flush` drops it."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this have been turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or half a character: wait for more tokens
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """At the end: the text still held back, less an incomplete character at its end."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return complete_text(text[len(before):])


def complete_text(text: str) -> str:
    """Text as an answer ends: without the U+FFFD a half (or broken) character at its very end
    decodes to. A whole `decode` of the same tokens, passed through this, equals the streamed text."""
    return text.rstrip(REPLACEMENT)


class StopMatcher:
    """Finds the first stop string in streamed text. `feed` returns the text that is safe to
    show (it cannot be the start of a stop string) and whether a stop string was hit; the
    text from the stop string on is dropped, as OpenAI does."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""  # held back: a suffix that may grow into a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._pending + text  # short: the held-back suffix plus this step's text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[:min(hits)], True
        keep = self._partial_suffix(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = min(max(len(s) for s in self.stops) - 1, len(buf))
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
