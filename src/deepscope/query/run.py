"""Read a recorded run: pandas DataFrames and numpy arrays, safe while training writes it."""

from __future__ import annotations

import warnings as _warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from .. import catalogue
from ..errors import CorruptRunError, DeepscopeWarning
from ..store.layout import check_links, is_run_dir, rank_files
from ..store.reader import StoreReader
from ..store.schema import OPTIONAL_TABLES, STAT_COLUMNS
from ..suggest import did_you_mean
from . import checks, merge, ranks
from .histogram import Histogram

DIRECTIONS = ("forward", "grad")
# What the GUI calls a direction, accepted by every `direction=` argument.
DIRECTION_ALIASES = {"gradient": "grad"}
# rank= of the methods that read several ranks: one rank, every rank (a `rank` column) or the
# global batch combined from them
RankChoice = int | Literal["merged", "all"]
SAMPLE_VIEWS = ("sample_mean", "sample_std", "sample_abs_max", "samples")  # one row per item


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

    Every method takes `rank=`: most default to rank 0; `stats` / `stats_wide` default to
    the global batch merged from every rank, `quantities` to the global values, `samples`,
    `warnings` and `anomalies` to every rank (see docs/distributed.md, "Reading"). Methods
    return fresh data on each call, so a reader sees steps appear while a writer records
    (committed steps only).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_links(self.path)
        files = rank_files(self.path)
        if not files:
            # a Scope's folder holds its runs (Scope("runs") records into runs/run): name them
            inner = sorted(p.name for p in self.path.iterdir()
                           if p.is_dir() and is_run_dir(p)) if self.path.is_dir() else []
            hint = (f"; it holds the run(s) {', '.join(inner[:5])}: pass "
                    f"{self.path / inner[0]}" if inner else "")
            raise ValueError(f"no deepscope run at {self.path}: expected rank<N>.sqlite files "
                             f"inside; pass a run folder such as runs/baseline{hint}")
        self.name = self.path.name
        self._files = files
        self._readers: dict[int, StoreReader] = {}
        self._manifest: tuple[tuple, ranks.Manifest] | None = None

    # --- ranks ----------------------------------------------------------------------------
    def manifest(self) -> ranks.Manifest:
        """The run's ranks as its files say (checked; see `query.ranks`). Rank files that
        appeared since the last call are read; each one left out is warned about once."""
        files = rank_files(self.path)
        key = tuple(files.items())
        if self._manifest is None or self._manifest[0] != key:
            for rank in set(self._files) - set(files):  # a file removed: forget its reader
                reader = self._readers.pop(rank, None)
                if reader is not None:
                    reader.close()
            self._files = files or self._files
            metas: dict[int, Any] = {}
            for rank in self._files:
                try:
                    metas[rank] = self._r(rank).meta()
                except CorruptRunError as exc:
                    metas[rank] = exc
            built = ranks.build(metas, self._files)
            known = self._manifest[1].problems if self._manifest else {}
            ranks.warn_left_out(self._files, {r: why for r, why in built.problems.items()
                                              if known.get(r) != why})
            self._manifest = (key, built)
        return self._manifest[1]

    @property
    def ranks(self) -> list[int]:
        """The ranks with a readable file that belongs to this run, ascending (a rank file of
        another run, or a damaged one, is left out with a warning: see `rank_status`)."""
        return list(self.manifest().ranks)

    @property
    def world_size(self) -> int:
        """The number of processes that recorded the run (its manifest; 1 for a
        single-process run)."""
        return self.manifest().world_size

    def rank_status(self) -> pd.DataFrame:
        """One row per rank (every rank below the world size, and any other rank file):
        rank; status ("missing": no file, "left out": a file refused (unreadable, or of
        another run), else `status(rank)`: recording / finished / interrupted: ... /
        crashed / unknown); steps (recorded steps); last_step (the highest step with data,
        recorded or a KPI; <NA> without one); problem ("" when none, else why, one line)."""
        m = self.manifest()
        rows = []
        for rank in sorted(set(range(m.world_size)) | set(self._files)):
            if rank in m.ranks:
                status = self.status(rank)
                r = self._r(rank)
                (steps,), = r.query("SELECT COUNT(*) FROM steps")
                (last,), = r.query("SELECT MAX(s) FROM (SELECT MAX(step) s FROM steps "
                                   "UNION ALL SELECT MAX(step) FROM kpis)")
                problem = {"crashed": "its writer stopped without closing the file (killed?): "
                           f"the steps it committed, up to {last}, are readable"}.get(status, "")
                if status.startswith("interrupted"):
                    problem = "training stopped by an exception (see status)"
            elif rank in m.problems:
                status, steps, last, problem = "left out", 0, None, m.problems[rank]
            else:
                status, steps, last = "missing", 0, None
                problem = (f"no file rank{rank}.sqlite: the rank never wrote, or its file was "
                           "removed")
            rows.append((rank, status, steps, last, problem))
        checks.integers((row[3] for row in rows if row[3] is not None), "steps", "step",
                        self.path)
        df = pd.DataFrame(rows, columns=["rank", "status", "steps", "last_step", "problem"])
        df["last_step"] = df["last_step"].astype("Int64")
        return df

    def _several(self) -> bool:
        """Whether tables of every rank get a `rank` column (several processes or files)."""
        m = self.manifest()
        return m.world_size > 1 or len(m.ranks) > 1

    def _choose(self, rank: RankChoice) -> list[int] | None:
        """The ranks `rank=` reads: [rank] for an int, every readable rank for "all", None for
        "merged" (the caller merges)."""
        if rank in ("merged", "all"):
            return None if rank == "merged" else self.ranks
        if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)):
            raise ValueError(f"rank must be a rank number, 'merged' or 'all', not {rank!r}")
        rank = int(rank)  # a numpy integer, e.g. from rank_status()
        why = self.manifest().problems.get(rank)
        if why:
            raise CorruptRunError(f"{self._files[rank]} is left out of run {self.name!r}: "
                                  f"{why}; move it to a run folder of its own to read it")
        return [rank]

    def _r(self, rank: int) -> StoreReader:
        if rank not in self._files:
            raise ValueError(f"run {self.name!r} has no rank {rank}; ranks: {list(self._files)}")
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
                   kind: str | None = None, rank: RankChoice = "merged") -> pd.DataFrame:
        """Statistics with one column per statistic (see `STAT_COLUMNS`), one row per record.

        rank: "merged" (default): statistics of the global batch, each record combined
        exactly from every rank's record of the same step / iteration / direction (see
        docs/distributed.md): tensors with a batch dimension are merged (needing a record
        from every rank of the world size, else NaN with a warning); the others
        (parameters and their gradients, the same on every rank after DDP's sync) are rank
        0's (the lowest readable rank's without rank 0), with a warning if the ranks'
        records differ. sv_max cannot be merged: NaN for merged records. A single-process
        run reads rank 0 unchanged. An int: that rank's own records. "all": every rank's
        records, a `rank` column first.

        An unknown tensor or unrecorded step raises KeyError naming the closest ones.
        """
        if direction is not None:
            direction = check_direction(direction)
        chosen = self._choose(rank)
        query = (tensor, direction, step, iteration, kind)
        if chosen is None and self.manifest().distributed is None:
            chosen = [0]  # a single-process run: its one rank's records, unchanged
        if rank != "all" and chosen is not None:
            return self._stats_wide(*query, chosen[0])
        ref = self.ranks[0]
        frames = pd.concat([self._stats_wide(*query, r, check=r == ref)
                           .assign(rank=r) for r in self.ranks], ignore_index=True)
        if rank == "all":
            return frames[["rank", *frames.columns[:-1]]]
        return self._merged(frames)

    def _merged(self, frames: pd.DataFrame) -> pd.DataFrame:
        """The global batch's records from every rank's (see `stats_wide`)."""
        batched: set[str] = set()
        order: dict[str, int] = {}
        for r in self.ranks:
            for name, batch_dim in self._r(r).query(
                    "SELECT name, batch_dim FROM tensors ORDER BY id"):
                order.setdefault(name, len(order))
                if batch_dim is not None:
                    batched.add(name)
        m = self.manifest()
        out, incomplete, differing = merge.merge(frames, batched, m.world_size)
        if incomplete:
            absent = [r for r in range(m.world_size) if r not in m.ranks]
            _warnings.warn(
                f"run {self.name!r}: merged statistics of {_some(incomplete)} are NaN where a "
                "rank has no record"
                + (f" (rank {', '.join(map(str, absent))} has no readable file)" if absent
                   else "")
                + ": they would describe part of the global batch only; pass rank=<n> for "
                "one rank's own records", DeepscopeWarning, stacklevel=3)
        if differing:
            _warnings.warn(
                f"run {self.name!r}: records of {_some(differing)} (no batch dimension) "
                f"differ between ranks; merged shows rank {self.ranks[0]}'s: pass rank='all' "
                "to compare them", DeepscopeWarning, stacklevel=3)
        out["_order"] = out["tensor"].map(order)
        return (out.sort_values(["step", "iteration", "_order", "direction"], kind="stable")
                .drop(columns="_order").reset_index(drop=True))

    def _stats_wide(self, tensor: str | None, direction: str | None, step: int | None,
                    iteration: int | None, kind: str | None, rank: int,
                    check: bool = True) -> pd.DataFrame:
        """One rank's records; `check`: an unknown tensor or step is a KeyError (else: no
        rows, for a rank that has no record of it)."""
        if tensor is not None and check:
            self._check_tensor(tensor, rank)
        if step is not None and check:
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
              rank: RankChoice = "merged") -> pd.DataFrame:
        """Long table: step, iteration, tensor, direction, statistic, value (rank="all": a
        `rank` column first).

        direction: "forward", "grad" (or "gradient"), or "grad:<group>" for
        `rec.gradients(group)` snapshots. rank: "merged" (default: the global batch), a rank
        number or "all", as for `stats_wide`.
        """
        if statistic is not None and statistic not in STAT_COLUMNS:
            raise ValueError(f"unknown statistic {statistic!r}; use one of "
                             f"{', '.join(STAT_COLUMNS)}")
        wide = self.stats_wide(tensor, direction=direction, step=step, iteration=iteration,
                               kind=kind, rank=rank)
        cols = [statistic] if statistic else list(STAT_COLUMNS)
        ids = [c for c in wide.columns if c not in STAT_COLUMNS]
        return wide.melt(id_vars=ids, value_vars=cols, var_name="statistic", value_name="value")

    def views(self, tensor: str, step: int, *, iteration: int = 0,
              direction: str = "forward", rank: int = 0) -> list[str]:
        """Array views stored for one tensor record (neuron_mean, samples, ...)."""
        direction = check_direction(direction)
        return sorted(self._r(rank).record_arrays(tensor, step, iteration, direction), key=str)

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
        stored = r.record_arrays(tensor, step, iteration, direction)
        if view not in stored:
            have = sorted(stored, key=str)
            raise KeyError(f"no view {view!r} of {tensor!r} ({direction}) at step {step}, "
                           f"iteration {iteration}; stored views: {have or 'none'}")
        dtype, shape, part, offset, nbytes = stored[view]
        return r.decode_slice(dtype, shape, offset, nbytes, r.step_part(step, part))

    def samples(self, tensor: str, step: int, *, view: str = "sample_mean",
                iteration: int = 0, direction: str = "forward",
                rank: RankChoice = "all") -> pd.DataFrame:
        """One row per stored batch item of a tensor record: rank, sample (the item's index
        in the global batch: the concatenation of the ranks' micro-batches in rank order),
        local_sample (its index in its rank's micro-batch), global_index (False where the
        global index is unknown: then `sample` is the local index, with a warning), value.

        view: sample_mean / sample_std / sample_abs_max (value: a float over the item's
        elements) or samples (value: the item's stored values, an array). The global index
        adds the "BatchSize" local values of the lower ranks at that step; it is unknown when
        one of them was not recorded (a missing rank, a recorder that did not store it) or
        the step has several micro-batches (iterations). rank: "all" or "merged" (default:
        every rank's items) or a rank number. A single-process run's index is its own.
        """
        if view not in SAMPLE_VIEWS:
            raise ValueError(f"view {view!r} has no row per batch item; use one of "
                             f"{', '.join(SAMPLE_VIEWS)} (run.values reads the others)")
        chosen = self._choose(rank) or self.ranks
        m = self.manifest()
        ref = self.ranks[0] if len(chosen) > 1 else chosen[0]
        frames, local = [], []
        for r in chosen:
            try:
                values = self.values(tensor, step, view=view, iteration=iteration,
                                     direction=direction, rank=r)
            except KeyError:
                if r == ref:
                    raise
                continue  # this rank has no such record (crashed before it): no items
            offset = self._sample_offset(r, step) if m.distributed is not None else 0
            if offset is None:
                local.append(r)
            items = range(len(values))
            frames.append(pd.DataFrame({
                "rank": r, "sample": [i + (offset or 0) for i in items], "local_sample": items,
                "global_index": offset is not None,
                "value": list(values) if view == "samples" else values.astype(float)}))
        if local:
            _warnings.warn(
                f"run {self.name!r}, step {step}: the global batch index of rank "
                f"{', '.join(map(str, local))}'s items is unknown (a lower rank's BatchSize "
                "was not recorded, or the step has several micro-batches): their `sample` "
                "is the local index, global_index False", DeepscopeWarning, stacklevel=2)
        return pd.concat(frames, ignore_index=True)

    def _sample_offset(self, rank: int, step: int) -> int | None:
        """Items of the lower ranks in the global batch at `step` (their "BatchSize" local
        values), or None when unknown."""
        m = self.manifest()
        total = 0
        for r in range(rank + 1):
            if r not in m.ranks:
                return None
            reader = self._r(r)
            rows = reader.query("SELECT iterations FROM steps WHERE step = ?", (step,))
            if rows and rows[0][0] != 1:
                return None  # micro-batches: BatchSize is per step, items per iteration
            if r == rank:
                return total
            size = (reader.query("SELECT value FROM local_quantities WHERE name = 'BatchSize' "
                                 "AND layer = '' AND step = ?", (step,))
                    if "local_quantities" in reader.optional_tables else [])
            value = size[0][0] if size else None
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and 0 <= value <= checks.limits.MAX_TENSOR_NUMEL and value == int(value)):
                return None
            total += int(value)
        return total

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
                   rank: int | Literal["all"] | None = None) -> pd.DataFrame:
        """Instrument values: one row per (name, layer, step), value NaN when missing.

        Columns: step, name, layer ("" = whole model), value, then one column per metadata
        key (estimator, samples, reason, ...; nested keys joined by ".", e.g. "Alpha.tau";
        a key named like a base column gets the prefix "meta."), None/NaN where a row lacks
        the key, and last `meta`: the row's metadata as one dict, kept for code written when
        it was the only metadata column.

        rank: None (default): the global values (rank 0's file holds them); a rank number:
        that rank's local values, of its own micro-batch (a distributed run's
        `local_quantities`: Loss, GradNorm, BatchSize; in a single-process file all its
        values are its own, so its values as for None); "all": every rank's local values,
        a `rank` column first.

        A quantity of the catalogue that was not tracked gives an empty table; another
        name, or a layer no quantity was recorded for, raises KeyError with did-you-mean.
        """
        if rank is None:
            return self._quantities(name, layer, 0, "quantities")
        chosen = self.ranks if rank == "all" else self._choose(rank)
        if rank != "all" and chosen is None:  # "merged": the global values are merged
            return self._quantities(name, layer, 0, "quantities")
        table = "local_quantities" if self.manifest().distributed is not None else "quantities"
        frames = [self._quantities(name, layer, r, table) for r in chosen]
        if rank != "all":
            return frames[0]
        df = pd.concat([f.assign(rank=r) for r, f in zip(chosen, frames)], ignore_index=True)
        first = ["rank", "step", "name", "layer", "value"]
        return df[first + [c for c in df.columns if c not in (*first, "meta")] + ["meta"]]

    def _quantities(self, name: str | None, layer: str | None, rank: int,
                    table: str) -> pd.DataFrame:
        """One rank's rows of `table` (quantities or local_quantities: an optional table,
        read as empty where a file lacks it)."""
        r = self._r(rank)
        present = table not in OPTIONAL_TABLES or table in r.optional_tables
        nothing = "SELECT NULL WHERE 0"  # a file without the optional table: no names
        if name is not None:
            self._check("quantity", name, f"SELECT DISTINCT name FROM {table}" if present
                        else nothing, rank, also=catalogue.names())
        if layer:
            self._check("layer", layer, f"SELECT DISTINCT layer FROM {table} WHERE layer != ''"
                        if present else nothing, rank)
        where, args = [], []
        for col, val in (("name", name), ("layer", layer)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = f"SELECT step, name, layer, value, meta FROM {table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = r.query(sql + " ORDER BY name, layer, step", args) if present else []
        base = ["step", "name", "layer", "value"]
        metas = []
        records = []
        checks.integers((row[0] for row in rows), table, "step", r.path)
        checks.numeric((row[3] for row in rows), table, "value", r.path)
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

    def _each_rank(self, rank: int | None, read: Callable[[int], pd.DataFrame]
                   ) -> pd.DataFrame:
        """`read(rank)`; for rank None every rank's, with a `rank` column first when the run
        has several ranks (a single-process run: rank 0's table unchanged)."""
        if rank is not None:
            return read(rank)
        if not self._several():
            return read(0)
        frames = [read(r) for r in self.ranks]
        df = pd.concat([f.assign(rank=r) for r, f in zip(self.ranks, frames) if len(f)]
                       or [frames[0].assign(rank=0)], ignore_index=True)
        return df[["rank", *frames[0].columns]]

    def anomalies(self, rank: int | None = None) -> pd.DataFrame:
        """Health-check findings: step, kind (of the step; "" if it was neither recorded nor
        logged a KPI), tensor, detector, value, threshold, message. rank: one rank's, or
        None (default) every rank's: with a `rank` column first when the run has several."""
        return self._each_rank(rank, self._anomalies)

    def _anomalies(self, rank: int) -> pd.DataFrame:
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

    def warnings(self, rank: int | None = None) -> pd.DataFrame:
        """Recording warnings, each distinct one once, in the order they occurred: step (the
        first step it occurred at; None outside a step), location (a module or parameter
        label, "" for the whole model), quantities (list of the instrument quantities it
        affects), message. Runs recorded before warnings were stored give an empty table.
        rank: one rank's, or None (default) every rank's: with a `rank` column first when
        the run has several."""
        return self._each_rank(rank, self._warnings)

    def _warnings(self, rank: int) -> pd.DataFrame:
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


def _some(names: list[str]) -> str:
    """A few names for a one-line message."""
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def open_run(path: str | Path) -> Run:
    """Open a recorded run folder for reading."""
    return Run(path)
