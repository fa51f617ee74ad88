"""A sub-command of `deepscope`: its name, help, arguments and what it runs.

Feature modules define theirs with `@verb(...)`; `cli.main` imports each one explicitly and
lists them in order (a misspelt import fails at once instead of dropping the verb).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Verb:
    """name: the sub-command. help: one line for `deepscope --help`. configure: adds its
    arguments. run: runs it, returns the exit status. extra: the pip extra (`deepscope[...]`)
    whose packages `run` imports, named when one is missing."""

    name: str
    help: str
    configure: Configure
    run: Callable[[argparse.Namespace], int]
    extra: str | None = None

    def __call__(self, args: argparse.Namespace) -> int:
        return self.run(args)


def verb(name: str, help: str, configure: Configure, extra: str | None = None
         ) -> Callable[[Callable[[argparse.Namespace], int]], Verb]:
    """Make a function a sub-command (list it in `cli.main.VERBS` to enable it)."""
    def make(fn: Callable[[argparse.Namespace], int]) -> Verb:
        return Verb(name, help, configure, fn, extra)
    return make
