"""Generate docs/api.md from the public names' docstrings (a test keeps it up to date).

    python tools/gen_api.py          # rewrite docs/api.md
    python tools/gen_api.py --check  # exit 1 if docs/api.md is stale
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import deepscope

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"


class _Written(str):
    """An annotation as written in the source: shown without the quotes of its repr."""

    def __repr__(self) -> str:
        return str(self)


def _written(annotation: object) -> object:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _signature(obj: object) -> str:
    """The call signature with annotations as written; a class without its `-> None`."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    returns = inspect.Signature.empty if inspect.isclass(obj) else sig.return_annotation
    return str(sig.replace(
        parameters=[p.replace(annotation=_written(p.annotation))
                    for p in sig.parameters.values()],
        return_annotation=_written(returns)))


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def render() -> str:
    lines = ["# API reference", "",
             "Generated from docstrings by `tools/gen_api.py`; do not edit by hand.", ""]
    for name in sorted(deepscope.__all__, key=str.lower):
        obj = getattr(deepscope, name)
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        lines += [f"## `deepscope.{name}{_signature(obj)}`", "", f"*{kind}*", "", _doc(obj), ""]
        if inspect.isclass(obj):
            for mname, member in sorted(vars(obj).items()):
                if mname.startswith("_") or not (inspect.isfunction(member)
                                                  or isinstance(member, property)):
                    continue
                target = member.fget if isinstance(member, property) else member
                sig = "" if isinstance(member, property) else _signature(member)
                lines += [f"### `{name}.{mname}{sig}`", "", _doc(target), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/api.md is stale: run python tools/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
