"""A request's output text, built one token's text at a time.

A str held in an attribute is copied by every `+=` (CPython extends a str in
place only for a local variable), and so is every slice of it: a request's
text kept that way costs O(length) per token, and an output of 16,000 tokens
spends most of its time copying its own text. Here appends go to a list of
pieces; the oldest pieces are joined into chunks now and then, so memory stays
one object per chunk, and reading or cutting the last k characters touches
only the parts that hold them.

Costs (n = the text's length): `append` O(1) amortised per character;
`slice(start)` / `truncate(length)` O(n - start + parts walked); `value()` O(n).
"""

from __future__ import annotations

from collections.abc import Iterator

# once this many pieces are kept, all but the newest _KEEP_PIECES are joined into one chunk
_FOLD_PIECES = 64
# reads near the end (stop strings, held-back text) stay within these
_KEEP_PIECES = 16


class TextBuffer:
    __slots__ = ("_chunks", "_pieces", "_len")

    def __init__(self, text: str = "") -> None:
        self._chunks: list[str] = []   # older text, in order
        self._pieces: list[str] = []   # newer text, after the chunks
        self._len = 0
        self.append(text)

    def __len__(self) -> int:
        return self._len

    def append(self, text: str) -> None:
        if not text:
            return
        self._pieces.append(text)
        self._len += len(text)
        if len(self._pieces) >= _FOLD_PIECES:
            self._chunks.append("".join(self._pieces[:-_KEEP_PIECES]))
            del self._pieces[:-_KEEP_PIECES]

    def _parts_from_end(self) -> Iterator[str]:
        yield from reversed(self._pieces)
        yield from reversed(self._chunks)

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end], for 0 <= start and end <= len (None: to the end)."""
        end = self._len if end is None else end
        if start >= end:
            return ""
        if self._pieces:    # most reads are within the newest piece: one slice
            last = self._pieces[-1]
            last_start = self._len - len(last)
            if start >= last_start:
                return last[start - last_start:end - last_start]
        found: list[str] = []
        part_end = self._len
        for part in self._parts_from_end():
            part_start = part_end - len(part)
            if part_start < end:
                found.append(part[max(start, part_start) - part_start:min(end, part_end) - part_start])
            part_end = part_start
            if part_end <= start:
                break
        return "".join(reversed(found))

    def truncate(self, length: int) -> None:
        """Keeps text[:length] (0 <= length <= len)."""
        while self._len > length:
            parts = self._pieces if self._pieces else self._chunks
            last = parts.pop()
            self._len -= len(last)
            if self._len < length:
                parts.append(last[:length - self._len])
                self._len = length

    def value(self) -> str:
        """The whole text (kept joined, so that asking again costs only what was appended since)."""
        text = "".join(self._chunks + self._pieces)
        self._chunks, self._pieces = ([text] if text else []), []
        return text
