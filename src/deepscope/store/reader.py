"""The read path: a read-only view of one rank database, safe on foreign or damaged files.

Readers may run while a writer commits (WAL): they see whole committed steps only. Every value
that comes out is validated; a bad file raises `CorruptRunError` with one line, never more.
A file someone sent you is hostile until checked: its tables must be plain tables with our
columns (no views, generated columns or defaults, which SQLite would evaluate while we read).
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptRunError
from . import arrays, codecs, limits
from .layout import check_run_id
from .schema import (
    DDL,
    LAYOUT_VERSION,
    OPTIONAL_TABLES,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    VERSION_TABLES,
    is_readable,
)

_SQLITE_MAGIC = b"SQLite format 3\x00"
# Python's sqlite3 raises UnicodeDecodeError instead of DatabaseError when SQLite's message
# quotes damaged bytes (e.g. "malformed database schema (...)") that are not UTF-8.
_STORAGE_ERRORS = (sqlite3.DatabaseError, UnicodeDecodeError)


def _corrupt(message: str) -> CorruptRunError:
    """A CorruptRunError whose message is one printable line, whatever the file put in it.

    SQLite quotes damaged schema text in its messages, and paths may hold any character:
    a newline would break the one-line promise, an escape sequence would reach the terminal.
    """
    return CorruptRunError("".join(c if c.isprintable() else "?" for c in message)[:500])


@functools.lru_cache(maxsize=1)
def expected_tables() -> dict[str, tuple[tuple[str, str], ...]]:
    """{table: ((column, declared type), ...)} as this version's DDL creates them."""
    con = sqlite3.connect(":memory:")
    try:
        con.executescript(DDL)
        names = [n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {n: tuple((c[1], c[2]) for c in con.execute(f'PRAGMA table_xinfo("{n}")'))
                for n in names}
    finally:
        con.close()


def _connect(path: Path) -> sqlite3.Connection:
    """Connect read-only; fall back to immutable mode only when that cannot hide data."""
    # as_uri() percent-encodes '?', '#' and '%', which would otherwise end or alter the path.
    uri = path.resolve().as_uri()
    con = None
    try:
        con = sqlite3.connect(f"{uri}?mode=ro", uri=True, check_same_thread=False)
        con.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        return con
    except sqlite3.OperationalError as exc:
        if con is not None:
            con.close()
        # A read-only disk or a run copied without its -shm file needs immutable mode, but
        # immutable mode ignores the write-ahead log: with a non-empty log it would silently
        # drop committed steps, and it would read torn pages of a file still being written.
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise _corrupt(
                f"cannot open {path} read-only together with its write-ahead log ({exc}); "
                "copy the run folder to a writable place and open the copy") from None
    return sqlite3.connect(f"{uri}?immutable=1", uri=True, check_same_thread=False)


def _check_tables(con: sqlite3.Connection, path: Path, tables: list[str]) -> None:
    """Refuse files whose `tables` are not exactly the plain tables this version writes."""
    expected = expected_tables()
    kinds = dict(con.execute(
        f"SELECT name, type FROM sqlite_master WHERE name IN ({', '.join('?' * len(tables))})",
        tables).fetchall())
    for table in tables:
        if kinds.get(table) != "table":
            what = f"a {kinds[table]}" if table in kinds else "missing"
            raise _corrupt(f"{path} is not a deepscope store: table {table!r} is {what}")
        # (cid, name, type, notnull, default, pk, hidden): defaults and generated (hidden)
        # columns are expressions SQLite evaluates on read, so a crafted file must not have any.
        info = con.execute(f'PRAGMA table_xinfo("{table}")').fetchall()
        if (tuple((c[1], c[2]) for c in info) != expected[table]
                or any(c[4] is not None or c[6] != 0 for c in info)):
            raise _corrupt(
                f"{path} is not a deepscope store of schema version {SCHEMA_VERSION}: table "
                f"{table!r} has unexpected columns")


def readable_versions() -> str:
    """The schema versions this deepscope reads, in words ("2 and 3")."""
    *first, last = [str(v) for v in READABLE_VERSIONS]
    return f"{', '.join(first)} and {last}" if first else last


def _check_store(con: sqlite3.Connection, path: Path) -> None:
    """The file is a deepscope store of this schema version, with nothing crafted in it."""
    for pragma in ("query_only=ON", "trusted_schema=OFF", "cell_size_check=ON"):
        con.execute(f"PRAGMA {pragma}")
    # `meta` is checked before it is read (a crafted view could run forever); the other
    # tables after the version, so a newer deepscope's run asks for an upgrade instead.
    _check_tables(con, path, ["meta"])
    version = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if version is None:
        raise _corrupt(f"{path} has no schema version; it is not a deepscope store")
    if not is_readable(version[0]):
        older = version[0] in [str(v) for v in range(1, SCHEMA_VERSION)]
        fix = ("read it with the deepscope release that recorded it" if older
               else "upgrade deepscope to read newer runs")
        raise _corrupt(f"{path} has schema version {str(version[0])[:20]!r}; this deepscope "
                       f"reads versions {readable_versions()} ({fix})")
    present = _present_tables(con)
    _check_tables(con, path, [t for t in expected_tables() if t != "meta"
                              and (t not in OPTIONAL_TABLES or t in present)
                              and (int(version[0]) >= VERSION_TABLES.get(t, 0)
                                   or t in present)])
    run_id = con.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
    check_run_id(path, run_id and run_id[0])  # a -wal file of another database


def _present_tables(con: sqlite3.Connection) -> set[str]:
    """Names of every schema object (of any type: a view named like a table is checked)."""
    return {n for (n,) in con.execute("SELECT name FROM sqlite_master")}


def open_readonly(path: Path) -> sqlite3.Connection:
    """Open a store file read-only and check it is a deepscope store of a known version."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise _corrupt(f"cannot read {path}: {exc.strerror}") from None
    if head != _SQLITE_MAGIC:
        raise _corrupt(f"{path} is not a deepscope store (not a SQLite file)")
    con = None
    try:
        con = _connect(path)
        _check_store(con, path)
        return con
    except BaseException as exc:
        if con is not None:
            con.close()
        if isinstance(exc, _STORAGE_ERRORS):
            raise _corrupt(f"{path} is not a readable deepscope store ({exc})") from None
        raise


class StoreReader:
    """Typed queries on one rank database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._con = open_readonly(path)
        # optional tables (see schema.OPTIONAL_TABLES) this file has; checked on opening
        self.optional_tables = frozenset(OPTIONAL_TABLES & _present_tables(self._con))
        # the file's schema version (checked readable on opening): how its arrays are indexed
        self.version = int(self.query("SELECT value FROM meta WHERE key='schema_version'")[0][0])
        self._layouts: OrderedDict[str, list[tuple]] = OrderedDict()  # by hash, least recent first
        self._parts: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # least recent first
        self._parts_lock = threading.Lock()  # the GUI server reads from several threads

    def close(self) -> None:
        self._con.close()

    def query(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        """Run a read query; storage errors become a one-line CorruptRunError."""
        try:
            return self._con.execute(sql, params).fetchall()
        except _STORAGE_ERRORS as exc:
            raise _corrupt(f"{self.path}: cannot read ({exc}); the file is damaged") \
                from None

    def meta(self) -> dict[str, Any]:
        """The run's key/value metadata; values that are not JSON come back as stored."""
        out: dict[str, Any] = {}
        for key, value in self.query("SELECT key, value FROM meta"):
            if key == "schema_version":
                out[key] = value
                continue
            if isinstance(value, str) and len(value) > limits.MAX_JSON_CHARS:
                out[key] = value  # over the cap: kept as stored, not parsed
                continue
            try:
                out[key] = json.loads(value)
            except (TypeError, ValueError, RecursionError):
                out[key] = value
        return out

    def decode_array(self, dtype: Any, shape: Any, data: Any) -> np.ndarray:
        """A stored array, validated (see `arrays.decode`)."""
        if not isinstance(dtype, str) or not isinstance(shape, str):
            raise _corrupt(f"{self.path}: array metadata has the wrong type; file damaged")
        return arrays.decode(dtype, shape, data)

    def step_part(self, step: int, part: int) -> bytes:
        """The uncompressed bytes of one part of a step's arrays, validated (see `codecs`).

        The last few parts are kept (at most `limits.PART_CACHE_BYTES`): views of one step
        are read in a row (the GUI shows several), and a committed step never changes.
        """
        key = (step, part)
        with self._parts_lock:
            data = self._parts.get(key)
            if data is not None:
                self._parts.move_to_end(key)
                return data
        rows = self.query("SELECT codec, raw_bytes, data FROM step_blobs WHERE step = ? AND "
                          "part = ?", (step, part))
        if not rows:
            raise _corrupt(f"{self.path}: step {step} has arrays but no data for part {part}; "
                           "the file is damaged")
        try:
            data = codecs.decode(*rows[0], cap=self.part_cap())
        except CorruptRunError as exc:
            raise _corrupt(f"{self.path}: step {step}, part {part}: {exc}") from None
        with self._parts_lock:
            self._parts[key] = data
            while sum(map(len, self._parts.values())) > limits.PART_CACHE_BYTES:
                self._parts.popitem(last=False)
        return data

    def record_arrays(self, tensor: str, step: int, iteration: int, direction: str
                      ) -> dict[str, tuple[Any, Any, Any, Any, Any]]:
        """The arrays of one tensor record: {view: (dtype, JSON shape, part, offset, nbytes)}
        (the bounds are checked when one is read), whatever the schema version."""
        if self.version < LAYOUT_VERSION:
            rows = self.query(
                "SELECT a.view, a.dtype, a.shape, a.part, a.offset, a.nbytes FROM arrays a "
                "JOIN tensors t ON t.id = a.tensor_id WHERE t.name = ? AND a.step = ? "
                "AND a.iteration = ? AND a.direction = ?", (tensor, step, iteration, direction))
            return {r[0]: r[1:] for r in rows}
        rows = self.query("SELECT layout FROM step_arrays WHERE step = ?", (step,))
        return {} if not rows else {
            view: rest for name, d, view, it, *rest in self.layout(rows[0][0])
            if name == tensor and it == iteration and d == direction}

    def layout(self, digest: Any) -> list[tuple]:
        """A stored array layout (see `step_arrays`) by its hash, validated; the last few are
        kept (every step of a steady run has the same)."""
        with self._parts_lock:
            entries = self._layouts.get(digest)
        if entries is not None:
            return entries
        rows = self.query("SELECT body FROM layouts WHERE hash = ?", (digest,))
        if not rows:
            raise _corrupt(f"{self.path}: array layout {str(digest)[:20]!r} is missing; the "
                           "file is damaged")
        body = self.decode_json(rows[0][0], "array layout")
        types = (str, str, str, int, str, str, int, int, int)
        if not (isinstance(body, list) and all(
                isinstance(e, list) and len(e) == len(types)
                and all(type(v) is t for v, t in zip(e, types)) for e in body)):
            raise _corrupt(f"{self.path}: stored array layout has the wrong structure; the "
                           "file is damaged")
        entries = [tuple(e) for e in body]
        with self._parts_lock:
            self._layouts[digest] = entries
            while len(self._layouts) > 16:
                self._layouts.popitem(last=False)
        return entries

    def part_cap(self) -> int:
        """Bytes one decoded step part may have now (see `limits.part_cap`)."""
        size = 0
        for p in (self.path, self.path.with_name(self.path.name + "-wal")):
            try:
                size += p.stat().st_size
            except OSError:
                pass
        return limits.part_cap(size)

    def decode_slice(self, dtype: Any, shape: Any, offset: Any, nbytes: Any,
                     part: bytes) -> np.ndarray:
        """An array stored as bytes [offset, offset + nbytes) of its (uncompressed) part.

        Python slicing clips out-of-range bounds and counts negative ones from the end, so
        the bounds are checked here: a crafted row must not read another array's bytes.
        """
        if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0
                and nbytes >= 0 and offset + nbytes <= len(part)):
            raise _corrupt(f"{self.path}: an array points outside its step's data "
                           f"(offset {offset!r}, {nbytes!r} bytes of {len(part)}); the file "
                           "is damaged")
        return self.decode_array(dtype, shape, memoryview(part)[offset:offset + nbytes])

    @staticmethod
    def decode_json(text: Any, what: str) -> Any:
        """Parse stored JSON text; anything else is a one-line CorruptRunError."""
        if not isinstance(text, str):
            raise _corrupt(f"stored {what} is not text; the file is damaged")
        if len(text) > limits.MAX_JSON_CHARS:
            raise _corrupt(f"stored {what} is {len(text)} characters of JSON, more than the "
                           f"cap {limits.MAX_JSON_CHARS}; the file is damaged or crafted")
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: crafted, deeply nested JSON
            raise _corrupt(f"stored {what} is not valid JSON; the file is damaged") \
                from None

    @classmethod
    def decode_graph(cls, text: Any) -> dict[str, Any]:
        """A stored dependency graph, with the structure `Run.graph` relies on checked."""
        body = cls.decode_json(text, "graph")
        tensors = body.get("tensors") if isinstance(body, dict) else None
        edges = body.get("edges") if isinstance(body, dict) else None
        if not (isinstance(tensors, list) and isinstance(edges, list)
                and all(isinstance(t, dict)
                        and all(isinstance(t.get(k), str) for k in ("name", "role", "node"))
                        for t in tensors)
                and all(isinstance(e, dict) and isinstance(e.get("source"), str)
                        and isinstance(e.get("target"), str) for e in edges)):
            raise _corrupt("stored graph has the wrong structure; the file is damaged")
        limits.capped_int(len(tensors), limits.MAX_GRAPH_TENSORS, "graph tensor count")
        limits.capped_int(len(edges), limits.MAX_GRAPH_EDGES, "graph edge count")
        return body
