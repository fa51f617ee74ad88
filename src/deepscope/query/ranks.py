"""Which rank files make up a run: the manifest of a distributed run, checked.

Every rank file of a distributed run carries meta key `distributed` = {"world_size": W,
"rank": r, "backend": ..., "run_id": <rank 0's run id>}. A run is read from rank 0's manifest
(the lowest readable rank's when rank 0 has no readable file); a rank file that disagrees with
it (another run id or world size, another rank, no manifest) or cannot be read is left out
with a one-line warning naming the file, and `Run.rank_status()` lists why. Schema versions
need no comparison: every readable file is of this deepscope's version (others are refused
when opened).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptRunError, DeepscopeWarning
from ..store import limits

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Manifest:
    """What the rank files of one run folder say about it.

    distributed: rank 0's (or the reference rank's) `distributed` meta, None for a
        single-process run. world_size: from it, 1 without one. ranks: readable rank files
        that belong to the run. problems: {rank: why it was left out} for rank files that
        exist but were refused (unreadable, or of another run).
    """

    distributed: dict[str, Any] | None
    world_size: int
    ranks: list[int]
    problems: dict[int, str] = field(default_factory=dict)

    @property
    def missing(self) -> list[int]:
        """Ranks below the world size without any file."""
        return [r for r in range(self.world_size) if r not in self.ranks
                and r not in self.problems]


def parse_distributed(meta: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """A rank file's `distributed` meta, checked (None: a single-process file)."""
    value = meta.get("distributed")
    if value is None:
        return None
    ok = (isinstance(value, dict)
          and all(isinstance(value.get(k), int) and not isinstance(value.get(k), bool)
                  for k in ("world_size", "rank"))
          and 1 <= value["world_size"] <= limits.MAX_WORLD_SIZE and value["rank"] >= 0
          and isinstance(value.get("run_id"), str) and _RUN_ID.match(value["run_id"]))
    if not ok:
        raise CorruptRunError(f"{path}: stored meta 'distributed' is not a manifest (world "
                              f"size 1 to {limits.MAX_WORLD_SIZE}, rank, run id); the file is "
                              "damaged")
    return value


def disagreement(rank: int, own: dict[str, Any] | None, ref: dict[str, Any] | None,
                 ref_rank: int) -> str:
    """Why a readable rank file does not belong to the run of the reference rank's manifest
    ("" when it does)."""
    if ref is None:
        return (f"it is rank {own['rank']} of a distributed run of {own['world_size']} but "
                f"rank {ref_rank}'s file is a single-process run") if own else ""
    if own is None:
        return f"it has no distributed manifest (rank {ref_rank}'s run has world size " \
               f"{ref['world_size']})"
    if own["run_id"] != ref["run_id"]:
        return (f"it belongs to another run (run id {own['run_id'][:8]}…, rank {ref_rank}'s "
                f"is {ref['run_id'][:8]}…)")
    if own["world_size"] != ref["world_size"]:
        return (f"its world size is {own['world_size']}, rank {ref_rank}'s is "
                f"{ref['world_size']}")
    if own["rank"] != rank:
        return f"its manifest says it is rank {own['rank']}"
    if rank >= ref["world_size"]:
        return f"rank {rank} is outside the world size {ref['world_size']}"
    return ""


def build(metas: dict[int, dict[str, Any] | CorruptRunError],
          paths: dict[int, Path]) -> Manifest:
    """The manifest of a run from each rank file's meta (or the error reading it raised).

    Raises the lowest rank's error when no rank file is readable."""
    parsed: dict[int, dict[str, Any] | None] = {}
    problems: dict[int, str] = {}
    errors: dict[int, CorruptRunError] = {}
    for rank, meta in metas.items():
        if isinstance(meta, CorruptRunError):
            errors[rank] = meta
            continue
        try:
            parsed[rank] = parse_distributed(meta, paths[rank])
        except CorruptRunError as exc:
            errors[rank] = exc
    if not parsed:
        raise next(iter(errors.values()))
    for rank, exc in errors.items():
        problems[rank] = f"{exc}".removeprefix(f"{paths[rank]}: ") or "unreadable"
    ref_rank = 0 if 0 in parsed else min(parsed)
    ref = parsed[ref_rank]
    ranks = []
    for rank, own in parsed.items():
        why = disagreement(rank, own, ref, ref_rank)
        if why:
            problems[rank] = why
        else:
            ranks.append(rank)
    return Manifest(ref, ref["world_size"] if ref else 1, sorted(ranks), dict(sorted(
        problems.items())))


def warn_left_out(paths: dict[int, Path], problems: dict[int, str]) -> None:
    """One warning per rank file left out of the run, naming it and the fix."""
    for rank, why in problems.items():
        warnings.warn(f"{paths[rank]} is left out of this run: {why}; move it to its own run "
                      "folder (or remove it) if it does not belong here", DeepscopeWarning,
                      stacklevel=4)


def describe(manifest: Manifest, status: Callable[[int], str]) -> str:
    """One line about a run's ranks for `deepscope ls` / `doctor`, e.g. "ranks: 1 of world
    size 2 readable; rank 1 missing"; "" for a single-process run with one file.
    `status`: `Run.status`."""
    m = manifest
    if m.world_size == 1 and len(m.ranks) == 1 and not m.problems:
        return ""
    parts = [f"ranks: {len(m.ranks)} of world size {m.world_size} readable"]
    parts += [f"rank {r} missing" for r in m.missing]
    parts += [f"rank {r} left out ({why})" for r, why in m.problems.items()]
    parts += [f"rank {r} {s}" for r in m.ranks
              if (s := status(r)) not in ("finished", "recording", "unknown")]
    return "; ".join(parts)
