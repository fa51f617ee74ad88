"""Hostile and corrupt input: opening a recording someone sent you never runs code, never
crashes, never allocates what the file merely declares — it reads, or says in one line why not.

The damaged files are copies of one small real run (tests/stress/fuzz_store.py makes it);
the crafted ones are that run edited with SQL. Hypothesis flips bytes and truncates it, and
throws random metadata at the array decoder.
"""

from __future__ import annotations

import ast
import json
import re
import sqlite3
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepscope
from deepscope import CorruptRunError
from deepscope.store import arrays, codecs, limits, reader
from deepscope.store.reader import StoreReader
from tests.stress import fuzz_store, workload

PACKAGE = Path(deepscope.__file__).parent
FUZZ = settings(deadline=None, derandomize=True, max_examples=100)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> bytes:
    """The bytes of a small, complete, cleanly closed run file."""
    return fuzz_store.make_sample_run(tmp_path_factory.mktemp("sample")).read_bytes()


@pytest.fixture(scope="module")
def trial(tmp_path_factory) -> fuzz_store.Trial:
    return fuzz_store.Trial(tmp_path_factory.mktemp("trial"))


def run_with(tmp_path: Path, data: bytes, *sql: str) -> Path:
    """A run folder holding `data` as its rank file, edited by `sql` statements."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "rank0.sqlite").write_bytes(data)
    if sql:
        con = sqlite3.connect(run_dir / "rank0.sqlite")
        for statement in sql:
            con.execute(statement)
        con.commit()
        con.close()
    return run_dir


def refusal(run_dir: Path) -> str:
    """The one-line CorruptRunError reading `run_dir` raises."""
    with pytest.raises(CorruptRunError) as e:
        fuzz_store.read_everything(run_dir)
    message = str(e.value)
    assert message.isprintable(), repr(message)  # one line, no control characters
    return message


# --- not a store, damaged, from elsewhere -------------------------------------------------
NOT_SQLITE = "is not a deepscope store (not a SQLite file)"


@pytest.mark.parametrize("data, expected", [
    (b"", NOT_SQLITE), (b"garbage" * 10, NOT_SQLITE),
    (b"\x89PNG\r\n\x1a\n" + bytes(100), NOT_SQLITE), (bytes(range(256)) * 16, NOT_SQLITE),
    (b"SQLite format 3\x00" + bytes(4080), "is not a readable deepscope store (file is not a "
                                           "database)"),
], ids=["empty", "text", "png", "binary", "sqlite-magic-then-zeros"])
def test_non_sqlite_files_are_refused(tmp_path, data, expected):
    assert expected in refusal(run_with(tmp_path, data))


@pytest.mark.parametrize("keep", [100, 4096, 0.5, -4096], ids=["header", "page1", "half",
                                                               "last-page-gone"])
def test_truncated_files_are_refused(tmp_path, sample, keep):
    cut = int(len(sample) * keep) if isinstance(keep, float) else keep % len(sample)
    refusal(run_with(tmp_path, sample[:cut]))


def test_another_apps_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "run" / "rank0.sqlite"
    path.parent.mkdir()
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE contacts (name TEXT)")
    con.close()
    assert "is not a deepscope store: table 'meta' is missing" in refusal(path.parent)


def test_a_newer_schema_version_asks_for_an_upgrade(tmp_path, sample):
    run_dir = run_with(tmp_path, sample,
                       "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    assert "has schema version '99'; this deepscope reads versions 2, 3 and 4 (upgrade deepscope" \
        in refusal(run_dir)
    with pytest.raises(ValueError, match="schema version 99.*new run name"):
        deepscope.Scope(tmp_path, "run", resume=True)  # and the writer will not touch it


def test_an_older_schema_version_is_refused_in_one_line(tmp_path, sample):
    run_dir = run_with(tmp_path, sample,
                       "UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    assert "has schema version '1'; this deepscope reads versions 2, 3 and 4 (read it with the " \
        "deepscope release that recorded it)" in refusal(run_dir)
    with pytest.raises(ValueError, match="schema version 1.*new run name"):
        deepscope.Scope(tmp_path, "run", resume=True)


# --- crafted schemas: SQL that SQLite would evaluate while we read --------------------------
INFINITE_VIEW = ("CREATE VIEW steps AS WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 "
                 "FROM n) SELECT i AS step, 'k' AS kind, 0.0 AS wall_time, 1 AS iterations FROM n")
HUGE_GENERATED = ("CREATE TABLE kpis (name TEXT NOT NULL, step INTEGER NOT NULL, kind TEXT NOT "
                  "NULL, value REAL GENERATED ALWAYS AS (length(printf('%.*c', 900000000, 'x')))"
                  " VIRTUAL, PRIMARY KEY (name, step))")
DEFAULTED = ("CREATE TABLE notes (id INTEGER PRIMARY KEY, wall_time REAL NOT NULL, step INTEGER,"
             " text TEXT NOT NULL DEFAULT (printf('%.*c', 900000000, 'x')))")


@pytest.mark.parametrize("sql, expected", [
    (("DROP TABLE steps", INFINITE_VIEW), "table 'steps' is a view"),
    (("DROP TABLE meta", "CREATE VIEW meta AS SELECT 'schema_version' AS key, '1' AS value"),
     "table 'meta' is a view"),
    (("DROP TABLE kpis", HUGE_GENERATED), "table 'kpis' has unexpected columns"),
    (("DROP TABLE notes", DEFAULTED), "table 'notes' has unexpected columns"),
    (("DROP TABLE anomalies",), "table 'anomalies' is missing"),
], ids=["view-for-table", "view-for-meta", "generated-column", "default-expression",
        "missing-table"])
def test_crafted_schemas_are_refused_before_any_query(tmp_path, sample, sql, expected):
    assert expected in refusal(run_with(tmp_path, sample, *sql))


# --- crafted array metadata ------------------------------------------------------------------
def input_samples(column: str, value: object) -> str:
    """SQL setting `column` of the stored samples of `input` at step 0 (an SQL expression;
    {offset}, {nbytes}, {part}: the current values)."""
    return fuzz_store.set_array({column: value})


@pytest.mark.parametrize("column, value, expected", [
    ("shape", "'[1073741824, 1073741824]'", "declares shape"),
    ("shape", "'[-1]'", "invalid shape"),
    ("shape", "'[true]'", "invalid shape"),
    ("shape", "'[2.5]'", "invalid shape"),
    ("shape", "'[' || substr(replace(hex(zeroblob(33)), '00', '1,'), 1, 65) || ']'",
     "invalid shape"),  # 33 dims
    ("shape", "'{\"dims\": 2}'", "invalid shape"),
    ("shape", "'not json'", "unreadable shape"),
    ("shape", "'[' || replace(hex(zeroblob(5000)), '00', '[')", "overlong"),
    ("shape", "5", "wrong structure"),  # a number, not JSON text
    ("dtype", "'object'", "unknown dtype"),
    ("dtype", "'complex128'", "unknown dtype"),
    ("dtype", "'>f4'", "unknown dtype"),
    ("offset", "(SELECT raw_bytes FROM step_blobs WHERE step = 0 AND part = {part}) + 8",
     "holds 0 bytes|points outside"),
    ("nbytes", "{nbytes} + 4", "declares shape|points outside"),
    ("offset", "{offset} + 4", None),  # misaligned: must still be the declared size or refused
    ("offset", "1.5", "wrong structure"),
    ("dtype", "7", "wrong structure"),
], ids=lambda v: str(v)[:24])
def test_crafted_array_metadata_is_refused(tmp_path, sample, column, value, expected):
    with deepscope.open_run(run_with(tmp_path, sample, input_samples(column, value))) as run:
        try:
            arr = run.values("input", 0, view="samples")
        except CorruptRunError as e:
            assert expected is None or re.search(expected, str(e))
            assert str(e).isprintable()
        else:
            assert expected is None and arr.shape == (workload.MAX_SAMPLES, 6)


def test_a_huge_declared_array_allocates_nothing(tmp_path, sample):
    """1 GiB declared over a few bytes: refused without allocating the declared size."""
    run_dir = run_with(tmp_path, sample, input_samples("shape", "'[268435456]'"))
    assert refusal_peak(run_dir, "samples", "1073741824 bytes") < 8 * 2**20


def refusal_peak(run_dir, view: str, match: str) -> int:
    """Peak bytes Python allocated while reading `view` of the input at step 0 is refused."""
    with deepscope.open_run(run_dir) as run:
        tracemalloc.start()
        try:
            with pytest.raises(CorruptRunError, match=match):
                run.values("input", 0, view=view)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


@pytest.mark.parametrize("offset, nbytes, shape", [(-9, 8, "'[2]'"), (56, -48, "'[2, 6]'")],
                         ids=["negative-offset", "negative-length"])
def test_offsets_and_lengths_outside_the_blob_are_refused(tmp_path, sample, offset, nbytes,
                                                          shape):
    sql = [input_samples("offset", offset), input_samples("nbytes", nbytes),
           input_samples("shape", shape)]
    with deepscope.open_run(run_with(tmp_path, sample, *sql)) as run:
        with pytest.raises(CorruptRunError):
            run.values("input", 0, view="samples")


@pytest.mark.parametrize("offset, nbytes", [(-8, 8), (8, -8), (60, 8), (0, None), ("0", 8)])
def test_decode_slice_refuses_bytes_outside_the_part(tmp_path, sample, offset, nbytes):
    reader_ = StoreReader(run_with(tmp_path, sample) / "rank0.sqlite")
    assert reader_.decode_slice("float32", "[2]", 56, 8, bytes(64)).tolist() == [0, 0]
    with pytest.raises(CorruptRunError, match="points outside its step's data"):
        reader_.decode_slice("float32", "[2]", offset, nbytes, bytes(64))
    reader_.close()


def test_a_listed_view_without_data_is_reported_as_damage(tmp_path, sample):
    with deepscope.open_run(run_with(tmp_path, sample, "DELETE FROM step_blobs")) as run:
        assert "samples" in run.views("input", 0)
        with pytest.raises(CorruptRunError):
            run.values("input", 0, view="samples")


# --- crafted step data: codecs, sizes, compressed streams -----------------------------------
def views_part(column: str, value: object) -> str:
    """SQL setting `column` of step 0's part 1 (its bfloat16 views, stored split2-zlib)."""
    return f"UPDATE step_blobs SET {column} = {value} WHERE step = 0 AND part = 1"


def blob(data: bytes) -> str:
    return f"x'{data.hex()}'"


ODD = zlib.compress(bytes(range(101)))  # a valid stream of an odd number of bytes


@pytest.mark.parametrize("sql, expected", [
    ([views_part("codec", "'lz4'")], "unknown codec 'lz4'"),
    ([views_part("codec", "'raw'")], r"holds \d+ bytes, not the declared \d+"),
    ([views_part("codec", "'zlib'")], "not a valid zlib stream"),  # low bytes first
    ([views_part("codec", "'shuffle2-zlib'")], "not a valid shuffle2-zlib stream"),
    ([views_part("raw_bytes", "raw_bytes + 1")], "odd length"),
    ([views_part("raw_bytes", "raw_bytes - 2")], "not a valid split2-zlib stream"),
    ([views_part("codec", "'raw'"), views_part("raw_bytes", "length(data) + 2")],
     r"holds (\d+) bytes, not the declared (?!\1)\d+"),
    ([views_part("raw_bytes", "1 << 50")], "declares 1125899906842624 bytes, more than"),
    ([views_part("raw_bytes", "-1")], "invalid size '-1'"),
    ([views_part("raw_bytes", "'many'")], "invalid size 'many'"),
    ([views_part("raw_bytes", "1026.5")], "invalid size '1026.5'"),
    ([views_part("data", "substr(data, 1, 300)")], r"shorter \(300 bytes\) than its low bytes"),
    ([views_part("data", "substr(data, 1, length(data) - 9)")],
     r"holds \d+ bytes, not the declared|truncated"),
    ([views_part("data", "CAST(data || x'00' AS BLOB)")], "bytes after it"),
    ([views_part("data", "zeroblob(730)")], "not a valid split2-zlib stream"),
    ([views_part("data", "'text'")], "not a blob"),
    ([views_part("data", blob(ODD)), views_part("raw_bytes", 101)], "odd length"),
    (["DELETE FROM step_blobs WHERE part = 1"], "step 0 has arrays but no data for part 1"),
    ([input_samples("part", 7)], "no data for part 7"),
    ([input_samples("part", "'first'")], "wrong structure"),
], ids=lambda v: str(v)[:40])
def test_crafted_step_data_is_refused(tmp_path, sample, sql, expected):
    view = "samples" if "layouts" in sql[0] else "neuron_mean"
    with deepscope.open_run(run_with(tmp_path, sample, *sql)) as run:
        try:
            run.values("input", 0, view=view)
        except CorruptRunError as e:
            assert expected is not None and re.search(expected, str(e)), str(e)
            assert str(e).isprintable()
        else:
            assert expected is None


@pytest.mark.parametrize("raw_bytes", [1000, 2**40], ids=["small", "huge"])
def test_a_zlib_bomb_allocates_nothing(tmp_path, sample, raw_bytes):
    """64 MiB of zeros in 64 kB of zlib, under a declared size that lies either way."""
    bomb = zlib.compress(bytes(64 * 2**20), 9)
    run_dir = run_with(tmp_path, sample, views_part("data", blob(bomb)),
                       views_part("raw_bytes", raw_bytes), views_part("codec", "'zlib'"))
    assert refusal_peak(run_dir, "neuron_mean", "not the declared|more than") < 8 * 2**20


def test_histogram_stored_as_text_is_refused(tmp_path, sample):
    run_dir = run_with(tmp_path, sample, "UPDATE quantity_arrays SET data = 'abcd'")
    with deepscope.open_run(run_dir) as run, pytest.raises(CorruptRunError, match="not a blob"):
        run.histogram("GradHist1d", 1, "0.weight")


# --- crafted sizes and types: refused before allocation, peak memory within the cap ---------
CRAFTED_REFUSALS = {
    "iterations-3e6": "stored steps.iterations is 3000000, outside [0, 10000]",
    "iterations-1e12": "stored steps.iterations is 1000000000000, outside",
    "iterations-inf": "stored steps.iterations holds inf, not an integer",
    "tensor-shape-1e12x3": "stored tensors.shape holds [1000000000000, 3], not a shape",
    "array-shape-0x1e20": "invalid shape '[0, 99999999999999999999]'",
    "zlib-bomb-41MB": "declares 42991616 bytes, more than the cap of 16777216 for this file",
    "zlib-bomb-410MB": "declares 429916160 bytes, more than the cap of 16777216 for this file",
    "histogram-bins-250M": "GradHist1d histogram metadata at step 1 edges bins is 250000000, "
                           "outside",
    "histogram-bins-2e9": "edges bins is 2000000000, outside",
    "histogram-edges-text": "edges holds ['a', 2, 4], not [lo, hi, bins]",
    "graph-40k-two-cycles": "stored graph tensor count is 40000, outside [0, 20000]",
    "note-blob": r"stored notes.text holds b'\x00\xff', not text",
    "kpi-text": "stored kpis.value holds 'abc', not a number",
    "stat-text": "stored records.mean holds 'abc', not a number",
    "kpi-step-text": "stored kpis.step holds 'abc0', not an integer",
    "quantity-step-real": "stored quantities.step holds 1.5, not an integer",
    "quantity-value-text": "stored quantities.value holds 'abc', not a number",
    "record-iteration-text": "stored records.iteration holds 'abc0', not an integer",
    "anomaly-step-text": "stored anomalies.step holds 'abc', not an integer",
}


def test_every_crafted_case_has_an_expected_refusal():
    assert set(CRAFTED_REFUSALS) == set(fuzz_store.CRAFTED)


@pytest.mark.parametrize("case", list(CRAFTED_REFUSALS))
def test_crafted_sizes_are_refused_in_one_line_within_the_memory_cap(tmp_path, sample, case):
    """Before: iterations, shapes, bins and graphs were read as declared (the GUI then spent
    14-51 s or GBs on them), bombs decoded (41 MB: +288 MB RSS, 410 MB: +2.9 GB), wrong types
    raised raw numpy/pandas errors. Now: one line naming the field, nothing allocated."""
    run_dir = fuzz_store.crafted_run(tmp_path, sample, case)
    size = (run_dir / "rank0.sqlite").stat().st_size
    tracemalloc.start()
    try:
        result, rss = fuzz_store.peak_rss_of(lambda: fuzz_store.read_everything(run_dir))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(result, CorruptRunError), result
    assert CRAFTED_REFUSALS[case] in str(result) and str(result).isprintable(), result
    assert rss <= limits.read_peak_cap(size)
    assert peak < 8 * 2**20 + 8 * size  # refused before anything of the declared size exists


@pytest.mark.parametrize("verb", [["plot", "-o", "{tmp}/x.png"],
                                  ["export", "--tensorboard", "{tmp}/tb"]], ids=lambda v: v[0])
def test_plot_and_export_refuse_crafted_histogram_bins_in_one_line(tmp_path, sample, capsys,
                                                                   verb):
    """Before: 250M bins made `plot` peak at 2.2 GB and `export --tensorboard` at 4.1 GB;
    2e9 bins ended in a 19-line traceback."""
    from deepscope.cli.main import main
    for case in ("histogram-bins-250M", "histogram-bins-2e9"):
        run_dir = fuzz_store.crafted_run(tmp_path, sample, case)
        tracemalloc.start()
        try:
            code = main([verb[0], str(run_dir), *(a.format(tmp=tmp_path) for a in verb[1:])])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "edges bins is" in err, err
        assert peak < 64 * 2**20


def test_a_part_within_the_cap_reads_and_the_cap_follows_the_file_size(tmp_path, sample,
                                                                      monkeypatch):
    """16 MiB of zeros (a 16 kB stream) is allowed in any file; 17 MiB only in a file of
    more than a quarter of that."""
    run_dir = fuzz_store.crafted_run(tmp_path, sample, "iterations-inf")  # any run folder
    for raw, ok in ((16 * 2**20, True), (17 * 2**20, False)):
        con = sqlite3.connect(run_dir / "rank0.sqlite")
        for statement in fuzz_store._bomb(raw):
            con.execute(statement)
        con.commit()
        con.close()
        with deepscope.open_run(run_dir) as run:
            if ok:
                assert run.values("input", 0, view="samples").shape == (raw // 2,)
            else:
                with pytest.raises(CorruptRunError, match="more than the cap of 16777216"):
                    run.values("input", 0, view="samples")
    monkeypatch.setattr(limits, "MIN_PART_CAP", 0)
    assert limits.part_cap(1000) == 4000 and limits.read_peak_cap(1000) == 64 * 2**20 + 12000


def test_the_decoded_parts_a_reader_keeps_are_bounded_in_bytes(tmp_path, sample, monkeypatch):
    """Before: the last 8 parts whatever their size (8 bombs: 8 x 41 MB kept)."""
    reader_ = StoreReader(run_with(tmp_path, sample) / "rank0.sqlite")
    one = len(reader_.step_part(0, 0))
    monkeypatch.setattr(limits, "PART_CACHE_BYTES", one + 1)
    reader_.step_part(0, 1)
    reader_.step_part(1, 0)
    assert list(reader_._parts) == [(1, 0)]
    reader_.close()


def test_tensors_of_many_dims_read_back(tmp_path):
    """Before: a 10-dim tensor recorded fine but its samples were refused as corrupt."""
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope, scope.step(0) as rec:
        rec.tensor("x", torch.ones([2] * 10), role="input")
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.tensors()["shape"].tolist() == [[2] * 10]
        assert run.values("x", 0, view="samples").shape == (2,) * 10


def test_bfloat16_views_decode_without_temporaries_and_exactly():
    values = torch.tensor([[1.5, -2.0, 3.0e38], [float("inf"), float("nan"), -0.0]])
    name, shape, data = arrays.encode(values.bfloat16())
    out = arrays.decode(name, shape, memoryview(data))
    np.testing.assert_array_equal(out, values.bfloat16().float().numpy())
    assert out.dtype == np.float32 and out.flags.writeable


# --- crafted JSON ----------------------------------------------------------------------------
def test_invalid_and_deeply_nested_json_is_refused_or_kept_as_text(tmp_path, sample):
    deep = "'" + "[" * 100_000 + "'"
    run_dir = run_with(tmp_path, sample, f"UPDATE graphs SET body = {deep}",
                       f"UPDATE meta SET value = {deep} WHERE key = 'run'")
    with deepscope.open_run(run_dir) as run:
        assert run.meta()["run"] == "[" * 100_000  # not JSON: the raw text, no RecursionError
        with pytest.raises(CorruptRunError, match="stored graph is not valid JSON"):
            run.graph(0)


@pytest.mark.parametrize("body", ['[]', '{"tensors": [1], "edges": []}',
                                  '{"tensors": [{"name": "a"}], "edges": []}',
                                  '{"tensors": [], "edges": [{"source": 1}]}', '"text"'])
def test_decode_graph_checks_the_structure(body):
    with pytest.raises(CorruptRunError, match="wrong structure"):
        StoreReader.decode_graph(body)


def test_decode_graph_accepts_a_recorded_graph(tmp_path, sample):
    with deepscope.open_run(run_with(tmp_path, sample)) as run:
        body = StoreReader(run.path / "rank0.sqlite").query("SELECT body FROM graphs")[0][0]
        assert StoreReader.decode_graph(body) == json.loads(body)


def test_a_graph_that_is_json_but_not_a_graph_is_refused(tmp_path, sample):
    with deepscope.open_run(run_with(tmp_path, sample, "UPDATE graphs SET body = '[]'")) as run:
        with pytest.raises(CorruptRunError):
            run.graph(0)


# --- links: nothing outside the folder given is read ----------------------------------------
@pytest.fixture
def linked_project(tmp_path, sample) -> Path:
    """project/: inside (a run), local-link (rank0.sqlite -> a file beside it), linked-run (a
    link to a run folder elsewhere), linked-file (rank0.sqlite -> a file elsewhere)."""
    (tmp_path / "outside").mkdir()
    outside = run_with(tmp_path / "outside", sample)
    project = tmp_path / "project"
    for name in ("inside", "local-link", "linked-file"):
        (project / name).mkdir(parents=True)
    (project / "inside" / "rank0.sqlite").write_bytes(sample)
    (project / "local-link" / "kept.db").write_bytes(sample)
    (project / "local-link" / "rank0.sqlite").symlink_to("kept.db")
    (project / "linked-run").symlink_to(outside)
    (project / "linked-file" / "rank0.sqlite").symlink_to(outside / "rank0.sqlite")
    return project


def test_links_leaving_the_folder_are_not_listed_or_read(linked_project):
    """Before: the GUI listed and served linked-run, and every reader read linked-file."""
    from deepscope.gui.data import ProjectData
    assert deepscope.open_project(linked_project).runs() == ["inside", "local-link"]
    assert ProjectData(linked_project).runs() == ["inside", "local-link"]
    with pytest.raises(ValueError, match="no run 'linked-run'"):
        ProjectData(linked_project).run("linked-run")
    assert deepscope.open_run(linked_project / "local-link").steps() == [0, 1]
    with pytest.raises(ValueError, match="rank0.sqlite in .* is a link to a file outside the "
                                         "run folder; .* copy the file into the run folder"):
        deepscope.open_run(linked_project / "linked-file")


@pytest.mark.parametrize("verb", [["ls"], ["doctor"], ["plot", "-o", "{tmp}/x.png"],
                                  ["export", "--parquet", "{tmp}/pq"]],
                         ids=lambda v: v[0])
def test_cli_verbs_refuse_a_rank_file_linked_from_outside(linked_project, tmp_path, capsys,
                                                          verb):
    from deepscope.cli.main import main
    argv = [verb[0], str(linked_project / "linked-file"),
            *(a.format(tmp=tmp_path) for a in verb[1:])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is a link to a file outside the run folder" in err and err.count("\n") == 1


# --- names are data, never SQL or markup -----------------------------------------------------
HOSTILE_NAMES = ["x'); DROP TABLE steps; --", 'y" OR 1=1 --', "z\n\x1b[31mred", "../../etc"]


def test_sql_and_control_characters_in_names_are_plain_data(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        scope.note(HOSTILE_NAMES[0])
        with scope.step(0, kind=HOSTILE_NAMES[1]) as rec:
            for i, name in enumerate(HOSTILE_NAMES):
                rec.tensor(name, torch.full((2, 2), float(i)), role="input")
                rec.kpi(name, i)
    run = deepscope.open_run(tmp_path / "r")
    assert list(run.tensors()["name"]) == HOSTILE_NAMES
    assert run.kinds() == [HOSTILE_NAMES[1]] and run.steps() == [0]
    assert list(run.notes()["text"]) == [HOSTILE_NAMES[0]]
    for i, name in enumerate(HOSTILE_NAMES):
        assert (run.values(name, 0, view="samples") == i).all()
        assert run.kpis(name)["value"].tolist() == [i]


ESCAPES = "char(27) || ']52;c;SGVsbG8=' || char(7) || char(27) || '[2J' || char(8238)"


def test_ls_and_doctor_show_control_characters_instead_of_obeying_them(tmp_path, sample,
                                                                        capsys):
    """Before: ESC ] 52 (clipboard write), ESC [ 2 J (clear screen) and U+202E (reverse the
    line) in kinds, tensor names and anomaly messages reached the terminal raw."""
    from deepscope.cli.main import main
    run_dir = run_with(tmp_path, sample, f"UPDATE steps SET kind = 'k' || {ESCAPES}",
                       f"UPDATE kpis SET kind = 'k' || {ESCAPES}",
                       f"UPDATE anomalies SET tensor = 't' || {ESCAPES}, "
                       f"message = 'm' || {ESCAPES}")
    for verb in ("ls", "doctor"):
        assert main([verb, str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert not any(c in out for c in "\x1b\x07\u202e"), repr(out)
        shown = "\\x1b]52;c;SGVsbG8=\\x07\\x1b[2J\\u202e"
        assert (shown[:16] if verb == "ls" else shown) in out  # ls cuts kinds at 20


def test_clean_escapes_what_a_terminal_would_obey():
    from deepscope.cli.text import clean
    assert clean("plain – ünïcode") == "plain – ünïcode"
    assert clean("a\x1b[2Jb\n\tc\x9b") == "a\\x1b[2Jb\\n\\tc\\x9b"
    assert clean("line\n\tnext\r", keep="\n\t") == "line\n\tnext\\r"


def test_project_paths_with_uri_characters_open_the_right_file(tmp_path):
    project = tmp_path / "exp?mode=rw#1 %41"
    with deepscope.Scope(project, "r", schedule=1) as scope:
        with scope.step(3) as rec:
            rec.tensor("x", torch.ones(2), role="input")
    assert deepscope.open_run(project / "r").steps() == [3]


# --- read-only disks: immutable mode only where it cannot hide committed steps --------------
@pytest.fixture
def read_only_disk(monkeypatch):
    """Make every mode=ro open fail, as on a read-only disk without the -shm file."""
    connect = sqlite3.connect

    def fake(database: str, *args: object, **kwargs: object) -> sqlite3.Connection:
        if "mode=ro" in str(database):
            raise sqlite3.OperationalError("unable to open database file")
        return connect(database, *args, **kwargs)
    monkeypatch.setattr(reader.sqlite3, "connect", fake)


def test_read_only_disk_reads_a_closed_run(tmp_path, sample, read_only_disk):
    assert fuzz_store.read_everything(run_with(tmp_path, sample)) > 0


def test_read_only_disk_never_hides_a_write_ahead_log(tmp_path, read_only_disk):
    copy = workload.crashed_copy(tmp_path)
    assert (copy / "rank0.sqlite-wal").stat().st_size > 0
    assert "write-ahead log" in refusal(copy)


def test_a_crashed_copy_shows_every_committed_step(tmp_path):
    with deepscope.open_run(workload.crashed_copy(tmp_path)) as run:
        assert run.steps() == [0]
        workload.check_steps(run, 0, [0])


# --- property tests ----------------------------------------------------------------------------
@FUZZ
@given(st.data())
def test_flipped_bytes_read_or_refuse_in_one_line(sample, trial, data):
    targets = fuzz_store.structural_offsets(sample)
    position = st.one_of(st.integers(0, len(sample) - 1), st.sampled_from(targets))
    flips = data.draw(st.lists(st.tuples(position, st.integers(1, 255)), min_size=1,
                               max_size=8))
    trial.read(fuzz_store.flip(sample, flips))  # raises on anything but a one-line refusal


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_truncated_or_zeroed_files_read_or_refuse_in_one_line(sample, trial, data):
    if data.draw(st.booleans()):
        trial.read(sample[:data.draw(st.integers(0, len(sample) - 1))])
    else:
        trial.read(fuzz_store.zero_page(sample, data.draw(st.integers(0, 64))))


DTYPE_NAMES = [*arrays.DTYPES, arrays.BFLOAT16]


@settings(deadline=None, derandomize=True, max_examples=400)
@given(st.data())
def test_decode_returns_what_is_declared_or_refuses(data):
    dtype = data.draw(st.one_of(st.sampled_from(DTYPE_NAMES), st.text(max_size=12)))
    dims = data.draw(st.lists(st.integers(-2, 2**62), max_size=10))
    shape = data.draw(st.one_of(st.just(json.dumps(dims)), st.text(max_size=40)))
    itemsize = 2 if dtype == arrays.BFLOAT16 else getattr(arrays.DTYPES.get(dtype), "itemsize", 1)
    size = int(np.prod(dims, dtype=object)) * itemsize if dims and min(dims) >= 0 else 0
    blob = data.draw(st.one_of(st.binary(max_size=64),
                               st.binary(min_size=size, max_size=size) if size <= 4096
                               else st.nothing()))
    try:
        arr = arrays.decode(dtype, shape, blob)
    except CorruptRunError as e:
        assert str(e).isprintable()
        return
    assert list(arr.shape) == json.loads(shape) and arr.size * itemsize == len(blob)


@settings(deadline=None, derandomize=True, max_examples=400)
@given(st.data())
def test_codec_decode_returns_the_declared_size_or_refuses(data):
    raw = data.draw(st.binary(max_size=512))
    codec, stored = codecs.encode(raw, data.draw(st.sampled_from([1, 2, 4])))
    codec = data.draw(st.one_of(st.just(codec), st.sampled_from(codecs.CODECS),
                                st.text(max_size=12)))
    raw_bytes = data.draw(st.one_of(st.just(len(raw)), st.integers(-2, 2**62)))
    if data.draw(st.booleans()):  # damage the stored bytes
        stored = data.draw(st.one_of(st.binary(max_size=64),
                                     st.just(stored[:data.draw(st.integers(0, len(stored)))]),
                                     st.just(stored + data.draw(st.binary(max_size=8)))))
    try:
        out = codecs.decode(codec, raw_bytes, stored)
    except CorruptRunError as e:
        assert str(e).isprintable()
        return
    assert isinstance(out, bytes) and len(out) == raw_bytes


@settings(deadline=None, derandomize=True, max_examples=100)
@given(st.sampled_from(list(arrays.DTYPES)), st.lists(st.integers(0, 4), max_size=4),
       st.randoms(use_true_random=False))
def test_encode_decode_round_trip(dtype, dims, rnd):
    values = np.array([rnd.uniform(-100, 100) for _ in range(int(np.prod(dims)))])
    arr = values.astype(dtype).reshape(dims)
    name, shape, blob = arrays.encode(arr)
    np.testing.assert_array_equal(arrays.decode(name, shape, blob), arr)


# --- no code execution anywhere in the package ----------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "joblib"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__", "torch.load", "torch.jit.load",
                "pd.read_pickle", "pandas.read_pickle", "yaml.load", "yaml.unsafe_load"}
NUMPY_LOADS = {"np.load", "numpy.load"}  # unsafe only with allow_pickle


def pickles(call: ast.Call) -> bool:
    """True for np.load(..., allow_pickle=<anything but False>)."""
    return any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant)
                                                and k.value.value is False)
               for k in call.keywords)


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def unsafe_uses(source: str) -> list[str]:
    """What in `source` can turn stored bytes into running code (imports and calls)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] \
                in UNSAFE_MODULES:
            found.append(node.module or "")
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if (name in UNSAFE_CALLS or name.endswith("enable_load_extension")
                    or (name in NUMPY_LOADS and pickles(node))):
                found.append(f"{name}() at line {node.lineno}")
    return found


def test_the_scanner_finds_what_it_looks_for():
    source = ("import pickle\nfrom marshal import loads\nx = torch.load(f)\n"
              "np.load(f, allow_pickle=True)\neval('1')\ncon.enable_load_extension(True)\n"
              "model.eval()\nre.compile('x')\njson.loads(s)\nnp.load(f)\n"
              "np.load(f, allow_pickle=False)\n")
    assert unsafe_uses(source) == ["pickle", "marshal", "torch.load() at line 3",
                                   "np.load() at line 4", "eval() at line 5",
                                   "con.enable_load_extension() at line 6"]


def test_no_code_execution_paths_in_the_package():
    found = {str(p.relative_to(PACKAGE)): uses for p in sorted(PACKAGE.rglob("*.py"))
             if (uses := unsafe_uses(p.read_text()))}
    assert found == {}
    scripts = {p.name for p in PACKAGE.rglob("*.js")
               if "eval(" in (text := p.read_text()) or "new Function(" in text}
    assert scripts == set()
