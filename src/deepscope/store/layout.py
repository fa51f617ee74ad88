"""Where things live: a project folder holds run folders; a run folder holds one file per rank.

Links: a folder given to deepscope (a project or run folder) is the root of what it reads.
Symbolic links inside it are followed only where they resolve inside it: a run folder linked
into a project from elsewhere is not listed, and a `rank<N>.sqlite` that is a link to a file
outside its run folder is refused (`check_links`), so serving or sharing a folder never
exposes what lies outside it.
"""

from __future__ import annotations

import re
from pathlib import Path

RANK_FILE = re.compile(r"^rank(\d+)\.sqlite$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def rank_file(run_dir: Path, rank: int) -> Path:
    """The database file of `rank` inside `run_dir`."""
    return run_dir / f"rank{rank}.sqlite"


def rank_files(run_dir: Path) -> dict[int, Path]:
    """All rank databases of a run folder, by rank (links leaving the folder left out)."""
    return {r: p for r, p in _rank_candidates(run_dir).items() if inside(p, run_dir)}


def is_run_dir(path: Path) -> bool:
    return bool(rank_files(path))


def check_run_name(name: str) -> str:
    """Run names become folder names: keep them portable and free of path tricks."""
    if not isinstance(name, str) or not _RUN_NAME.match(name):
        raise ValueError(
            f"invalid run name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return name


def inside(path: Path, root: Path) -> bool:
    """True if `path` resolves (links followed) to `root` or to something inside it."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # RuntimeError: a link loop
        return False


def _rank_candidates(run_dir: Path) -> dict[int, Path]:
    found = {}
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            m = RANK_FILE.match(p.name)
            if m and p.is_file():
                found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def check_links(run_dir: Path) -> None:
    """ValueError (one line) if a rank file in `run_dir` is a link to a file outside it."""
    links = [p.name for p in _rank_candidates(run_dir).values() if not inside(p, run_dir)]
    if links:
        raise ValueError(f"{', '.join(links)} in {run_dir} is a link to a file outside the "
                         "run folder; deepscope reads only files inside the folder it is "
                         "given: copy the file into the run folder instead")
