"""The read path: a read-only view of one rank database, safe on foreign or damaged files.

Readers may run while a writer commits (WAL): they see whole committed steps only. Every value
that comes out is validated; a bad file raises `CorruptRunError` with one line, never more.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptRunError
from . import arrays
from .schema import SCHEMA_VERSION

_SQLITE_MAGIC = b"SQLite format 3\x00"


def open_readonly(path: Path) -> sqlite3.Connection:
    """Open a store file read-only and check it is a deepscope store of a known version."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise CorruptRunError(f"cannot read {path}: {exc.strerror}") from None
    if head != _SQLITE_MAGIC:
        raise CorruptRunError(f"{path} is not a deepscope store (not a SQLite file)")
    uri = f"file:{path.resolve()}?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True, check_same_thread=False)
        con.execute("PRAGMA query_only=ON")
        # A run copied without its -shm/-wal files, or on a read-only disk, needs immutable mode.
        try:
            con.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        except sqlite3.OperationalError:
            con.close()
            con = sqlite3.connect(f"file:{path.resolve()}?immutable=1", uri=True,
                                  check_same_thread=False)
        con.execute("PRAGMA trusted_schema=OFF")
        version = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        raise CorruptRunError(f"{path} is not a readable deepscope store ({exc})") from None
    if version is None:
        raise CorruptRunError(f"{path} has no schema version; it is not a deepscope store")
    if version[0] != str(SCHEMA_VERSION):
        raise CorruptRunError(
            f"{path} has schema version {version[0]!r}; this deepscope reads version "
            f"{SCHEMA_VERSION} (upgrade deepscope to read newer runs)")
    return con


class StoreReader:
    """Typed queries on one rank database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._con = open_readonly(path)

    def close(self) -> None:
        self._con.close()

    def query(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        """Run a read query; storage errors become a one-line CorruptRunError."""
        try:
            return self._con.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise CorruptRunError(f"{self.path}: cannot read ({exc}); the file is damaged") \
                from None

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.query("SELECT key, value FROM meta"):
            if key == "schema_version":
                out[key] = value
                continue
            try:
                out[key] = json.loads(value)
            except (TypeError, ValueError):
                out[key] = value
        return out

    def decode_array(self, dtype: Any, shape: Any, data: Any) -> np.ndarray:
        if not isinstance(dtype, str) or not isinstance(shape, str):
            raise CorruptRunError(f"{self.path}: array metadata has the wrong type; file damaged")
        return arrays.decode(dtype, shape, data)

    @staticmethod
    def decode_json(text: Any, what: str) -> Any:
        if not isinstance(text, str):
            raise CorruptRunError(f"stored {what} is not text; the file is damaged")
        try:
            return json.loads(text)
        except ValueError:
            raise CorruptRunError(f"stored {what} is not valid JSON; the file is damaged") \
                from None
