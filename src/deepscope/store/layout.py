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

from ..errors import CorruptRunError

RANK_FILE = re.compile(r"^rank(\d+)\.sqlite$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def rank_file(run_dir: Path, rank: int) -> Path:
    """The database file of `rank` inside `run_dir`."""
    return run_dir / f"rank{rank}.sqlite"


def lock_file(db: Path) -> Path:
    """The lock file beside a rank database: held (OS lock) by its one writer, and holding
    the run id that the database's `meta` table must repeat."""
    return db.with_name(db.name + ".lock")


def sidecar_run_id(db: Path) -> str | None:
    """The run id written in `db`'s lock file, or None without one (older or copied runs)."""
    try:
        text = lock_file(db).read_text("ascii", errors="replace").strip()
    except OSError:
        return None
    return text if _RUN_ID.match(text) else None


def parse_run_id(stored: object) -> str | None:
    """meta's run_id value (JSON text, like every meta value) as a run id, or None."""
    text = stored.strip('"') if isinstance(stored, str) else ""
    return text if _RUN_ID.match(text) else None


def check_run_id(db: Path, stored: object) -> None:
    """Refuse a database whose run id (`stored`: meta's value) differs from its lock file's:
    the pages SQLite read (typically a `-wal` file copied from another run) belong to another
    database."""
    expected = sidecar_run_id(db)
    if expected is not None and stored is not None and parse_run_id(stored) != expected:
        raise CorruptRunError(
            f"{db} reads as another run (its run id is not the one in {lock_file(db).name}): "
            "a -wal file from another database was probably put beside it; "
            f"remove that -wal file (or, if you copied {db.name} here on purpose, delete "
            f"{lock_file(db).name})")


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
