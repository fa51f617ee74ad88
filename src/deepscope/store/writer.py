"""The write path: a background thread that commits one transaction per step.

The training thread only builds payloads (device tensors included) and puts them on a bounded
queue; the writer copies them to the host, encodes and compresses them (zlib runs without the
GIL, beside training) and commits. A full queue either blocks the trainer (back-pressure, the
default) or drops whole steps with a counted warning. A failing disk disables recording with
one warning; what was committed stays readable.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..instruments.base import InstrumentWarning, QuantityValue
from . import arrays, codecs
from .schema import APPLICATION_ID, DDL, SCHEMA_VERSION, STAT_COLUMNS

log = logging.getLogger("deepscope")


@dataclass
class TensorInfo:
    """Static description of a named tensor (stored once per name)."""

    name: str
    role: str
    node: str
    role_in_node: str
    shape: list[int]
    dtype: str
    batch_dim: int | None


@dataclass
class StepSummary:
    """A recorded step's statistics and arrays, ready to insert.

    keys: (name, direction, iteration) of each row of `stats`, a (R, len(STAT_COLUMNS)) float64
    array (NaN = missing). parts: the step's arrays packed as little-endian bytes, one part per
    dtype; arrays: (name, direction, view, iteration, dtype, JSON shape, part, offset, nbytes)
    of each array, `offset` and `nbytes` in bytes within `parts[part]`. compress: per part,
    whether compressing it is worth its time (dense float32 values shrink by ~25% at ~60 MB/s:
    on large activations that would cost more than the whole summary); default all.
    """

    keys: list[tuple[str, str, int]]
    stats: np.ndarray
    arrays: list[tuple[str, str, str, int, str, str, int, int, int]]
    parts: list[bytes]
    compress: list[bool] | None = None


@dataclass
class StepPayload:
    """Everything one recorded step writes, committed as one transaction.

    summarise: called on the writer thread, returns the step's `StepSummary`: computing it
    there keeps the work off the training thread.
    """

    step: int
    kind: str
    wall_time: float
    iterations: int
    tensors: list[TensorInfo] = field(default_factory=list)
    summarise: Callable[[], StepSummary] | None = None
    graphs: dict[str, str] = field(default_factory=dict)
    iteration_graphs: list[tuple[int, str]] = field(default_factory=list)
    quantities: list[QuantityValue] = field(default_factory=list)
    anomalies: list[tuple[int, str, str, float | None, float | None, str]] = field(
        default_factory=list)


@dataclass
class _Kpis:
    rows: list[tuple[str, int, str, Any]]


@dataclass
class _Note:
    wall_time: float
    step: int | None
    text: str


@dataclass
class _Quantities:
    values: list[QuantityValue]


@dataclass
class _Anomalies:
    rows: list[tuple[int, str, str, float | None, float | None, str]]


@dataclass
class _Warnings:
    warnings: list[InstrumentWarning]


_STOP = object()


def connect(path: Path) -> sqlite3.Connection:
    """Open (or create) a store file for writing, WAL mode, schema ensured."""
    con = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives a killed process; only an OS crash can lose the last commits.
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute(f"PRAGMA application_id={APPLICATION_ID}")
    con.executescript(DDL)
    return con


class StoreWriter:
    """Owns one rank database of one run and the thread that writes it."""

    def __init__(self, path: Path, meta: dict[str, Any], *, resume: bool,
                 queue_size: int = 32, on_full: str = "block") -> None:
        if on_full not in ("block", "drop"):
            raise ValueError(f"on_full must be 'block' or 'drop', not {on_full!r}")
        self.path = path
        self.on_full = on_full
        self.dropped_steps = 0
        self.committed_steps = 0
        self.failed: str | None = None
        self._reported: set[str] = set()
        self._tensor_ids: dict[str, int] = {}
        self._con = connect(path)
        self._init_meta(meta, resume)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="deepscope-writer", daemon=True)
        self._thread.start()

    def _init_meta(self, meta: dict[str, Any], resume: bool) -> None:
        con = self._con
        stored = dict(con.execute("SELECT key, value FROM meta").fetchall())
        if stored:
            version = stored.get("schema_version")
            if version != str(SCHEMA_VERSION):
                raise ValueError(
                    f"{self.path} has schema version {version}, this deepscope writes "
                    f"{SCHEMA_VERSION}; record into a new run name")
            if not resume:
                raise ValueError(f"{self.path} already holds a run; pass resume=True")
        rows = {"schema_version": str(SCHEMA_VERSION),
                **{k: json.dumps(v) for k, v in meta.items()}}
        if not stored:
            rows["created"] = json.dumps(time.time())
        con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(rows.items()))
        self._tensor_ids = dict(con.execute("SELECT name, id FROM tensors").fetchall())

    def last_step(self) -> int | None:
        """The highest step with any data (recorded or KPI), for resuming."""
        row = self._con.execute(
            "SELECT max(s) FROM (SELECT max(step) s FROM steps UNION ALL "
            "SELECT max(step) FROM kpis)").fetchone()
        return row[0]

    # --- the training thread's side -------------------------------------------------------
    def submit_step(self, payload: StepPayload) -> bool:
        """Queue a step; False if it was dropped (queue full and on_full='drop') or disabled."""
        if self.failed:
            return False
        if self.on_full == "drop":
            try:
                self._queue.put_nowait(payload)
            except queue.Full:
                self.dropped_steps += 1
                if self.dropped_steps == 1 or self.dropped_steps % 100 == 0:
                    log.warning("deepscope: writer queue full, dropped %d whole step(s) so far; "
                                "record less often or use on_full='block'", self.dropped_steps)
                return False
        else:
            self._queue.put(payload)
        return True

    def submit_kpis(self, rows: list[tuple[str, int, str, Any]]) -> None:
        if not self.failed and rows:
            self._queue.put(_Kpis(rows))

    def submit_note(self, text: str, step: int | None) -> None:
        if not self.failed:
            self._queue.put(_Note(time.time(), step, text))

    def submit_quantities(self, values: list[QuantityValue]) -> None:
        if not self.failed and values:
            self._queue.put(_Quantities(values))

    def submit_anomalies(self, rows: list[tuple[int, str, str, float | None, float | None, str]]
                         ) -> None:
        if not self.failed and rows:
            self._queue.put(_Anomalies(rows))

    def submit_warnings(self, warnings: list[InstrumentWarning]) -> None:
        """Store recording warnings (the caller sends each distinct one once)."""
        if not self.failed and warnings:
            self._queue.put(_Warnings(warnings))

    def flush(self) -> None:
        """Block until everything queued so far is committed (or the writer failed)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # --- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    break
                if not self.failed:
                    self._write(item)
            except Exception as exc:  # disk full, unwritable, ...: never kill the training
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("deepscope: writing %s failed (%s); recording is disabled for this "
                            "run, training continues and committed steps stay readable",
                            self.path, self.failed)
            finally:
                self._queue.task_done()
        try:
            self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self._con.close()

    def _write(self, item: Any) -> None:
        con = self._con
        summary = self._summarise(item) if isinstance(item, StepPayload) else None
        if isinstance(item, StepPayload) and summary is None:
            return
        con.execute("BEGIN")
        try:
            if isinstance(item, StepPayload):
                self._write_step(item, summary)
            elif isinstance(item, _Kpis):
                con.executemany("INSERT OR REPLACE INTO kpis VALUES (?, ?, ?, ?)",
                                [(n, s, k, _to_float(v)) for n, s, k, v in item.rows])
            elif isinstance(item, _Note):
                con.execute("INSERT INTO notes (wall_time, step, text) VALUES (?, ?, ?)",
                            (item.wall_time, item.step, item.text))
            elif isinstance(item, _Quantities):
                self._write_quantities(item.values)
            elif isinstance(item, _Anomalies):
                self._write_anomalies(item.rows)
            elif isinstance(item, _Warnings):
                self._write_warnings(item.warnings)
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:  # SQLite itself rolls back on SQLITE_FULL / IOERR
                con.execute("ROLLBACK")
            raise
        if isinstance(item, StepPayload):
            self.committed_steps += 1

    def _summarise(self, p: StepPayload) -> StepSummary | None:
        """Run the step's summary; a failure there loses this step only, not the writer."""
        if p.summarise is None:
            return StepSummary([], np.zeros((0, len(STAT_COLUMNS))), [], [])
        try:
            return p.summarise()
        except Exception as exc:
            key = f"{type(exc).__name__}: {exc}"
            if key not in self._reported:
                self._reported.add(key)
                log.warning("deepscope: summarising step %d failed (%s); the step is skipped, "
                            "training continues", p.step, key)
            return None

    def _tensor_id(self, info: TensorInfo) -> int:
        tid = self._tensor_ids.get(info.name)
        if tid is None:
            cur = self._con.execute(
                "INSERT INTO tensors (name, role, node, role_in_node, shape, dtype, batch_dim) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (info.name, info.role, info.node, info.role_in_node, json.dumps(info.shape),
                 info.dtype, info.batch_dim))
            tid = self._tensor_ids[info.name] = int(cur.lastrowid)
        return tid

    def _write_step(self, p: StepPayload, summary: StepSummary) -> None:
        con = self._con
        ids = {t.name: self._tensor_id(t) for t in p.tensors}
        ids.update({n: self._tensor_ids[n] for n, _, _ in summary.keys if n not in ids})
        if summary.keys:
            marks = ", ".join("?" * (4 + len(STAT_COLUMNS)))
            con.executemany(
                f"INSERT OR REPLACE INTO records VALUES ({marks})",
                [(ids[name], direction, p.step, iteration, *[v if v == v else None for v in row])
                 for (name, direction, iteration), row in zip(summary.keys,
                                                              summary.stats.tolist())])
        if summary.arrays:
            # Each part holds one dtype; its element size picks the codec.
            itemsizes = {part: arrays.itemsize(dtype)
                         for _, _, _, _, dtype, _, part, _, _ in summary.arrays}
            blobs = []
            compress = summary.compress or [True] * len(summary.parts)
            for part, data in enumerate(summary.parts):
                codec, stored = (codecs.encode(data, itemsizes.get(part, 1)) if compress[part]
                                 else (codecs.RAW, data))
                blobs.append((p.step, part, codec, len(data), stored))
            con.executemany("INSERT OR REPLACE INTO step_blobs VALUES (?, ?, ?, ?, ?)", blobs)
            con.executemany(
                "INSERT OR REPLACE INTO arrays VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(ids.get(name) or self._tensor_ids[name], direction, view, p.step, iteration,
                  dtype, shape, part, offset, nbytes)
                 for name, direction, view, iteration, dtype, shape, part, offset, nbytes
                 in summary.arrays])
        con.executemany("INSERT OR IGNORE INTO graphs VALUES (?, ?)", list(p.graphs.items()))
        con.executemany("INSERT OR REPLACE INTO iterations VALUES (?, ?, ?)",
                        [(p.step, i, h) for i, h in p.iteration_graphs])
        self._write_quantities(p.quantities)
        self._write_anomalies(p.anomalies)
        # The steps row last: a reader that sees it sees the whole step (same transaction anyway).
        con.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?)",
                    (p.step, p.kind, p.wall_time, p.iterations))

    def _write_quantities(self, values: list[QuantityValue]) -> None:
        con = self._con
        for q in values:
            con.execute("INSERT OR REPLACE INTO quantities VALUES (?, ?, ?, ?, ?)",
                        (q.name, q.layer, q.step, _to_float(q.value),
                         json.dumps(q.meta, default=_json_default)))
            if q.array is not None:
                dtype, shape, data = arrays.encode(np.asarray(q.array))
                con.execute("INSERT OR REPLACE INTO quantity_arrays VALUES (?, ?, ?, ?, ?, ?)",
                            (q.name, q.layer, q.step, dtype, shape, data))

    def _write_warnings(self, warnings: list[InstrumentWarning]) -> None:
        # once per run, also across a resume: a resumed run warns again but stores nothing new
        self._con.executemany(
            "INSERT INTO warnings (step, location, quantities, message) SELECT ?, ?, ?, ? "
            "WHERE NOT EXISTS (SELECT 1 FROM warnings WHERE location = ? AND message = ?)",
            [(w.step, w.location, json.dumps(list(w.quantities)), w.message, w.location,
              w.message) for w in warnings])

    def _write_anomalies(self, rows: list[tuple]) -> None:
        self._con.executemany(
            "INSERT INTO anomalies (step, tensor, detector, value, threshold, message) "
            "VALUES (?, ?, ?, ?, ?, ?)", [(s, t, d, _to_float(v), _to_float(th), m)
                                           for s, t, d, v, th, m in rows])


def _to_float(v: Any) -> float | None:
    """Host float for a Python number or 0-d tensor; None for None. NaN is kept as NULL-free NaN."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item()
    return float(v)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.generic, torch.Tensor)):
        return obj.item() if getattr(obj, "ndim", 0) == 0 else obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} in quantity metadata")
