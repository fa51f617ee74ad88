"""Fuzz the read path: damaged copies of a real run file must read or fail with one line.

Each trial takes a small but complete run (steps, arrays, graph, KPIs, note, instrument values
with a histogram, an anomaly), damages a copy — flipped bytes (anywhere, or aimed at page
headers and cell pointers, where SQLite keeps its structure), a truncation, or a zeroed
page — and reads everything the query API offers. The only acceptable failures are the
API's own one-line errors (see `Trial.read`); anything else is a bug. `pytest` runs a fixed
sample of these through hypothesis; this script runs a long random campaign:

    python -m tests.stress.fuzz_store [--files 2000] [--seed 0]

Prints one JSON line of figures (files tried, read fine, refused, escaped); exit 0 = none
escaped.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
from pathlib import Path

import numpy as np

import deepscope
from deepscope.instruments.base import QuantityValue
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000, help="damaged files to try")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    figures = campaign(args.files, args.seed)
    print(json.dumps(figures))
    return 1 if figures["escaped"] else 0


if __name__ == "__main__":
    sys.exit(main())
