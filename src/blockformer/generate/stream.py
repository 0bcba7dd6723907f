"""Text as it is generated: incremental detokenisation and stop strings.

Token ids do not map to text one by one (a BPE merge can change spacing, a byte-level
character can span several tokens), so each row's text is decoded from all its ids and
only the new, settled suffix is written. Text that could still become a stop string is
held back until it cannot; the stop string itself is never written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..models.checks import check_callable, kind_of

Decode = Callable[[list[int]], str]


class TextStream:
    """Pass ``on_token=stream.on_token, stop=stream.stop`` to ``generate``.

    ``decode`` is ``tokenizer.decode``; ``write`` receives each settled piece of text
    (with its row, for batches); ``stop_strings`` end a row as soon as its text holds one.
    ``text(row)`` is the final text, cut before the stop string.
    """

    def __init__(
        self,
        decode: Decode,
        write: Callable[[int, str], object] | None = None,
        stop_strings: Sequence[str] = (),
    ) -> None:
        if not callable(decode):
            raise TypeError(f"decode: {kind_of(decode)}; expected a function of token ids, e.g. tokenizer.decode")
        check_callable(write, "write")
        if isinstance(stop_strings, (str, bytes)) or not isinstance(stop_strings, Sequence):
            raise TypeError(f"stop_strings: {kind_of(stop_strings)}; expected a list of strings")
        for i, s in enumerate(stop_strings):
            if not isinstance(s, str):
                raise TypeError(f"stop_strings[{i}]: {s!r}; expected a string")
            if not s:
                raise ValueError(f"stop_strings[{i}]: ''; expected a non-empty string (nothing to stop at)")
        self.decode, self.write = decode, write
        self.stop_strings = list(stop_strings)
        self._ids: dict[int, list[int]] = {}
        self._text: dict[int, str] = {}
        self._written: dict[int, int] = {}  # characters already written, per row
        self._stopped: set[int] = set()

    def on_token(self, row: int, token: int) -> None:
        if row in self._stopped:
            return
        ids = self._ids.setdefault(row, [])
        ids.append(token)
        text = self.decode(ids)
        hit = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if hit:
            text = text[: min(hit)]
            self._stopped.add(row)
            settled = len(text)
        else:
            settled = len(text) - self._held_back(text)
        self._text[row] = text
        self._emit(row, settled)

    def stop(self, row: int, ids: list[int]) -> bool:
        return row in self._stopped

    def finish(self) -> None:
        """Write whatever was held back (generation ended without a stop string)."""
        for row, text in self._text.items():
            self._emit(row, len(text))

    def text(self, row: int = 0) -> str:
        return self._text.get(row, "")

    def _held_back(self, text: str) -> int:
        """Characters at the end that may still change: an incomplete character (U+FFFD
        from a partial UTF-8 sequence) or the start of a stop string."""
        n = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n

    def _emit(self, row: int, upto: int) -> None:
        start = self._written.get(row, 0)
        if upto > start and self.write is not None:
            self.write(row, self._text[row][start:upto])
        self._written[row] = max(start, upto)
