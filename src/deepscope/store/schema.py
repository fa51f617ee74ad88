"""The on-disk format of one rank of one run: a SQLite database in WAL mode.

Every table is plain SQL; arrays are raw little-endian bytes described by a dtype name and a
JSON shape (see `arrays.py`; docs/format.md describes every version). Nothing here can
execute code when read.
"""

SCHEMA_VERSION = 4
# Versions this deepscope reads, and resumes in their own layout. 3 differs from 2 only in
# the primary key of `arrays` (step first). 4 keys `records` by step first too, indexes a
# step's arrays by one row of `step_arrays` (a layout shared by the steps that have it)
# instead of one `arrays` row per array, and stores parts under two more codecs
# (codecs.SPARSE4, codecs.SPLIT2_ZLIB): a step's commit writes a few pages, not ~60.
READABLE_VERSIONS: tuple[int, ...] = (2, 3, 4)
# The first version that indexes arrays by `step_arrays` and `layouts` (older: `arrays` rows).
LAYOUT_VERSION = 4


APPLICATION_ID = 0x44534350  # "DSCP": marks the file as a deepscope store for `file(1)` and us

SAMPLE_MAX_VALUES = 65536  # the stored full values of one batch item are cut to this many

# Statistics stored for every tensor record, in column order. Units: those of the tensor.
STAT_COLUMNS: tuple[str, ...] = (
    "numel",      # number of elements
    "mean",       # over finite elements
    "std",        # population (ddof=0), over finite elements
    "abs_mean",
    "min",
    "max",
    "abs_max",
    "norm",       # L2 norm of the finite elements
    "zero_frac",  # fraction of elements exactly 0
    "nan",        # count
    "posinf",     # count
    "neginf",     # count
    "sv_max",     # largest singular value (2-D parameters, optional; NULL otherwise)
)

DDL = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, kind TEXT NOT NULL, wall_time REAL NOT NULL,
    iterations INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tensors (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, role TEXT NOT NULL, node TEXT NOT NULL,
    role_in_node TEXT NOT NULL, shape TEXT NOT NULL, dtype TEXT NOT NULL, batch_dim INTEGER);
CREATE TABLE IF NOT EXISTS records (
    tensor_id INTEGER NOT NULL, direction TEXT NOT NULL, step INTEGER NOT NULL,
    iteration INTEGER NOT NULL, {", ".join(c + " REAL" for c in STAT_COLUMNS)},
    PRIMARY KEY (step, iteration, tensor_id, direction)) WITHOUT ROWID;
-- Keyed by step first since version 4: a step's rows are appended together (1-2 pages per
-- commit; keyed by tensor first, each of a 24-tensor step's rows dirtied a page of its own).
-- Files of versions 2 and 3 keep their key (tensor_id, direction, step, iteration) and an
-- index records_by_step (step, iteration); the columns, and so every query, are the same.
-- The arrays of one step live in a few blobs, one per part (dtype and device), each
-- compressed by `codec` (see codecs.py): few, full overflow pages instead of a partly empty
-- page per array. `step_arrays` (version 4) or `arrays` (versions 2 and 3) indexes into the
-- uncompressed parts.
CREATE TABLE IF NOT EXISTS step_blobs (
    step INTEGER NOT NULL, part INTEGER NOT NULL, codec TEXT NOT NULL,
    raw_bytes INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (step, part));
-- Versions 2 and 3: one row per array (empty in version 4 files). Keyed by step first in
-- version 3: a step's rows are appended together (version 2's key began with tensor_id).
CREATE TABLE IF NOT EXISTS arrays (
    tensor_id INTEGER NOT NULL, direction TEXT NOT NULL, view TEXT NOT NULL,
    step INTEGER NOT NULL, iteration INTEGER NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
    part INTEGER NOT NULL, offset INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    PRIMARY KEY (step, tensor_id, direction, iteration, view)) WITHOUT ROWID;
-- Version 4: a step's array index is one row naming its layout; a layout (JSON list of
-- [tensor name, direction, view, iteration, dtype, JSON shape, part, offset, nbytes] per
-- array) is stored once for all the steps that have it (every step of a steady run).
CREATE TABLE IF NOT EXISTS step_arrays (step INTEGER PRIMARY KEY, layout TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS layouts (hash TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS graphs (hash TEXT PRIMARY KEY, body TEXT NOT NULL);
-- `iterations` and `kpis` are WITHOUT ROWID since version 4: one b-tree each, so a commit
-- writes one page of each, not a table page and its key's index page.
CREATE TABLE IF NOT EXISTS iterations (
    step INTEGER NOT NULL, iteration INTEGER NOT NULL, graph TEXT NOT NULL,
    PRIMARY KEY (step, iteration)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kpis (
    name TEXT NOT NULL, step INTEGER NOT NULL, kind TEXT NOT NULL, value REAL,
    PRIMARY KEY (name, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY, wall_time REAL NOT NULL, step INTEGER, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quantities (
    name TEXT NOT NULL, layer TEXT NOT NULL, step INTEGER NOT NULL, value REAL,
    meta TEXT NOT NULL, PRIMARY KEY (name, layer, step));
CREATE TABLE IF NOT EXISTS quantity_arrays (
    name TEXT NOT NULL, layer TEXT NOT NULL, step INTEGER NOT NULL, dtype TEXT NOT NULL,
    shape TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (name, layer, step));
CREATE TABLE IF NOT EXISTS anomalies (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, tensor TEXT NOT NULL, detector TEXT NOT NULL,
    value REAL, threshold REAL, message TEXT NOT NULL);
-- Added within schema version 2 (files recorded before lack it; readers treat it as empty):
-- each distinct recording warning once, at the step it first occurred. `location` is what
-- it is about (a module or parameter label, "" for the whole run), `quantities` a JSON list
-- of the instrument quantities it affects.
CREATE TABLE IF NOT EXISTS warnings (
    id INTEGER PRIMARY KEY, step INTEGER, location TEXT NOT NULL, quantities TEXT NOT NULL,
    message TEXT NOT NULL);
-- Added within schema version 2: a distributed run's values of this rank's own micro-batch
-- (local loss, pre-sync gradient norm, batch size), beside the global ones in `quantities`
-- (written by rank 0 only).
CREATE TABLE IF NOT EXISTS local_quantities (
    name TEXT NOT NULL, layer TEXT NOT NULL, step INTEGER NOT NULL, value REAL,
    meta TEXT NOT NULL, PRIMARY KEY (name, layer, step));
"""

# Tables added after their schema version was first released: older files of that version
# lack them, so a reader checks them only where present and reads them as empty otherwise.
OPTIONAL_TABLES: frozenset[str] = frozenset({"warnings", "local_quantities"})
# Tables a file has from this schema version on (older files lack them: a resumed older run
# may have them empty, created by a newer writer's DDL, and they are not read there).
VERSION_TABLES: dict[str, int] = {"step_arrays": LAYOUT_VERSION, "layouts": LAYOUT_VERSION}


def is_readable(version: object) -> bool:
    """Whether a stored `schema_version` value (a string) is one this deepscope reads."""
    return version in [str(v) for v in READABLE_VERSIONS]
