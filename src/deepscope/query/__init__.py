"""The read path for users and the GUI: runs and projects as pandas / numpy."""

from .project import Project, open_project
from .run import Run, open_run

__all__ = ["Project", "Run", "open_project", "open_run"]
