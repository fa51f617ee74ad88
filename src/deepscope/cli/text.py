"""Text from a run file reaches the terminal only as visible characters.

Names, kinds, notes and anomaly messages are data someone else may have written: an escape
sequence in them (ESC ] 52 writes the clipboard, ESC [ 2 J clears the screen) or a
right-to-left override must be shown, not obeyed. `clean` renders every control or format
character as its Python escape (\\x1b, \\u202e); `SafeStream` applies it to all a verb prints.
"""

from __future__ import annotations

from typing import Any, TextIO


def clean(text: object, keep: str = "") -> str:
    """`text` with each non-printable character except those in `keep` written as an escape."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else c.encode("unicode_escape").decode()
                   for c in text)


class SafeStream:
    """A text stream passing what is written through `clean` (newlines and tabs kept); the
    rest (encoding, fileno, ...) is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(clean(text, keep="\n\t"))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
