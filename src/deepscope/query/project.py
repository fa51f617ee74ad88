"""A project folder: the runs that belong together."""

from __future__ import annotations

from pathlib import Path

from ..store.layout import check_links, inside, is_run_dir
from .run import Run


class Project:
    """A folder of run folders. A run folder itself opens as a project of one run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"project folder {self.path} does not exist; pass the folder given "
                             "to deepscope.Scope(path, ...)")
        check_links(self.path)

    def runs(self) -> list[str]:
        """Run names, sorted; re-read on every call so new runs appear."""
        if is_run_dir(self.path):
            return [self.path.name]
        # a run folder linked in from outside the project is not listed (see store.layout)
        return sorted(p.name for p in self.path.iterdir()
                      if p.is_dir() and inside(p, self.path) and is_run_dir(p))

    def run(self, name: str) -> Run:
        """Open run `name` of this project (ValueError naming the runs if there is none)."""
        names = self.runs()
        if name not in names:
            raise ValueError(f"no run {name!r} in {self.path}; runs: {', '.join(names) or 'none'}")
        return Run(self.path if is_run_dir(self.path) else self.path / name)


def open_project(path: str | Path) -> Project:
    """Open a project folder (a folder of runs) for reading."""
    return Project(path)
