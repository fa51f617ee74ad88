"""Read a recorded run: pandas DataFrames and numpy arrays, safe while training writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import catalogue
from ..errors import CorruptRunError
from ..store.layout import check_links, rank_files
from ..store.reader import StoreReader
from ..store.schema import STAT_COLUMNS
from ..suggest import did_you_mean
from . import checks
from .histogram import Histogram

DIRECTIONS = ("forward", "grad")
# What the GUI calls a direction, accepted by every `direction=` argument.
DIRECTION_ALIASES = {"gradient": "grad"}


def check_direction(direction: str) -> str:
    """`direction` in stored spelling: "forward", "grad" or "grad:<group>" ("gradient" and
    "gradient:<group>" accepted); anything else is a one-line ValueError with did-you-mean."""
    head, sep, group = str(direction).partition(":")
    head = DIRECTION_ALIASES.get(head, head)
    if head == "grad" or (head == "forward" and not sep):
        return head + sep + group
    raise ValueError(did_you_mean(direction, [*DIRECTIONS, *DIRECTION_ALIASES, "grad:<group>"],
                                  "direction", known_as="use"))


class Run:
    """One run folder (`project/run`), one database per rank.

    Every method takes `rank=` (default 0). Methods return fresh data on each call, so a
    reader sees steps appear while a writer records (committed steps only).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_links(self.path)
        files = rank_files(self.path)
        if not files:
            raise ValueError(f"no deepscope run at {self.path}: expected rank<N>.sqlite files "
                             "inside; pass a run folder such as runs/baseline")
        self.name = self.path.name
        self._files = files
        self._readers: dict[int, StoreReader] = {}

    @property
    def ranks(self) -> list[int]:
        """The process ranks that wrote this run (one database each), ascending."""
        return list(self._files)

    def _r(self, rank: int) -> StoreReader:
        if rank not in self._files:
            raise ValueError(f"run {self.name!r} has no rank {rank}; ranks: {self.ranks}")
        reader = self._readers.get(rank)
        if reader is None:
            reader = self._readers[rank] = StoreReader(self._files[rank])
        return reader

    def _check(self, what: str, name: str, sql: str, rank: int,
               also: tuple[str, ...] = ()) -> None:
        """KeyError with did-you-mean unless `name` is among `sql`'s names (or `also`)."""
        if name in also:
            return
        known = [n for (n,) in self._r(rank).query(sql)]
        if name not in known:
            raise KeyError(did_you_mean(name, known, what))

    def _check_tensor(self, tensor: str, rank: int) -> None:
        self._check("tensor", tensor, "SELECT name FROM tensors", rank)

    def _check_step(self, step: int, rank: int) -> None:
        """KeyError naming the nearest recorded steps unless `step` was recorded."""
        r = self._r(rank)
        if r.query("SELECT 1 FROM steps WHERE step = ?", (step,)):
            return
        before = r.query("SELECT MAX(step) FROM steps WHERE step < ?", (step,))[0][0]
        after = r.query("SELECT MIN(step) FROM steps WHERE step > ?", (step,))[0][0]
        near = [s for s in (before, after) if s is not None]
        raise KeyError(f"step {step} was not recorded in run {self.name!r}; nearest: "
                       + (", ".join(map(str, near)) or "none (no recorded step)"))

    def close(self) -> None:
        """Close the open databases (a later call reopens them)."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- run-level ------------------------------------------------------------------------
    def meta(self, rank: int = 0) -> dict[str, Any]:
        """What the recorder stored about the run (schema version, schedule, torch, ...)."""
        return self._r(rank).meta()

    def status(self, rank: int = 0) -> str:
        """How the run (one rank) stands: "recording" (a writer holds it now), "finished"
        (closed normally), "interrupted: <ErrorType>: <message>" (closed by an exception in
        training), "crashed" (its writer died without closing it, e.g. killed: every
        committed step is readable), or "unknown" (recorded before deepscope stored this)."""
        stored = self.meta(rank).get("status")
        if stored is None:
            return "unknown"
        if stored != "recording":
            return str(stored)
        from ..store.writer import RunLock  # the writer's lock tells a live run from a dead one
        return "recording" if RunLock.is_held(self._files[rank]) else "crashed"

    def size_bytes(self) -> int:
        """Bytes on disk of all rank files (with their write-ahead logs)."""
        return sum(p.stat().st_size for f in self._files.values()
                   for p in (f, f.with_name(f.name + "-wal")) if p.exists())

    def kinds(self, rank: int = 0) -> list[str]:
        """Step kinds seen in recorded steps or logged KPIs, sorted."""
        rows = self._r(rank).query(
            "SELECT kind FROM steps UNION SELECT kind FROM kpis ORDER BY 1")
        return checks.texts([k for (k,) in rows], "steps", "kind", self._r(rank).path)

    def steps(self, kind: str | None = None, rank: int = 0) -> list[int]:
        """Recorded steps (with tensor data), ascending."""
        sql, args = "SELECT step FROM steps", ()
        if kind is not None:
            sql, args = sql + " WHERE kind = ?", (kind,)
        return [s for (s,) in self._r(rank).query(sql + " ORDER BY step", args)]

    def step_table(self, rank: int = 0) -> pd.DataFrame:
        """One row per recorded step: step, kind, iterations, wall_time."""
        rows = self._r(rank).query(
            "SELECT step, kind, iterations, wall_time FROM steps ORDER BY step")
        return checks.table(pd.DataFrame(rows, columns=["step", "kind", "iterations",
                                                        "wall_time"]), "steps",
                            self._r(rank).path, ints=["step"], texts_=["kind"],
                            numbers_=["wall_time"],
                            counts={"iterations": checks.limits.MAX_ITERATIONS})

    def tensors(self, rank: int = 0) -> pd.DataFrame:
        """Named tensors: name, role, node, role_in_node, shape (first seen), dtype, batch_dim."""
        r = self._r(rank)
        rows = r.query("SELECT name, role, node, role_in_node, shape, dtype, batch_dim "
                       "FROM tensors ORDER BY id")
        df = pd.DataFrame(rows, columns=["name", "role", "node", "role_in_node", "shape",
                                         "dtype", "batch_dim"])
        for column in ("name", "role", "node", "role_in_node", "dtype"):
            checks.texts(df[column], "tensors", column, r.path)
        df["shape"] = [checks.shape(r.decode_json(s, "tensor shape"), r.path)
                       for s in df["shape"]]
        checks.integers((row[6] for row in rows if row[6] is not None), "tensors",
                        "batch_dim", r.path)
        return df

    # --- tensor records -------------------------------------------------------------------
    def stats_wide(self, tensor: str | None = None, *, direction: str | None = None,
                   step: int | None = None, iteration: int | None = None,
                   kind: str | None = None, rank: int = 0) -> pd.DataFrame:
        """Statistics with one column per statistic (see `STAT_COLUMNS`), one row per record.

        An unknown tensor or unrecorded step raises KeyError naming the closest ones.
        """
        if tensor is not None:
            self._check_tensor(tensor, rank)
        if direction is not None:
            direction = check_direction(direction)
        if step is not None:
            self._check_step(step, rank)
        where, args = [], []
        for col, val in (("t.name", tensor), ("r.direction", direction), ("r.step", step),
                         ("r.iteration", iteration), ("s.kind", kind)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = ("SELECT r.step, r.iteration, t.name, r.direction, "
               + ", ".join(f"r.{c}" for c in STAT_COLUMNS)
               + " FROM records r JOIN tensors t ON t.id = r.tensor_id "
               "JOIN steps s ON s.step = r.step")
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._r(rank).query(sql + " ORDER BY r.step, r.iteration, t.id, r.direction",
                                   args)
        df = pd.DataFrame(rows, columns=["step", "iteration", "tensor", "direction",
                                         *STAT_COLUMNS])
        return checks.table(df, "records", self._r(rank).path, ints=["step", "iteration"],
                            numbers_=STAT_COLUMNS)

    def stats(self, tensor: str | None = None, *, direction: str | None = None,
              statistic: str | None = None, step: int | None = None,
              iteration: int | None = None, kind: str | None = None,
              rank: int = 0) -> pd.DataFrame:
        """Long table: step, iteration, tensor, direction, statistic, value.

        direction: "forward", "grad" (or "gradient"), or "grad:<group>" for
        `rec.gradients(group)` snapshots.
        """
        if statistic is not None and statistic not in STAT_COLUMNS:
            raise ValueError(f"unknown statistic {statistic!r}; use one of "
                             f"{', '.join(STAT_COLUMNS)}")
        wide = self.stats_wide(tensor, direction=direction, step=step, iteration=iteration,
                               kind=kind, rank=rank)
        cols = [statistic] if statistic else list(STAT_COLUMNS)
        return wide.melt(id_vars=["step", "iteration", "tensor", "direction"], value_vars=cols,
                         var_name="statistic", value_name="value")

    def views(self, tensor: str, step: int, *, iteration: int = 0,
              direction: str = "forward", rank: int = 0) -> list[str]:
        """Array views stored for one tensor record (neuron_mean, samples, ...)."""
        direction = check_direction(direction)
        rows = self._r(rank).query(
            "SELECT a.view FROM arrays a JOIN tensors t ON t.id = a.tensor_id WHERE t.name = ? "
            "AND a.step = ? AND a.iteration = ? AND a.direction = ? ORDER BY a.view",
            (tensor, step, iteration, direction))
        return [v for (v,) in rows]

    def values(self, tensor: str, step: int, *, view: str = "neuron_mean", iteration: int = 0,
               direction: str = "forward", rank: int = 0) -> np.ndarray:
        """One array view of a tensor record.

        Views: neuron_mean / neuron_std / neuron_abs_max (per neuron, over the batch; for
        parameters per index of dim 0), sample_mean / sample_std / sample_abs_max (per batch
        item) — stored as bfloat16 unless the scope had exact_views=True — and samples (full
        float32 values of the first max_samples items). Returned as float32/float64.
        An unknown tensor or unrecorded step raises KeyError naming the closest ones.
        """
        self._check_tensor(tensor, rank)
        self._check_step(step, rank)
        direction = check_direction(direction)
        r = self._r(rank)
        rows = r.query(
            "SELECT a.dtype, a.shape, a.part, a.offset, a.nbytes FROM arrays a "
            "JOIN tensors t ON t.id = a.tensor_id WHERE t.name = ? AND a.step = ? "
            "AND a.iteration = ? AND a.direction = ? AND a.view = ?",
            (tensor, step, iteration, direction, view))
        if not rows:
            have = self.views(tensor, step, iteration=iteration, direction=direction, rank=rank)
            if view in have:  # listed, yet not found by its key: a damaged index
                raise CorruptRunError(f"{r.path}: view {view!r} of {tensor!r} at step {step} "
                                      "is listed but unreadable; the file is damaged")
            raise KeyError(f"no view {view!r} of {tensor!r} ({direction}) at step {step}, "
                           f"iteration {iteration}; stored views: {have or 'none'}")
        dtype, shape, part, offset, nbytes = rows[0]
        return r.decode_slice(dtype, shape, offset, nbytes, r.step_part(step, part))

    # --- graph ----------------------------------------------------------------------------
    def graph(self, step: int | None = None, *, kind: str | None = None, iteration: int = 0,
              rank: int = 0) -> dict[str, Any]:
        """The dependency graph of one recorded step (default: the last one of `kind`).

        Returns {"tensors": [{name, role, node}], "edges": [{source, target, lag, manual}],
        "nodes": [{id, role, tensors}]}; edges are between tensors, `lag` = iterations back.
        """
        r = self._r(rank)
        if step is None:
            steps = self.steps(kind, rank)
            if not steps:
                raise ValueError(f"run {self.name!r} has no recorded step"
                                 + (f" of kind {kind!r}" if kind else ""))
            step = steps[-1]
        rows = r.query("SELECT g.body FROM iterations i JOIN graphs g ON g.hash = i.graph "
                       "WHERE i.step = ? AND i.iteration = ?", (step, iteration))
        if not rows:
            raise ValueError(f"no graph for step {step}, iteration {iteration} in run "
                             f"{self.name!r}")
        body = r.decode_graph(rows[0][0])
        nodes: dict[str, dict] = {}
        for t in body.get("tensors", []):
            n = nodes.setdefault(t["node"], {"id": t["node"], "role": t["role"], "tensors": []})
            n["tensors"].append(t["name"])
        body["nodes"] = list(nodes.values())
        return body

    # --- scalars --------------------------------------------------------------------------
    def kpis(self, name: str | None = None, rank: int = 0) -> pd.DataFrame:
        """KPIs logged on every step: step, kind, name, value (NaN if it was not finite).
        A name never logged raises KeyError naming the closest logged ones."""
        sql, args = "SELECT step, kind, name, value FROM kpis", ()
        if name is not None:
            self._check("kpi", name, "SELECT DISTINCT name FROM kpis", rank)
            sql, args = sql + " WHERE name = ?", (name,)
        rows = self._r(rank).query(sql + " ORDER BY name, step", args)
        df = pd.DataFrame(rows, columns=["step", "kind", "name", "value"])
        return checks.table(df, "kpis", self._r(rank).path, ints=["step"], texts_=["name"],
                            numbers_=["value"])

    def notes(self, rank: int = 0) -> pd.DataFrame:
        """Notes (`scope.note`): wall_time (seconds since the epoch), step, text."""
        rows = self._r(rank).query("SELECT wall_time, step, text FROM notes ORDER BY id")
        return checks.table(pd.DataFrame(rows, columns=["wall_time", "step", "text"]), "notes",
                            self._r(rank).path, texts_=["text"], numbers_=["wall_time"])

    def quantities(self, name: str | None = None, layer: str | None = None,
                   rank: int = 0) -> pd.DataFrame:
        """Instrument values: one row per (name, layer, step), value NaN when missing.

        Columns: step, name, layer ("" = whole model), value, then one column per metadata
        key (estimator, samples, reason, ...; nested keys joined by ".", e.g. "Alpha.tau";
        a key named like a base column gets the prefix "meta."), None/NaN where a row lacks
        the key, and last `meta`: the row's metadata as one dict, kept for code written when
        it was the only metadata column.

        A quantity of the catalogue that was not tracked gives an empty table; another
        name, or a layer no quantity was recorded for, raises KeyError with did-you-mean.
        """
        if name is not None:
            self._check("quantity", name, "SELECT DISTINCT name FROM quantities", rank,
                        also=catalogue.names())
        if layer:
            self._check("layer", layer, "SELECT DISTINCT layer FROM quantities WHERE layer != ''",
                        rank)
        where, args = [], []
        for col, val in (("name", name), ("layer", layer)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = "SELECT step, name, layer, value, meta FROM quantities"
        if where:
            sql += " WHERE " + " AND ".join(where)
        r = self._r(rank)
        rows = r.query(sql + " ORDER BY name, layer, step", args)
        base = ["step", "name", "layer", "value"]
        metas = []
        records = []
        checks.integers((row[0] for row in rows), "quantities", "step", r.path)
        checks.numeric((row[3] for row in rows), "quantities", "value", r.path)
        for step, qname, qlayer, value, meta in rows:
            m = r.decode_json(meta, "quantity metadata")
            metas.append(m if isinstance(m, dict) else {})
            records.append((step, qname, qlayer, np.nan if value is None else float(value)))
        df = pd.DataFrame(records, columns=base)
        flat = pd.json_normalize(metas) if metas else pd.DataFrame(index=df.index)
        flat = flat.rename(columns={c: f"meta.{c}" for c in flat.columns if c in (*base, "meta")})
        df = pd.concat([df, flat[sorted(flat.columns)]], axis=1)
        df["meta"] = pd.Series(metas, index=df.index, dtype=object)
        return df

    def histogram(self, name: str, step: int, layer: str = "", rank: int = 0, *,
                  missing_ok: bool = False) -> Histogram:
        """The histogram `name` (GradHist1d, GradHist2d) at `step` of `layer` ("" = whole
        model): counts, edges per axis, the counts outside the bins, metadata. Unpacks as
        `counts, meta`.

        A histogram recorded as missing (it could not be computed at that step) raises
        KeyError naming the stored reason, or with missing_ok=True is returned with counts
        None and its `reason`. One never recorded raises KeyError.
        """
        r = self._r(rank)
        rows = r.query("SELECT a.dtype, a.shape, a.data, q.meta FROM quantities q LEFT JOIN "
                       "quantity_arrays a USING (name, layer, step) WHERE q.name = ? AND "
                       "q.layer = ? AND q.step = ?", (name, layer, step))
        meta = r.decode_json(rows[0][3], "histogram metadata") if rows else None
        if not rows or (rows[0][2] is None and not (isinstance(meta, dict)
                                                    and meta.get("reason"))):
            raise KeyError(f"no {name} histogram at step {step} for layer {layer!r}")
        dtype, shape, data, _ = rows[0]
        if data is None:
            value = Histogram.decode(name, step, layer, None, meta)
            if not missing_ok:
                raise KeyError(f"{name} at step {step} for layer {layer!r} was recorded as "
                               f"missing: {value.reason}")
            return value
        counts = r.decode_array(dtype, shape, data)
        checks.histogram(counts, meta, r.path, f"{name} histogram metadata at step {step}")
        return Histogram.decode(name, step, layer, counts, meta)

    def anomalies(self, rank: int = 0) -> pd.DataFrame:
        """Health-check findings: step, kind (of the step; "" if it was neither recorded nor
        logged a KPI), tensor, detector, value, threshold, message."""
        rows = self._r(rank).query(
            "SELECT a.step, COALESCE((SELECT kind FROM steps s WHERE s.step = a.step), "
            "(SELECT kind FROM kpis k WHERE k.step = a.step LIMIT 1), ''), a.tensor, "
            "a.detector, a.value, a.threshold, a.message FROM anomalies a ORDER BY a.step, a.id")
        return checks.table(pd.DataFrame(rows, columns=["step", "kind", "tensor", "detector",
                                                        "value", "threshold", "message"]),
                            "anomalies", self._r(rank).path, ints=["step"],
                            texts_=["kind", "tensor", "detector", "message"],
                            numbers_=["value", "threshold"])

    def diagnoses(self, rank: int = 0, threshold: float | None = None) -> pd.DataFrame:
        """Likely bugs named from the recorded evidence, most likely first: code, confidence
        (0-1), step (first step it holds), where (tensor/layer), summary, evidence (the numbers,
        a dict), fix. threshold: lowest confidence listed (default: the reporting threshold,
        0.5; 0 lists every candidate). See docs/diagnosis.md."""
        from ..diagnosis import THRESHOLD, diagnose, frame  # heavy logic, loaded on use
        return frame(diagnose(self, rank, THRESHOLD if threshold is None else threshold))

    def warnings(self, rank: int = 0) -> pd.DataFrame:
        """Recording warnings, each distinct one once, in the order they occurred: step (the
        first step it occurred at; None outside a step), location (a module or parameter
        label, "" for the whole model), quantities (list of the instrument quantities it
        affects), message. Runs recorded before warnings were stored give an empty table."""
        columns = ["step", "location", "quantities", "message"]
        r = self._r(rank)
        if "warnings" not in r.optional_tables:
            return pd.DataFrame([], columns=columns)
        rows = r.query("SELECT step, location, quantities, message FROM warnings ORDER BY id")
        records = []
        for step, location, quantities, message in rows:
            names = r.decode_json(quantities, "warning quantities")
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise CorruptRunError(f"{r.path}: stored warning quantities are not a list of "
                                      "names; the file is damaged")
            records.append((step, location, names, message))
        return checks.table(pd.DataFrame(records, columns=columns), "warnings", r.path,
                            texts_=["location", "message"])


def open_run(path: str | Path) -> Run:
    """Open a recorded run folder for reading."""
    return Run(path)
