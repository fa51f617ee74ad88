"""The write path: a background thread that commits each step whole in one transaction.

The training thread only builds payloads (device tensors included) and puts them on a bounded
queue; the writer copies them to the host, encodes and compresses them (zlib runs without the
GIL, beside training) and commits: one transaction per step, with its KPIs, or one for the
steps queued behind each other when it has fallen behind; checkpoints run on a thread of their
own. A full queue either blocks the trainer (back-pressure, the default) or drops whole steps
with a counted warning. A failing disk disables recording with one warning; what was
committed stays readable. A step whose own data cannot be written is skipped alone; another
program holding the database lock is waited for (with back-off), then steps are skipped until
it lets go.

One writer per run and rank: an OS lock on `rankN.sqlite.lock` (released by the kernel when
its holder dies, even by kill -9). The lock file also holds the run id, repeated in `meta` by
every transaction, so a `-wal` file of another database cannot pass as this run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RecordingError
from ..records import (
    GroupSummary,
    InstrumentWarning,
    QuantityValue,
    StepPayload,
    StepSummary,
    TensorInfo,
)
from . import arrays, codecs
from .layout import check_run_id, lock_file, parse_run_id, sidecar_run_id
from .schema import APPLICATION_ID, DDL, LAYOUT_VERSION, SCHEMA_VERSION, STAT_COLUMNS, is_readable

try:
    import fcntl
except ImportError:  # Windows: no lock (see docs/LIMITATIONS.md)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("deepscope")
# Another program holding the database's write lock is waited for this long (seconds, with
# back-off) before steps are skipped; while it holds on, the writer looks again every
# LOCK_PROBE_SECONDS and skips what arrives in between without waiting.
LOCK_WAIT_SECONDS = 30.0
LOCK_PROBE_SECONDS = 1.0
_BUSY_TIMEOUT_SECONDS = 0.05  # SQLite's own wait per attempt; the back-off is ours
# A checkpoint (the WAL copied into the database, with an fsync of each) costs tens of ms on a
# busy disk, paid by the commit that triggers it: the writer's commits do not checkpoint, a
# thread of their own does, every CHECKPOINT_COMMITS commits and whenever the writer's queue
# runs empty (caught up then, the WAL starts over at the next commit). SQLite's automatic
# checkpoint on the writer's connection stays, should the WAL outgrow WAL_LIMIT_PAGES while
# the writer never rests.
CHECKPOINT_COMMITS = 16
WAL_LIMIT_PAGES = 4096
# Steps already queued one after another when the writer takes the first are committed
# together, at most this many: a writer fallen behind catches up with one commit for them.
MAX_GROUP = 8
# A writer keeping up waits this long (seconds) for this many steps to summarise and commit
# together: a group's ops, GIL hand-overs and commit are shared by its steps. Never while a
# flush() or close() waits.
GROUP_STEPS = 3
GROUP_WAIT = 0.005
_LOCKED = ("another program has held the write lock of {path} too long; {what} and later "
           "items are skipped until it lets go (training continues)")
_live_writers: weakref.WeakSet = weakref.WeakSet()
_inherited: list = []  # a forked child never closes its parent's connections (see _forked)


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


@dataclass
class _Status:
    status: str


@dataclass
class _Meta:
    values: dict[str, Any]


_STOP = object()
# meta "status": how a run ended. A run still "recording" whose lock no writer holds crashed.
RECORDING, FINISHED, INTERRUPTED = "recording", "finished", "interrupted"


class RunLock:
    """The exclusive OS lock of one rank database's writer, on `lock_file(db)`.

    flock: held per open file, so a second writer in this process conflicts too, and the
    kernel releases it when the holder dies. A forked child closes its inherited copy
    without unlocking (see `StoreWriter._forked`).
    """

    def __init__(self, db: Path) -> None:
        self.path = lock_file(db)
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise ValueError(
                f"{db} is being written by another process, or by a Scope of this one not "
                "closed yet (scope.close()): a run and rank has one writer; wait for it to "
                "finish, or record into another run name or rank") from None

    @staticmethod
    def is_held(db: Path) -> bool:
        """Whether a writer holds `db`'s lock now (False where locks do not exist)."""
        if fcntl is None or not lock_file(db).exists():
            return False
        try:
            fd = os.open(lock_file(db), os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)  # closing releases a lock taken here

    def write_run_id(self, run_id: str) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, run_id.encode("ascii"))
        os.fsync(self.fd)

    def release(self, unlock: bool = True) -> None:
        """Unlock and close; `unlock=False` only closes (a forked child's copy)."""
        if self.fd is not None:
            if unlock and fcntl is not None:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class Checkpointer:
    """Copies a database's WAL into it on a thread and connection of its own: PASSIVE
    checkpoints, which never wait for nor block the writer or readers. Crash safety is
    SQLite's: a checkpoint cut short by kill -9 loses nothing committed."""

    def __init__(self, path: Path) -> None:
        self.con = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.checkpoints = 0  # checkpoints run so far
        self._due = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deepscope-checkpoint",
                                        daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a checkpoint soon (requests while one runs are merged)."""
        self._due.set()

    def close(self) -> None:
        """Stop the thread (a running checkpoint finishes first) and close the connection."""
        self._stopping = True
        self._due.set()
        self._thread.join()
        self.con.close()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stopping:
                return
            try:
                self.con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.checkpoints += 1
            except sqlite3.Error:
                pass  # only a saving: the writer's automatic checkpoint remains


def _is_busy(exc: BaseException) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock; waiting may help."""
    return (isinstance(exc, sqlite3.OperationalError)
            and (getattr(exc, "sqlite_errorcode", None) in (5, 6)
                 or "locked" in str(exc)))


def _is_storage_failure(exc: BaseException) -> bool:
    """A failure of the file or disk (recording stops); anything else is about one item's
    data (that item is skipped)."""
    return isinstance(exc, (OSError, RunDeleted)) or (
        isinstance(exc, sqlite3.DatabaseError)
        and not isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError,
                                 sqlite3.ProgrammingError)))


class RunDeleted(Exception):
    """The database file was deleted or replaced under the writer."""


def stored_run_id(path: Path) -> Any:
    """The run id in an existing database's `meta` (JSON text), read without writing: a read-only
    connection never checkpoints, so a foreign -wal file is not merged by looking at it."""
    if not path.exists():
        return None
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = con.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
    except sqlite3.DatabaseError:
        return None  # no meta yet (or not a store): the writer's own checks say what
    finally:
        con.close()
    return row and row[0]


def connect(path: Path) -> sqlite3.Connection:
    """Open (or create) a store file for writing, WAL mode, schema ensured."""
    con = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False,
                          timeout=_BUSY_TIMEOUT_SECONDS)
    con.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives a killed process; only an OS crash can lose the last commits.
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute(f"PRAGMA application_id={APPLICATION_ID}")
    con.executescript(DDL)
    return con


class StoreWriter:
    """Owns one rank database of one run and the thread that writes it.

    Counters (read them any time): committed_steps, dropped_steps (queue full with
    on_full="drop"), skipped_steps (not written: their data failed, or the database stayed
    locked). failed: why recording stopped for good, or None.
    """

    def __init__(self, path: Path, meta: dict[str, Any], *, resume: bool,
                 queue_size: int = 32, on_full: str = "block") -> None:
        if on_full not in ("block", "drop"):
            raise ValueError(f"on_full must be 'block' or 'drop', not {on_full!r}")
        self.path = path
        self.on_full = on_full
        self.dropped_steps = 0
        self.committed_steps = 0
        self.skipped_steps = 0
        self.failed: str | None = None
        self.last_committed: int | None = None  # highest step committed by this writer
        # What flush() has not yet said was not written: failure -> [count, first, last item]
        self._unreported: dict[str, list] = {}
        self._reported: set[str] = set()
        self._tensor_ids: dict[str, int] = {}
        self._new_tensors: list[str] = []  # names inserted by the open transaction
        # The last array layout written (schema version 4): (entries, hash), and whether the
        # open transaction inserted it (a rollback then forgets it)
        self._layout: tuple[list, str] | None = None
        self._new_layout = False
        self.version = SCHEMA_VERSION  # of the file: a resumed older run keeps its own
        self._busy_since: float | None = None
        self._next_probe = 0.0
        self._pid = os.getpid()
        self._forked_from: int | None = None
        self._lock = RunLock(path)
        try:
            self.run_id = self._check_run_id()
            self._con = connect(path)
            self._init_meta(meta, resume)
            self._inode = os.stat(path).st_ino
        except BaseException:
            if getattr(self, "_con", None) is not None:
                self._con.close()
            self._lock.release()
            raise
        self._commits = 0
        self.checkpointer: Checkpointer | None = None
        try:
            self.checkpointer = Checkpointer(path)
            self._con.execute(f"PRAGMA wal_autocheckpoint={WAL_LIMIT_PAGES}")
        except sqlite3.Error:  # the writer's own automatic checkpoints then do it
            pass
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._flushing = 0  # flush() / close() calls waiting (under the queue's lock)
        self._thread = threading.Thread(target=self._run, name="deepscope-writer", daemon=True)
        self._thread.start()
        _live_writers.add(self)

    def _check_run_id(self) -> str:
        """This rank's run id: the lock file's, checked against the database's before any
        write; a new one for a new database (or one recorded before run ids existed)."""
        stored = stored_run_id(self.path)
        check_run_id(self.path, stored)
        run_id = parse_run_id(stored) or sidecar_run_id(self.path) or uuid.uuid4().hex
        if sidecar_run_id(self.path) != run_id:
            self._lock.write_run_id(run_id)
        return run_id

    def _init_meta(self, meta: dict[str, Any], resume: bool) -> None:
        con = self._con
        stored = dict(con.execute("SELECT key, value FROM meta").fetchall())
        version = str(SCHEMA_VERSION)
        if stored:
            version = stored.get("schema_version")
            if not is_readable(version):
                raise ValueError(
                    f"{self.path} has schema version {version}, this deepscope writes "
                    f"{SCHEMA_VERSION}; record into a new run name")
            if not resume:
                raise ValueError(f"{self.path} already holds a run; pass resume=True")
        # A resumed run keeps its version: its tables keep the layout they were created with
        # (the DDL's CREATE TABLE IF NOT EXISTS leaves them), and the columns are the same.
        rows = {"schema_version": version,
                **{k: json.dumps(v) for k, v in meta.items()}, "run_id": json.dumps(self.run_id)}
        if not stored:
            rows["created"] = json.dumps(time.time())
        rows["status"] = json.dumps(RECORDING)  # until close() says how it ended
        self.version = int(version)
        con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(rows.items()))
        self._tensor_ids = dict(con.execute("SELECT name, id FROM tensors").fetchall())

    def last_step(self) -> int | None:
        """The highest step with any data (recorded or KPI), for resuming."""
        row = self._con.execute(
            "SELECT max(s) FROM (SELECT max(step) s FROM steps UNION ALL "
            "SELECT max(step) FROM kpis)").fetchone()
        return row[0]

    # --- the training thread's side -------------------------------------------------------
    def live(self) -> bool:
        """Whether recording can go on; in a forked child, says once why it cannot."""
        if self._forked_from is not None and "fork" not in self._reported:
            self._reported.add("fork")
            log.warning("deepscope: %s", self.failed)
        return not self.failed

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

    def submit_meta(self, values: dict[str, Any]) -> None:
        """Add or replace `meta` keys (each value stored as JSON) after the writer opened,
        e.g. what the ranks of a distributed run agreed on."""
        if not self.failed and values:
            self._queue.put(_Meta(dict(values)))

    def flush(self) -> None:
        """Block until everything queued so far is committed.

        Raises `RecordingError` naming what was not written since the last flush (steps
        skipped, or everything after the writer failed); returns only when all of it is on
        disk. Steps dropped by on_full="drop" are counted in `dropped_steps`, not raised.
        """
        if self._thread.is_alive():
            with self._waiting():
                self._queue.join()
        lost = [f"{first} skipped ({key})" if n == 1 else
                f"{n} items skipped ({key}): {first} ... {last}"
                for key, (n, first, last) in self._unreported.items()]
        self._unreported = {}
        if self.failed:
            after = "" if self.last_committed is None else f" after step {self.last_committed}"
            lost.append(f"recording stopped ({self.failed}); nothing recorded{after} was "
                        "written")
        if lost:
            raise RecordingError(f"{self.path}: not everything recorded is on disk: "
                                 f"{'; '.join(lost)}; committed steps stay readable")

    def close(self, status: str = FINISHED) -> None:
        """Commit what is queued, store how the run ended (`status`: "finished" or
        "interrupted: <why>"), stop the writer thread and release the run's lock."""
        if self._thread.is_alive():
            with self._waiting():
                if not self.failed:
                    self._queue.put(_Status(status))
                self._queue.put(_STOP)
                self._thread.join()
        if self._forked_from is None:
            self._lock.release()
        _live_writers.discard(self)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """While a caller waits for the writer: it groups no more steps than are queued."""
        with self._queue.not_empty:
            self._flushing += 1
            self._queue.not_empty.notify()  # the writer, should it be waiting for a group
        try:
            yield
        finally:
            with self._queue.mutex:
                self._flushing -= 1

    def _forked(self) -> None:
        """In a child made by os.fork(): no writer thread here, and the parent's connection,
        queue and lock must not be touched. Recording stops in the child (one warning when
        it first tries); the parent records on."""
        self._forked_from = self._pid
        self.failed = (f"this process was forked from the one writing {self.path}; recording "
                       "is off in the child: open a new Scope in it (its own run or rank) "
                       "to record there")
        _inherited.append(self._con)  # never closed here: closing could checkpoint the parent's
        if self.checkpointer is not None:
            _inherited.append(self.checkpointer.con)
        self._lock.release(unlock=False)

    # --- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            group = self._group(item)
            try:
                if item is _STOP:
                    break
                if self.failed:
                    pass
                elif len(group) > 1:
                    self._write_steps(group)
                else:
                    self._write(item)
            except Exception as exc:  # never kill the training
                self._fail(item, exc)
                self._kpis_alone(item)
            finally:
                for _ in group[1:]:  # this thread alone takes items: these are next
                    self._queue.get_nowait()
                for _ in group:
                    self._queue.task_done()
            if self._commits % CHECKPOINT_COMMITS and self._queue.empty():
                self._request_checkpoint()
        if self.checkpointer is not None:
            self.checkpointer.close()
        try:
            self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self._con.close()

    def _group(self, item: Any) -> list[Any]:
        """`item` and, if a step, the steps queued right behind it (read only: they keep their
        queue slots until written). Fewer than GROUP_STEPS: waits up to GROUP_WAIT seconds
        for more, unless a flush or close waits, another kind of item or a full queue
        (back-pressure) is next."""
        group = [item]
        if not isinstance(item, StepPayload):
            return group
        q = self._queue
        deadline = None
        with q.not_empty:  # holds q.mutex; waiting lets it go
            while True:
                del group[1:]
                for nxt in itertools.islice(q.queue, MAX_GROUP - 1):
                    if not isinstance(nxt, StepPayload):
                        return group
                    group.append(nxt)
                if (len(group) >= GROUP_STEPS or self._flushing
                        or 0 < q.maxsize <= len(q.queue)):
                    return group
                now = time.monotonic()
                deadline = now + GROUP_WAIT if deadline is None else deadline
                if now >= deadline:
                    return group
                q.not_empty.wait(deadline - now)

    def _fail(self, item: Any, exc: Exception) -> None:
        """Disk full, unwritable, file gone: recording stops. Anything else: skip the item."""
        key = f"{type(exc).__name__}: {exc}"
        if _is_storage_failure(exc):
            self.failed = key
            log.warning("deepscope: writing %s failed (%s); recording is disabled for this "
                        "run, training continues and committed steps stay readable",
                        self.path, self.failed)
        else:
            self._skip(item, key, "writing {what} to {path} failed ({key}); it is skipped, "
                       "recording continues")

    def _skip(self, item: Any, key: str, warning: str) -> None:
        """Count an item not written; warn once per kind of failure `key` (`warning` with
        {what}, {key} and {path} filled in)."""
        what = _describe(item)
        if isinstance(item, StepPayload):
            self.skipped_steps += 1
        entry = self._unreported.setdefault(key, [0, what, what])
        entry[0] += 1
        entry[2] = what
        if key not in self._reported:
            self._reported.add(key)
            log.warning("deepscope: %s", warning.format(what=what, key=key, path=self.path))

    def _kpis_alone(self, item: Any) -> None:
        """A step not written loses its data only: the KPIs it carried get their own commit."""
        if isinstance(item, StepPayload) and item.kpis and not self.failed:
            kpis = _Kpis(item.kpis)
            try:
                self._write(kpis)
            except Exception as exc:  # noqa: BLE001 - never kill the training
                self._fail(kpis, exc)

    def _write(self, item: Any) -> None:
        summary = self._summarise(item) if isinstance(item, StepPayload) else None
        if isinstance(item, StepPayload) and summary is None:
            self._kpis_alone(item)
            return
        if isinstance(item, _Kpis):  # once, before any retry
            item = _Kpis(self._kpi_rows(item.rows))
        elif isinstance(item, StepPayload) and item.kpis:
            item.kpis = self._kpi_rows(item.kpis)
        self._commit(item, summary)

    def _write_steps(self, steps: list[StepPayload]) -> None:
        """Consecutive queued steps in one commit: the pages they share (the last leaves of
        each table) are written once. Any failure (a locked database, one step's bad data,
        the disk) rolls the group back and writes each step alone, as if never grouped;
        either way a step is committed whole or not at all."""
        ready = []
        for p, summary in zip(steps, self._summaries(steps)):
            if summary is None:
                self._kpis_alone(p)
                continue
            p.kpis = self._kpi_rows(p.kpis)
            ready.append((p, summary))
        if len(ready) > 1:
            try:
                self._transaction(ready)
                return
            except Exception:  # noqa: BLE001 - each step again, alone, says what failed
                pass
        for p, summary in ready:
            if self.failed:
                return
            try:
                self._commit(p, summary)
            except Exception as exc:  # never kill the training
                self._fail(p, exc)
                self._kpis_alone(p)

    def _commit(self, item: Any, summary: StepSummary | None) -> None:
        """Commit one item, waiting (with back-off) for another program's lock."""
        delay = 0.01
        while True:
            now = time.monotonic()
            if self._busy_since is not None and now - self._busy_since >= LOCK_WAIT_SECONDS \
                    and now < self._next_probe:
                self._skip(item, "database locked", _LOCKED)
                return
            try:
                self._transaction([(item, summary)])
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if self._busy_since is None:
                    self._busy_since = now
                if now - self._busy_since >= LOCK_WAIT_SECONDS:
                    self._next_probe = now + LOCK_PROBE_SECONDS
                    self._skip(item, "database locked", _LOCKED)
                    return
                time.sleep(delay)
                delay = min(2 * delay, 0.5)
                continue
            if self._busy_since is not None and "database locked" in self._reported:
                log.warning("deepscope: %s is free again after %.1f s; recording resumed "
                            "(%d step(s) skipped)", self.path, now - self._busy_since,
                            self.skipped_steps)
                self._reported.discard("database locked")
            self._busy_since = None
            return

    def _transaction(self, items: list[tuple[Any, StepSummary | None]]) -> None:
        """Write (item, its summary) pairs in one transaction."""
        con = self._con
        try:  # deleted or replaced under us: writing on would go into a file nobody sees
            gone = os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            gone = True
        if gone:
            raise RunDeleted(f"{self.path} was deleted or replaced while recording; record "
                           "into a new run")
        con.execute("BEGIN IMMEDIATE")
        self._new_tensors = []
        self._new_layout = False
        try:
            for item, summary in items:
                self._write_item(item, summary)
            # Every transaction repeats the run id: the last commit in a -wal file then says
            # which database the file belongs to (checked against the lock file on open).
            con.execute("INSERT OR REPLACE INTO meta VALUES ('run_id', ?)",
                        (json.dumps(self.run_id),))
            con.execute("COMMIT")
        except BaseException:
            for name in self._new_tensors:  # rolled back: inserted again when next written
                del self._tensor_ids[name]
            if self._new_layout:
                self._layout = None
            if con.in_transaction:  # SQLite itself rolls back on SQLITE_FULL / IOERR
                con.execute("ROLLBACK")
            raise
        for item, _ in items:
            if isinstance(item, StepPayload):
                self.committed_steps += 1
                self.last_committed = item.step
        self._commits += 1
        if self._commits % CHECKPOINT_COMMITS == 0:
            self._request_checkpoint()

    def _write_item(self, item: Any, summary: StepSummary | None) -> None:
        con = self._con
        if isinstance(item, StepPayload):
            self._write_step(item, summary)
        elif isinstance(item, _Kpis):
            con.executemany("INSERT OR REPLACE INTO kpis VALUES (?, ?, ?, ?)", item.rows)
        elif isinstance(item, _Note):
            con.execute("INSERT INTO notes (wall_time, step, text) VALUES (?, ?, ?)",
                        (item.wall_time, item.step, item.text))
        elif isinstance(item, _Quantities):
            self._write_quantities(item.values)
        elif isinstance(item, _Anomalies):
            self._write_anomalies(item.rows)
        elif isinstance(item, _Warnings):
            self._write_warnings(item.warnings)
        elif isinstance(item, _Status):
            con.execute("INSERT OR REPLACE INTO meta VALUES ('status', ?)",
                        (json.dumps(item.status),))
        elif isinstance(item, _Meta):
            con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                            [(k, json.dumps(v)) for k, v in item.values.items()])

    def _request_checkpoint(self) -> None:
        """Have the checkpointer copy the WAL into the database (commits counted anew)."""
        if self.checkpointer is not None:
            self.checkpointer.request()
        self._commits = 0

    def _kpi_rows(self, rows: list[tuple[str, int, str, Any]]) -> list[tuple]:
        """KPI rows as stored; a value that cannot be stored loses its own row only."""
        out = []
        for name, step, kind, value in rows:
            try:
                out.append((name, step, kind, _to_float(value)))
            except Exception as exc:  # noqa: BLE001 - validated at rec.kpi; belt and braces
                self._skip(f"KPI {name!r} of step {step}", f"{type(exc).__name__}: {exc}",
                           "{what} could not be stored ({key}); that value is skipped")
        return out

    def _summaries(self, steps: list[StepPayload]) -> list[StepSummary | None]:
        """Each step's summary (None: it failed, the step is skipped): the `GroupSummary` jobs
        of equal key in one pass; should that fail, each step alone says what failed."""
        out: list[StepSummary | None] = [None] * len(steps)
        groups: dict[Any, list[int]] = {}
        for i, p in enumerate(steps):
            if isinstance(p.summarise, GroupSummary):
                groups.setdefault(p.summarise.key, []).append(i)
        for idx in groups.values():
            if len(idx) > 1:
                jobs = [steps[i].summarise for i in idx]
                try:
                    for i, summary in zip(idx, jobs[0].together(jobs), strict=True):  # type: ignore[union-attr]
                        out[i] = summary
                except Exception:  # noqa: BLE001 - retried alone below
                    pass
        return [summary if summary is not None else self._summarise(p)
                for p, summary in zip(steps, out)]

    def _summarise(self, p: StepPayload) -> StepSummary | None:
        """Run the step's summary; a failure there loses this step only, not the writer."""
        if p.summarise is None:
            return StepSummary([], np.zeros((0, len(STAT_COLUMNS))), [], [])
        try:
            return p.summarise()
        except Exception as exc:
            key = f"{type(exc).__name__}: {exc}"
            self._skip(p, key, "summarising {what} failed ({key}); the step is skipped, "
                       "training continues")
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
            self._new_tensors.append(info.name)
        return tid

    def _write_step(self, p: StepPayload, summary: StepSummary) -> None:
        con = self._con
        for t in p.tensors:
            self._tensor_id(t)
        ids = self._tensor_ids  # every name of the step is in it now
        if summary.keys:
            # SQLite stores a bound NaN (a missing statistic) as NULL.
            marks = ", ".join("?" * (4 + len(STAT_COLUMNS)))
            con.executemany(
                f"INSERT OR REPLACE INTO records VALUES ({marks})",
                [(ids[name], direction, p.step, iteration, *row)
                 for (name, direction, iteration), row in zip(summary.keys,
                                                              summary.stats.tolist())])
        if summary.arrays:
            legacy = self.version < LAYOUT_VERSION
            # Each part holds one dtype; its element size picks the codec.
            dtypes = {entry[6]: entry[4] for entry in summary.arrays}
            blobs = []
            compress = summary.compress or [True] * len(summary.parts)
            for part, data in enumerate(summary.parts):
                itemsize = arrays.itemsize(dtypes[part]) if part in dtypes else 1
                codec, stored = (codecs.encode(data, itemsize, legacy) if compress[part]
                                 else (codecs.RAW, data))
                blobs.append((p.step, part, codec, len(data), stored))
            con.executemany("INSERT OR REPLACE INTO step_blobs VALUES (?, ?, ?, ?, ?)", blobs)
            if legacy:
                con.executemany(
                    "INSERT OR REPLACE INTO arrays VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(ids[name], direction, view, p.step, iteration, dtype, shape, part,
                      offset, nbytes)
                     for name, direction, view, iteration, dtype, shape, part, offset, nbytes
                     in summary.arrays])
            else:
                con.execute("INSERT OR REPLACE INTO step_arrays VALUES (?, ?)",
                            (p.step, self._layout_hash(summary.arrays)))
        con.executemany("INSERT OR IGNORE INTO graphs VALUES (?, ?)", list(p.graphs.items()))
        con.executemany("INSERT OR REPLACE INTO iterations VALUES (?, ?, ?)",
                        [(p.step, i, h) for i, h in p.iteration_graphs])
        self._write_quantities(p.quantities)
        self._write_anomalies(p.anomalies)
        con.executemany("INSERT OR REPLACE INTO kpis VALUES (?, ?, ?, ?)", p.kpis)
        # The steps row last: a reader that sees it sees the whole step (same transaction anyway).
        # Plain INSERT: a committed step is never rewritten (a second writer's or a resumed
        # run's step number that exists fails here, and only that step is skipped).
        con.execute("INSERT INTO steps VALUES (?, ?, ?, ?)",
                    (p.step, p.kind, p.wall_time, p.iterations))

    def _layout_hash(self, entries: list[tuple]) -> str:
        """The hash of a step's array layout, stored in `layouts` when new (a steady run's
        steps all have the last one: compared, not encoded again)."""
        if self._layout is not None and self._layout[0] == entries:
            return self._layout[1]
        body = json.dumps(entries, separators=(",", ":"))
        digest = hashlib.sha1(body.encode()).hexdigest()[:16]
        self._con.execute("INSERT OR IGNORE INTO layouts VALUES (?, ?)", (digest, body))
        self._layout = (list(entries), digest)
        self._new_layout = True
        return digest

    def _write_quantities(self, values: list[QuantityValue]) -> None:
        con = self._con
        for q in values:
            table = "local_quantities" if q.local else "quantities"
            con.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?, ?, ?)",
                        (q.name, q.layer, q.step, _to_float(q.value),
                         json.dumps(q.meta, default=_json_default)))
            if q.array is not None and not q.local:
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


def _describe(item: Any) -> str:
    """An item of the queue in words, for warnings and flush()."""
    if isinstance(item, str):
        return item
    if isinstance(item, StepPayload):
        return f"step {item.step}"
    return {_Kpis: "KPIs", _Note: "a note", _Quantities: "instrument values",
            _Anomalies: "anomaly findings"}.get(type(item), type(item).__name__)


def _after_fork_in_child() -> None:
    for writer in list(_live_writers):
        writer._forked()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
