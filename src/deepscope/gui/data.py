"""Data access for the GUI: one cached reader per run, caches keyed by what is on disk.

Callbacks run in Flask's worker threads, so each run's reader is used under its own lock.
Nothing here holds a user's selection: selections live in the browser (per tab); the caches
only remember what the files contained, keyed by the files' size and modification time, so a
step committed by a training process invalidates them on the next poll.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from ..query import Project, Run

T = TypeVar("T")
# What the caches of one run open in the GUI may hold, in bytes (estimated, see
# `approx_bytes`): a crafted or huge run costs at most this much memory between requests.
RUN_CACHE_BYTES = 64 * 2**20
# Runs kept open at once (their readers and caches); the least recently used one is closed.
MAX_OPEN_RUNS = 8


def approx_bytes(obj: Any) -> int:
    """Memory held by a cached value: DataFrames and arrays exactly, containers walked."""
    total, stack = 0, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, pd.DataFrame):
            total += int(o.memory_usage(index=True, deep=True).sum())
        elif isinstance(o, np.ndarray):
            total += o.nbytes
        else:
            total += sys.getsizeof(o)
            if isinstance(o, dict):
                stack.extend(o.keys())
                stack.extend(o.values())
            elif isinstance(o, (list, tuple, set)):
                stack.extend(o)
            elif hasattr(o, "__dict__"):
                stack.append(vars(o))
    return total


class LRU:
    """A small thread-safe least-recently-used cache of at most `size` items and `max_bytes`
    (a value larger than that is returned, not kept)."""

    def __init__(self, size: int, max_bytes: int = RUN_CACHE_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()  # value, bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], T],
            keep: Callable[[T], bool] | None = None) -> T:
        """The value of `key`, made by `make()` when not held; kept unless `keep(value)`
        is false (e.g. an answer that holds an error: the next call tries again)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key][0]
        value = make()  # outside the lock: building may take a while; a race only costs time
        size = approx_bytes(value)
        if size > self.max_bytes or (keep is not None and not keep(value)):
            return value
        with self._lock:
            if key in self._items:
                self._bytes -= self._items.pop(key)[1]
            self._items[key] = (value, size)
            self._bytes += size
            while len(self._items) > self.size or self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1][1]
        return value


class RunData:
    """One run's reader plus caches of the small tables every click needs."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self._lock = threading.RLock()
        # RUN_CACHE_BYTES in all: half for tables, a quarter each for graphs and step records
        self._cache = LRU(64, RUN_CACHE_BYTES // 2)
        self._graphs = LRU(256, RUN_CACHE_BYTES // 4)
        self._steps = LRU(256, RUN_CACHE_BYTES // 4)
        self._identity = self._file_identity()
        self._world: int | None = None  # world size, read once (a run's meta keeps it)

    def _file_identity(self) -> tuple[int, ...]:
        """Inodes of the rank files: they change when a run is overwritten (deleted, re-made)."""
        return tuple(p.stat().st_ino for p in sorted(self.run.path.glob("rank*.sqlite")))

    def stale(self) -> bool:
        """True if the run folder was replaced since this reader opened it."""
        try:
            return self._file_identity() != self._identity
        except FileNotFoundError:
            return True

    def version(self) -> str:
        """A token that changes whenever a writer commits (file sizes and mtimes, WAL too).

        The -shm index is left out: readers touch it too; so is an empty WAL file, which
        opening a finished run for reading creates (no commit in it: nothing new to show).
        """
        parts = []
        files = [*self.run.path.glob("rank*.sqlite"), *self.run.path.glob("rank*.sqlite-wal")]
        for p in sorted(files):
            try:
                st = p.stat()
            except FileNotFoundError:  # a WAL file removed by a checkpoint between glob and stat
                continue
            if st.st_size or not p.name.endswith("-wal"):
                parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

    @contextmanager
    def reading(self) -> Iterator[Run]:
        """The run, for one or more queries made under this run's lock."""
        with self._lock:
            yield self.run

    def cached(self, key: str, make: Callable[[Run], T]) -> T:
        """`make(run)`, recomputed only when the files changed since the cached result."""
        version = self.version()

        def build() -> T:
            with self.reading() as run:
                return make(run)
        return self._cache.get((key, version), build)

    def answer(self, key: str, make: Callable[[], T],
               keep: Callable[[T], bool] | None = None) -> T:
        """`make()`, a callback's answer built from this run's data (through this object:
        it is not called under the run's lock), recomputed only when the files changed;
        kept unless `keep(answer)` is false."""
        return self._cache.get(("answer", key, self.version()), make, keep)

    # --- what every click needs, cached ------------------------------------------------
    def step_index(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per kind (in recording order): its recorded steps and their iteration counts."""
        def build(run: Run) -> dict[str, tuple[list[int], list[int]]]:
            table = run.step_table()
            index: dict[str, tuple[list[int], list[int]]] = {}
            for step, kind, iterations in zip(table["step"].tolist(), table["kind"].tolist(),
                                              table["iterations"].tolist()):
                steps, counts = index.setdefault(kind, ([], []))
                steps.append(int(step))
                counts.append(int(iterations))
            return index
        return self.cached("step_index", build)

    def steps(self, kind: str) -> list[int]:
        return self.step_index().get(kind, ([], []))[0]

    def tensor_info(self) -> dict[str, dict[str, Any]]:
        """name -> role, node, role_in_node, shape, batch_dim (None for parameters)."""
        def build(run: Run) -> dict[str, dict[str, Any]]:
            out = {}
            for row in run.tensors().to_dict("records"):
                bd = row["batch_dim"]
                row["batch_dim"] = None if bd is None or bd != bd else int(bd)  # NaN: none
                out[row.pop("name")] = row
            return out
        return self.cached("tensor_info", build)

    def meta(self) -> dict[str, Any]:
        return self.cached("meta", lambda r: r.meta())

    def world_size(self) -> int:
        """Processes that recorded the run (1: single-process), read once: it is written
        with the run's meta, before any step."""
        if self._world is None:
            with self.reading() as run:
                world, present = run.world_size, run.ranks
                # a file still being created may have no meta yet (rank 0's may be missing)
                if present and run.meta(present[0]):
                    self._world = world
            return world
        return self._world

    def step_records(self, step: int, rank: str | int = "merged") -> pd.DataFrame:
        """Statistics of every tensor record of one step (rank: as `Run.stats_wide` takes
        it; default the global batch). A committed step never changes, so this is cached by
        step alone (an overwritten run gets a new `RunData`)."""
        def build() -> pd.DataFrame:
            with self.reading() as run:
                return run.stats_wide(step=step, rank=rank)
        return self._steps.get(step if rank == "merged" else (step, rank), build)

    def history(self, tensor: str, direction: str, iteration: int,
                kind: str, rank: str | int = "merged") -> pd.DataFrame:
        """Statistics of one tensor over all recorded steps of a kind: one SQL query (per
        rank), repeated only when the run changed (a step click reuses it). rank: as
        `Run.stats_wide` takes it (default: the global batch)."""
        return self.cached(f"history:{tensor}:{direction}:{iteration}:{kind}:{rank}",
                           lambda r: r.stats_wide(tensor, direction=direction,
                                                  iteration=iteration, kind=kind, rank=rank))

    def graph(self, step: int, iteration: int) -> dict[str, Any]:
        """The dependency graph of one step and iteration; recorded graphs never change."""
        return self._graphs.get((step, iteration), lambda: self._read_graph(step, iteration))

    def _read_graph(self, step: int, iteration: int) -> dict[str, Any]:
        with self.reading() as run:
            return run.graph(step, iteration=iteration)

    def quantities(self, name: str) -> pd.DataFrame:
        """All values of one instrument quantity (every layer and step), cached per version."""
        return self.cached(f"quantities:{name}", lambda r: r.quantities(name))

    def close(self) -> None:
        with self._lock:
            self.run.close()


class ProjectData:
    """The project folder the GUI serves; runs are discovered again on every call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._runs: OrderedDict[str, RunData] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def exists(self) -> bool:
        return self.path.is_dir()

    def runs(self) -> list[str]:
        """Run names, sorted; [] when the folder is missing or holds no runs yet."""
        if not self.exists():
            return []
        return Project(self.path).runs()

    def run(self, name: str) -> RunData:
        """The cached reader of run `name` (opened on first use; at most MAX_OPEN_RUNS stay
        open, so the GUI's memory is bounded whatever the number of runs)."""
        with self._lock:
            data = self._runs.get(name)
            if data is not None and data.stale():
                data.close()
                data = None
            if data is None:
                data = self._runs[name] = RunData(Project(self.path).run(name))
                while len(self._runs) > MAX_OPEN_RUNS:
                    # A request still holding it reads on: a closed Run reopens its reader.
                    self._runs.popitem(last=False)[1].close()
            self._runs.move_to_end(name)
            return data


def fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able structure (graph bodies, selections)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
