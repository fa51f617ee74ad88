"""The demo: comgra's tutorial bug hunt recorded by deepscope (`deepscope demo`).

`run_demo(path, steps=...)` trains a bugged and a fixed recurrent net on the sign-of-sum task
and returns where they were recorded and how well each trained.

The names load on first use: the `deepscope` command lists `demo` without loading torch.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_HOMES = {
    **dict.fromkeys(["RecurrentNet", "SubNet", "make_batch"], ".task"),
    "DemoConfig": ".config",
    **dict.fromkeys(["DemoResult", "run_demo", "serve_demo"], ".train"),
}

__all__ = ["DemoConfig", "DemoResult", "RecurrentNet", "SubNet", "make_batch", "run_demo",
           "serve_demo"]

if TYPE_CHECKING:
    from .config import DemoConfig
    from .task import RecurrentNet, SubNet, make_batch
    from .train import DemoResult, run_demo, serve_demo

__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
