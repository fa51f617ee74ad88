"""Fuzz the read path: damaged copies of a real run file must read or fail with one line.

Each trial takes a small but complete run (steps, arrays, graph, KPIs, note, instrument values
with a histogram, an anomaly), damages a copy — flipped bytes (anywhere, or aimed at page
headers and cell pointers, where SQLite keeps its structure), a truncation, or a zeroed
page — and reads everything the query API offers. The only acceptable failures are the
API's own one-line errors (see `Trial.read`); anything else is a bug. `pytest` runs a fixed
sample of these through hypothesis; this script runs a long random campaign:

    python -m tests.stress.fuzz_store [--files 2000] [--seed 0]

Prints one JSON line of figures (files tried, read fine, refused, escaped); exit 0 = none
escaped. `--crafted` instead reads each crafted file of `CRAFTED` (sizes a file declares:
iterations, shapes, compressed bombs, histogram bins, graph nodes, values of the wrong type)
and prints one JSON line per case with its peak RSS growth; exit 0 = every case refused in
one line (or read) within `limits.read_peak_cap`.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import resource
import sqlite3
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

import deepscope
from deepscope.instruments.base import QuantityValue
from deepscope.store import limits
from tests.stress import workload

RUN = "fuzzed"


def make_sample_run(root: Path) -> Path:
    """Record a small run touching every table; return its rank file (closed, no WAL)."""
    scope, model = workload.open_scope(root, "sample")
    scope.note("a note")
    for step in range(2):
        workload.train_step(scope, model, 0, step)
    scope.writer.submit_quantities([
        QuantityValue("GradNorm", 1, value=0.5, meta={"estimator": "exact"}),
        QuantityValue("GradHist1d", 1, layer="0.weight", array=np.arange(4.0),
                      meta={"edges": [0.0, 4.0, 4], "nan": 0})])
    scope.writer.submit_anomalies([(1, "0", "spike", 3.0, 2.0, "loss spiked")])
    scope.close()
    return root / "sample" / "rank0.sqlite"


def read_everything(run_dir: Path) -> int:
    """Call every read method of the query API on a run; return how many values came out."""
    with deepscope.open_run(run_dir) as run:
        n = len(run.meta()) + len(run.kinds()) + len(run.step_table()) + len(run.tensors())
        wide = run.stats_wide()
        n += len(run.stats(statistic="mean"))
        for step, it, tensor, direction in wide[["step", "iteration", "tensor", "direction"]
                                                 ].itertuples(index=False):
            for view in run.views(tensor, step, iteration=it, direction=direction):
                n += run.values(tensor, step, view=view, iteration=it, direction=direction).size
        for step in run.steps():
            n += len(run.graph(step)["edges"])
        n += len(run.kpis()) + len(run.notes()) + len(run.anomalies())
        quantities = run.quantities()
        for name, layer, step, meta in quantities[["name", "layer", "step", "meta"]
                                                  ].itertuples(index=False):
            if "edges" in meta:
                counts, _ = run.histogram(name, step, layer)
                n += counts.size
        return n + len(quantities)


def page_size(data: bytes) -> int:
    """The page size in a SQLite header (1 means 65536)."""
    size = int.from_bytes(data[16:18], "big")
    return 65536 if size == 1 else max(size, 512)


def structural_offsets(data: bytes) -> list[int]:
    """Offsets of the file header and of every page's header and cell pointers."""
    size = page_size(data)
    return [page + off for page in range(0, len(data), size) for off in range(64)
            if page + off < len(data)]


def flip(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    """XOR byte `pos % len(data)` with `mask` (1-255) for each (pos, mask)."""
    out = bytearray(data)
    for pos, mask in flips:
        out[pos % len(out)] ^= mask
    return bytes(out)


def zero_page(data: bytes, index: int) -> bytes:
    size = page_size(data)
    start = (index % max(1, len(data) // size)) * size
    return data[:start] + bytes(size) + data[start + size:]


class Trial:
    """Writes damaged bytes as the rank file of a run folder and reads them back."""

    def __init__(self, root: Path) -> None:
        self.dir = root / RUN
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / "rank0.sqlite"

    def read(self, data: bytes) -> int | Exception:
        """The values read, or the one-line error of the query API that refused the file.

        Errors of the API are CorruptRunError (the file is damaged), ValueError (e.g. a
        recorded step without its graph) and KeyError (an array or histogram not stored);
        anything else, or a message of several lines, propagates as a bug.
        """
        for suffix in ("-wal", "-shm"):
            self.file.with_name(self.file.name + suffix).unlink(missing_ok=True)
        self.file.write_bytes(data)
        try:
            return read_everything(self.dir)
        except (ValueError, KeyError) as exc:  # CorruptRunError is a ValueError
            if isinstance(exc, UnicodeError) or not str(exc).isprintable():
                raise
            return exc


def mutate(rng: random.Random, data: bytes, targets: list[int]) -> tuple[str, bytes]:
    """One random damage of `data`; returns (description, damaged bytes)."""
    kind = rng.choice(("flip", "flip-structure", "truncate", "zero-page"))
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return f"truncate at {cut}", data[:cut]
    if kind == "zero-page":
        page = rng.randrange(len(data) // page_size(data))
        return f"zero page {page}", zero_page(data, page)
    pool = targets if kind == "flip-structure" else range(len(data))
    flips = [(rng.choice(pool), rng.randrange(1, 256)) for _ in range(rng.randint(1, 8))]
    return f"flip {flips}", flip(data, flips)


def campaign(files: int, seed: int) -> dict:
    rng = random.Random(seed)
    figures: dict = {"files": files, "seed": seed, "read_fine": 0, "refused": 0, "escaped": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_sample_run(Path(tmp)).read_bytes()
        targets = structural_offsets(data)
        trial = Trial(Path(tmp))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(files):
            what, damaged = mutate(rng, data, targets)
            try:
                result = trial.read(damaged)
            except Exception as exc:  # noqa: BLE001 - an escape is what this script looks for
                figures["escaped"].append(f"{what}: {type(exc).__name__}: {exc}"[:300])
                continue
            figures["refused" if isinstance(result, Exception) else "read_fine"] += 1
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    figures["file_bytes"] = len(data)
    figures["peak_rss_growth_mb"] = round((rss_after - rss_before) / 1024, 1)
    return figures


# --- crafted sizes ---------------------------------------------------------------------------
def zlib_bomb(raw: int) -> bytes:
    """A valid zlib stream of `raw` zero bytes (about raw / 1000 bytes), made in slices."""
    packer, zeros = zlib.compressobj(9), bytes(2**20)
    out = [packer.compress(zeros[:min(2**20, raw - done)]) for done in range(0, raw, 2**20)]
    return b"".join([*out, packer.flush()])


# The fields of an entry of a stored array layout (schema version 4, `layouts.body`).
LAYOUT_FIELDS = ("name", "direction", "view", "iteration", "dtype", "shape", "part", "offset",
                 "nbytes")


def set_array(changes: dict[str, object], tensor: str = "input", view: str = "samples") -> str:
    """SQL setting fields of the entry of `view` of `tensor` in the layout of step 0 (and of
    the steps sharing it): `changes` maps a field to an SQL expression, in which {offset},
    {nbytes} and {part} stand for the entry's current values (what `UPDATE arrays SET ...`
    did in version 3)."""
    match = (f"FROM json_each(body) WHERE json_extract(value, '$[0]') = '{tensor}' "
             f"AND json_extract(value, '$[2]') = '{view}'")
    current = {f: f"json_extract((SELECT value {match}), '$[{i}]')"
               for i, f in enumerate(LAYOUT_FIELDS)}
    pairs = []
    for field, value in changes.items():
        expression = str(value)
        for name, sql in current.items():
            expression = expression.replace("{" + name + "}", sql)
        pairs.append(f"'$[' || (SELECT key {match}) || '][{LAYOUT_FIELDS.index(field)}]', "
                     f"{expression}")
    return (f"UPDATE layouts SET body = json_set(body, {', '.join(pairs)}) "
            "WHERE hash = (SELECT layout FROM step_arrays WHERE step = 0)")


def _bomb(raw: int) -> list[str]:
    """Step 0's bfloat16 part replaced by a bomb of `raw` bytes, the input's samples pointing at
    all of it: read as declared, one view would be raw / 2 values."""
    return [f"UPDATE step_blobs SET codec = 'zlib', raw_bytes = {raw}, "
            f"data = x'{zlib_bomb(raw).hex()}' WHERE step = 0 AND part = 1",
            set_array({"dtype": "'bfloat16'", "shape": f"'[{raw // 2}]'", "part": 1,
                       "offset": 0, "nbytes": raw})]


def _graph_of_two_cycles(nodes: int) -> str:
    """A graph body of `nodes` tensors in lag-0 2-cycles (what made layouts quadratic)."""
    tensors = [{"name": f"t{i}", "role": "activation", "node": f"t{i}"} for i in range(nodes)]
    edges = [e for i in range(0, nodes - 1, 2) for e in (
        {"source": f"t{i}", "target": f"t{i + 1}", "lag": 0, "manual": True},
        {"source": f"t{i + 1}", "target": f"t{i}", "lag": 0, "manual": True})]
    body = json.dumps({"tensors": tensors, "edges": edges})
    return f"UPDATE graphs SET body = '{body}'"


def _histogram_edges(edges: str) -> list[str]:
    """The sample's histogram with crafted edges, made whole-model (what `plot` draws)."""
    return [f"UPDATE quantities SET meta = '{{\"edges\": {edges}}}', layer = '' WHERE "
            "name = 'GradHist1d'", "UPDATE quantity_arrays SET layer = ''"]


# Each case: SQL statements that make the sample run declare one hostile size or type.
CRAFTED: dict[str, Callable[[], list[str]]] = {
    "iterations-3e6": lambda: ["UPDATE steps SET iterations = 3000000"],
    "iterations-1e12": lambda: ["UPDATE steps SET iterations = 1000000000000"],
    "iterations-inf": lambda: ["UPDATE steps SET iterations = 1e999"],
    "tensor-shape-1e12x3": lambda: ["UPDATE tensors SET shape = '[1000000000000, 3]'"],
    "array-shape-0x1e20": lambda: [
        set_array({"shape": "'[0, 99999999999999999999]'", "nbytes": 0})],
    "zlib-bomb-41MB": lambda: _bomb(41 * 2**20),
    "zlib-bomb-410MB": lambda: _bomb(410 * 2**20),
    "histogram-bins-250M": lambda: _histogram_edges("[-2, 2, 250000000]"),
    "histogram-bins-2e9": lambda: _histogram_edges("[-2, 2, 2000000000]"),
    "histogram-edges-text": lambda: _histogram_edges('["a", 2, 4]'),
    "graph-40k-two-cycles": lambda: [_graph_of_two_cycles(40_000)],
    "note-blob": lambda: ["UPDATE notes SET text = x'00ff'"],
    "kpi-text": lambda: ["UPDATE kpis SET value = 'abc'"],
    "stat-text": lambda: ["UPDATE records SET mean = 'abc'"],
    "kpi-step-text": lambda: ["UPDATE kpis SET step = 'abc' || step"],
    "quantity-step-real": lambda: ["UPDATE quantities SET step = step + 0.5"],
    "quantity-value-text": lambda: ["UPDATE quantities SET value = 'abc'"],
    "record-iteration-text": lambda: ["UPDATE records SET iteration = 'abc' || iteration"],
    "anomaly-step-text": lambda: ["UPDATE anomalies SET step = 'abc'"],
}


def crafted_run(root: Path, sample: bytes, case: str) -> Path:
    """A run folder holding the sample run edited by the SQL of `CRAFTED[case]`."""
    run_dir = root / case
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "rank0.sqlite"
    path.write_bytes(sample)
    con = sqlite3.connect(path)
    for statement in CRAFTED[case]():
        con.execute(statement)
    con.commit()
    con.execute("VACUUM")  # the file's size is what it stores, not the pages it freed
    con.close()
    return run_dir


def _rss_kb(field: str) -> int:
    """VmRSS or VmHWM (peak) of this process, in kB, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_rss_of(read: Callable[[], object]) -> tuple[object, int]:
    """(what `read()` returned or raised, peak RSS growth in bytes while it ran).

    The kernel's peak is reset first (/proc/self/clear_refs, Linux >= 4.0), so each case is
    measured alone in one process.
    """
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kb("VmRSS")
    try:
        result: object = read()
    except Exception as exc:  # noqa: BLE001 - the caller judges what came out
        result = exc
    return result, max(0, _rss_kb("VmHWM") - base) * 1024


def crafted_campaign(root: Path) -> list[dict]:
    """Read every crafted case; one record per case: outcome, file size, peak RSS, cap."""
    sample = make_sample_run(root / "sample").read_bytes()
    records = []
    for case in CRAFTED:
        run_dir = crafted_run(root, sample, case)
        size = (run_dir / "rank0.sqlite").stat().st_size
        result, peak = peak_rss_of(functools.partial(read_everything, run_dir))
        one_line = isinstance(result, (ValueError, KeyError)) and str(result).isprintable()
        records.append({
            "case": case, "file_bytes": size, "peak_rss_mb": round(peak / 2**20, 1),
            "cap_mb": round(limits.read_peak_cap(size) / 2**20, 1),
            "outcome": (f"{type(result).__name__}: {result}"[:160]
                        if isinstance(result, Exception) else f"read {result} values"),
            "ok": (one_line or not isinstance(result, Exception))
                  and peak <= limits.read_peak_cap(size)})
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000, help="damaged files to try")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crafted", action="store_true",
                   help="read the crafted-size cases instead; report peak RSS per case")
    args = p.parse_args(argv)
    if args.crafted:
        with tempfile.TemporaryDirectory() as tmp:
            records = crafted_campaign(Path(tmp))
        for record in records:
            print(json.dumps(record))
        return 0 if all(r["ok"] for r in records) else 1
    figures = campaign(args.files, args.seed)
    print(json.dumps(figures))
    return 1 if figures["escaped"] else 0


if __name__ == "__main__":
    sys.exit(main())
