""""Did you mean" for mistyped names: one helper for every place that checks a user's name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str], what: str, *, known_as: str = "recorded",
                 shown: int = 12) -> str:
    """One line: `name` is not a known `what`, the closest known names, then the known ones.

    e.g. "unknown tensor 'outptu'; did you mean 'output'? (recorded: input, output)".
    `known_as` labels the list of known names; at most `shown` of them are listed.
    """
    names = sorted(set(known))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    same_but_case = [n for n in names if n.lower() == str(name).lower() and n not in close]
    close = same_but_case + close
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listed = ", ".join(names[:shown]) or "none"
    if len(names) > shown:
        listed += f", ... ({len(names) - shown} more)"
    return f"unknown {what} {name!r}{hint} ({known_as}: {listed})"
