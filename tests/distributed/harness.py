"""Run a function on N gloo ranks, each a fresh process (1 thread, bounded timeouts).

    results = launch("tests.distributed.scenarios_x:equivalence", tmp_path, world_size=2)

The target `module:function(rank, world_size, out_dir, *args)` runs after
`dist.init_process_group("gloo")` on 127.0.0.1 with a free port; whatever it returns
(JSON-serialisable) comes back, one entry per rank. Results travel as JSON files, never
pickles. A rank that fails, hangs past `timeout` or is killed comes back as a `RankResult`
with `returncode != 0` and its stderr tail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    value: Any  # the function's return value (None when it failed)
    stderr: str

    def check(self) -> Any:
        assert self.returncode == 0, f"rank {self.rank} failed ({self.returncode}):\n{self.stderr}"
        return self.value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target: str, out_dir: Path, *args: Any, world_size: int = 2, timeout: float = 120,
           env: dict[str, str] | None = None) -> list[RankResult]:
    """Run `target` on `world_size` ranks; wait at most `timeout` seconds for all."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                   os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.worker", target, str(out_dir),
             json.dumps(list(args))],
            cwd=ROOT, env=rank_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    results = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, err = proc.communicate()
            err = f"timed out after {timeout} s\n{err}"
        value_file = out_dir / f"result{rank}.json"
        value = json.loads(value_file.read_text()) if value_file.exists() else None
        results.append(RankResult(rank, proc.returncode, value, err[-4000:]))
    return results
