"""Where things live: a project folder holds run folders; a run folder holds one file per rank."""

from __future__ import annotations

import re
from pathlib import Path

RANK_FILE = re.compile(r"^rank(\d+)\.sqlite$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def rank_file(run_dir: Path, rank: int) -> Path:
    """The database file of `rank` inside `run_dir`."""
    return run_dir / f"rank{rank}.sqlite"


def rank_files(run_dir: Path) -> dict[int, Path]:
    """All rank databases of a run folder, by rank."""
    found = {}
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            m = RANK_FILE.match(p.name)
            if m and p.is_file():
                found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def is_run_dir(path: Path) -> bool:
    return bool(rank_files(path))


def check_run_name(name: str) -> str:
    """Run names become folder names: keep them portable and free of path tricks."""
    if not isinstance(name, str) or not _RUN_NAME.match(name):
        raise ValueError(
            f"invalid run name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return name
