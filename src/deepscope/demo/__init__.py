"""The demo: comgra's tutorial bug hunt recorded by deepscope (`deepscope demo`).

`run_demo(path, steps=...)` trains a bugged and a fixed recurrent net on the sign-of-sum task
and returns where they were recorded and how well each trained.
"""

from .task import RecurrentNet, SubNet, make_batch
from .train import DemoConfig, DemoResult, run_demo, serve_demo

__all__ = ["DemoConfig", "DemoResult", "RecurrentNet", "SubNet", "make_batch", "run_demo",
           "serve_demo"]
