"""Benchmarks: deepscope against plain training, comgra and Cockpit, side by side, in one run.

    .venv/bin/python benchmarks/run.py            # make bench: full run, writes results/
    .venv/bin/python benchmarks/run.py --quick    # make bench-quick: harness check, no timing

The full run creates `.venv-peers` (torch 2.13.0, comgra 0.11.5, Cockpit 1.0.2, BackPACK
1.7.1) once. Every measurement is a fresh process running `workload.py` with one torch
thread; in each repeat the configurations of a group are measured back to back (order
reversed on odd repeats), so plain training is measured in the same run, next to what is
compared with it. In a paired group each configuration also takes turns with plain training
inside its process, and its ratio is against that plain step: the plain step moves by ~10%
from one process to the next, more than the smallest targets allow. A configuration that
fails is recorded as "error: <one line>" and the run goes on. `--quick` takes a few steps,
one repeat, shares one process per environment (so its times and memory mean nothing) and
skips the peers when `.venv-peers` is missing.

Script groups (`SCRIPT_GROUPS`, protocol in `ScriptGroup`) are measured by a script of their
own that takes turns between its configurations in one process (the real models of
`real_models.py`, ...). `--check` exits with status 1 when a target is missed by more than
the measured spread: for a ratio, when even the most favourable repeat misses it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks" / "workload.py"
DDP_WORKLOAD = ROOT / "benchmarks" / "ddp_overhead.py"  # "ddp:" specs: 2 ranks (and the rest)
PEERS_VENV = ROOT / ".venv-peers"
PEER_TOOLS = ("comgra", "cockpit")
# Installed in this order into .venv-peers. torch comes first (this machine's CPU build) and is
# repeated on the second line so that no dependency can pull another torch. BackPACK requires
# torchvision (only its examples use it), whose newest release wants a newer torch, so BackPACK
# and Cockpit (which requires BackPACK) come without dependencies, after what they import
# (second line); `import cockpit` needs pkg_resources, gone from setuptools 81.
PEER_INSTALL: tuple[tuple[str, ...], ...] = (
    ("torch==2.13.0",),
    ("torch==2.13.0", "comgra==0.11.5", "setuptools<81", "einops>=0.3,<1", "unfoldNd>=0.2,<1",
     "json-tricks", "matplotlib", "numpy", "pandas", "scipy", "seaborn"),
    ("--no-deps", "backpack-for-pytorch==1.7.1", "cockpit-for-pytorch==1.0.2"),
)
RESULTS_VERSION = 1


@dataclass(frozen=True)
class Target:
    """A goal for one summary metric of a configuration: value <= limit (or >= if not upper)."""

    label: str
    metric: str
    limit: float
    upper: bool = True

    def check(self, value: float | None) -> bool | None:
        """True/False, or None when the value could not be measured."""
        if value is None:
            return None
        return value <= self.limit if self.upper else value >= self.limit


@dataclass(frozen=True)
class Entry:
    """One configuration of a group: a workload spec, the peer it is compared with, targets.

    stat: "median" ms/step, or "mean" for schedules that record only some steps (the median
    would hide the recorded ones).
    """

    label: str
    spec: str
    peer: str | None = None
    targets: tuple[Target, ...] = ()
    stat: str = "median"

    @property
    def tool(self) -> str:
        return self.spec.split(":")[0]


@dataclass(frozen=True)
class Group:
    """Configurations measured back to back against one plain-training baseline (entry 0)."""

    name: str
    title: str
    entries: tuple[Entry, ...]
    note: str = ""
    min_repeats: int = 0  # small ratios need more repeats to beat process-to-process noise
    # each configuration takes turns with plain training in its process (workload --paired):
    # for tools that do all their work on the training thread (a background writer would
    # still be busy during plain training's turns and make the tool look cheaper)
    paired: bool = False

    def pairs(self, entry: Entry) -> bool:
        """Whether `entry` is measured paired: in a paired group, all but plain training."""
        return self.paired and entry is not self.entries[0]


def ratio_target(limit: float) -> Target:
    """ms/step at most `limit` times plain training's."""
    return Target(f"≤ {limit:g}× plain", "ratio", limit)


def _instrument_entries(model: str, limits: dict[str, float], vs_cockpit: float | None
                        ) -> tuple[Entry, ...]:
    """deepscope and Cockpit at economy, business and full, each deepscope level with its
    ratio target (where `limits` has one) and its speed-up target against Cockpit."""
    entries: list[Entry] = []
    for level in ("economy", "business", "full"):
        targets = [ratio_target(limits[level])] if level in limits else []
        if vs_cockpit is not None:
            targets.append(Target(f"≥ {vs_cockpit:g}× faster than Cockpit", "overhead_speedup",
                                  vs_cockpit, upper=False))
        # full: the mean, as HessMaxEV runs on every 4th step only (catalogue.MAX_EV_EVERY)
        entries += [Entry(f"deepscope {level}", f"deepscope:{model}:{level}",
                          peer=f"Cockpit {level}", targets=tuple(targets),
                          stat="mean" if level == "full" else "median"),
                    Entry(f"Cockpit {level}", f"cockpit:{model}:{level}")]
    return tuple(entries)


PLAIN = "plain training"
PAIRED_NOTE = ("Each configuration takes turns with plain training (10 steps each) in its own "
               "process, on a copy of the model sharing its parameters; × plain is against "
               "that plain step.")
RECORDER = "deepscope recorder (activations + gradients + 5 samples)"
GROUPS: tuple[Group, ...] = (
    Group("mlp-recorder", "Recorder — MLP 784-256-256-10, batch 128, SGD", (
        Entry(PLAIN, "plain:mlp:train"),
        Entry(RECORDER, "deepscope:mlp:recorder", peer="comgra (tutorial setting)", targets=(
            ratio_target(2.0),
            Target("≥ 50× faster than comgra per recorded step", "overhead_speedup", 50,
                   upper=False),
            Target("≤ 1/10 of comgra's bytes", "bytes_fraction", 0.1))),
        Entry("comgra (tutorial setting)", "comgra:mlp:recorder"),
        Entry("deepscope 4 named activations + gradients + 4 samples", "deepscope:mlp:named4",
              targets=(ratio_target(2.0),
                       Target("≤ 64 kB per recorded step", "bytes_per_step", 64_000))),
        Entry("deepscope defaults: Scope() records every(10)", "deepscope:mlp:defaults",
              stat="mean"),
        Entry("deepscope defaults + instruments='economy' (every(10))",
              "deepscope:mlp:defaults-economy", stat="mean"),
    ), note="Every step recorded except for the defaults. deepscope: `watch(model, "
       "activations=True)` hooks every module output; parameters and gradients of every "
       "step. comgra 0.11.5 as in its tutorial (`max_num_batch_size_to_record=5`, parameter "
       "SVDs, every tensor per batch item) with every step recorded: input, each layer's "
       "output, per-sample loss (registered as (B, 1): comgra rejects a 1-D batched tensor), "
       "loss, `record_current_gradients`."),
    Group("mlp-unrecorded", "Unrecorded steps — MLP, recorder set-up, schedule every(10**9)", (
        Entry(PLAIN, "plain:mlp:train"),
        Entry("deepscope, steps not recorded", "deepscope:mlp:unrecorded",
              targets=(ratio_target(1.03),), stat="mean"),
        # mean: the check's detector steps (every 10th, and every 50th) are what a user pays
        Entry("deepscope health check (anomalies='check', the default)", "deepscope:mlp:check",
              targets=(ratio_target(1.05),), stat="mean"),
        Entry("deepscope health check with origin trace (anomalies='trace')",
              "deepscope:mlp:trace", stat="mean"),
    ), note="The recorder set-up above (activation hooks, `rec.tensor`, `rec.loss`, anomalies "
       "off) on steps the schedule does not choose; only step 0, a warm-up step, is recorded. "
       "The health-check rows record nothing and run only the anomaly monitor. " + PAIRED_NOTE
       + " (From one process to the next the plain step itself varies by ~10%.) At least 9 "
       "repeats.", min_repeats=9, paired=True),
    Group("mlp-instruments", "Instruments — MLP 784-256-256-10, batch 128, every step", (
        Entry(PLAIN, "plain:mlp:train"),
        Entry("deepscope first-order tests + α", "deepscope:mlp:tests-alpha",
              targets=(ratio_target(1.5),)),
        *_instrument_entries("mlp", {"economy": 8, "business": 12, "full": 35}, 20),
    ), note="deepscope: `Scope(schedule=never, instruments=level, instrument_schedule="
       "every(1))`, `rec.loss(loss, per_sample=losses)`; first-order tests + α: "
       "`instruments=[\"NormTest\", \"InnerTest\", \"OrthoTest\", \"Alpha\"]`. "
       "Cockpit 1.0.2 as in its seed: "
       "BackPACK-extended model and loss, `configuration(level)` every step, the info dict, "
       "`backward(create_graph=cockpit.create_graph(step))`. " + PAIRED_NOTE, paired=True),
    Group("linear-instruments", "Instruments — linear 784-10 (the Cockpit seed), batch 128, "
          "every step", (
              Entry(PLAIN, "plain:linear:train"),
              *_instrument_entries("linear", {"economy": 3}, None),
          ), note=PAIRED_NOTE, paired=True),
    Group("transformer", "Transformer block — Embedding + LayerNorm + attention + GELU, "
          "batch 32 × 32 tokens", (
              Entry(PLAIN, "plain:transformer:train"),
              Entry(RECORDER, "deepscope:transformer:recorder"),
              Entry("deepscope economy", "deepscope:transformer:economy",
                    peer="Cockpit economy"),
              Entry("Cockpit economy", "cockpit:transformer:economy"),
          ), note="Cockpit is expected to fail here (BackPACK has no extension for "
             "`nn.MultiheadAttention`); its error is shown."),
    Group("ddp", "DistributedDataParallel — 2 ranks (gloo, CPU, 1 thread each), MLP "
          "784-256-256-10, batch 128 per rank, every step", (
              Entry(PLAIN, "ddp:mlp:train"),
              Entry("deepscope economy, 2-rank DDP (global batch)", "ddp:mlp:economy"),
              Entry("deepscope economy, 1 process (no DDP)", "deepscope:mlp:economy"),
          ), note="benchmarks/ddp_overhead.py. deepscope: `Scope(schedule=never, instruments="
             "\"economy\", instrument_schedule=every step)` around the DDP model; its ratio "
             "is against plain DDP steps taking turns with it in the same 2 processes (10 "
             "steps each, a fixed step count). Beside it, the 1-process economy ratio of the "
             "same model and per-rank batch. Collectives: deepscope's own per step (waiting "
             "for the other rank included). " + PAIRED_NOTE, min_repeats=5, paired=True),
)


@dataclass(frozen=True)
class ScriptGroup:
    """A group measured by its own script, in one process, ratios from paired turns.

    Protocol: `python benchmarks/<script> *args --repeats N [--quick]` (run from the
    repository root with `src` on PYTHONPATH and one torch thread) prints one JSON line
    {"rows": [{"label": str, "ms": float, "ratios": [one per repeat],
    "floor_ratios": [one per repeat, optional]}], "memory": {optional: name -> bytes}}. Row 0
    is the baseline (ratio 1). `--quick` must finish in seconds (sizes are then free).
    targets: (row label, Target) with metric "ratio" (× the baseline) or "floor_ratio".
    """

    name: str
    title: str
    script: str
    args: tuple[str, ...] = ()
    targets: tuple[tuple[str, Target], ...] = ()
    note: str = ""
    min_repeats: int = 5


def floor_target(limit: float) -> Target:
    """ms/step at most `limit` times the floor's (plain step + vmap(grad) per-sample grads)."""
    return Target(f"≤ {limit:g}× floor", "floor_ratio", limit)


REAL_MODEL_NOTE = (
    "`benchmarks/real_models.py`: every configuration trains its own copy of the model sharing "
    "the parameters, in turns of 4 steps (full computes HessMaxEV on every 4th), order "
    "rotating, timed in CPU seconds of the process; × plain / × floor: median over the "
    "rounds of the ratio of a turn's mean step to the one measured in the same round "
    "(brackets: lowest and highest round). Floor: a plain step plus every per-sample "
    "gradient materialised by `torch.func.vmap(torch.func.grad)`. Memory: peak bytes torch "
    "allocated in one step above its start (CPU profiler), with the largest module's "
    "per-sample gradients (B × its parameters) for the target plain + that.")


def real_model_group(model: str, title: str) -> ScriptGroup:
    """A real model with issue #19's targets: economy ≤ 4×, full ≤ 25× plain, economy
    within 1.5× of the floor."""
    return ScriptGroup(f"real-{model}", title, "real_models.py", (model, "--block", "4"), (
        ("economy", ratio_target(4)), ("economy", floor_target(1.5)),
        ("full", ratio_target(25))), REAL_MODEL_NOTE)


# Groups measured by their own script: one line each.
SCRIPT_GROUPS: tuple[ScriptGroup, ...] = (
    real_model_group("gpt2", "Instruments — GPT-2 (Hugging Face, 4 layers, d=128, vocabulary "
                     "2048), T=64, B=16"),
    real_model_group("cnn", "Instruments — ResNet-style CNN (16-32-64), 32×32, B=32"),
    real_model_group("lstm", "Instruments — LSTM language model (2048 × 128 → 256), T=64, B=16"),
    ScriptGroup("recorder-loop", "Recorder every step — MLP 784-256-256-10, batch 128, 4 named "
                "activations, parameters and gradients, 4 samples, writer drained every turn",
                "recorder_loop.py", (), (("recorded every step", ratio_target(2.0)),),
                "`benchmarks/recorder_loop.py`: plain and recorded turns of 10 steps take turns "
                "in one process on models sharing parameters; × plain: wall-time ratio per "
                "round (brackets: lowest and highest round)."),
)


@dataclass(frozen=True)
class Settings:
    """Step counts and mode of one benchmark run (see `parse_args`)."""

    steps: int
    warmup: int
    max_seconds: float
    repeats: int
    quick: bool
    timeout_s: float


# --- environments -------------------------------------------------------------------------
def peers_python(path: Path) -> Path:
    return path / "bin" / "python"


def peers_ready(venv: Path) -> bool:
    """Whether `venv` holds the complete peers' installation of `PEER_INSTALL`."""
    stamp = venv / ".installed-peers"
    return stamp.exists() and stamp.read_text() == json.dumps(PEER_INSTALL)


def ensure_peers_env(venv: Path, log: Path) -> Path:
    """Create (once) the peers' virtual environment; return its python. Raises RuntimeError
    with one line when a step fails (the full output is in `log`)."""
    python = peers_python(venv)
    if peers_ready(venv):
        return python
    base = shutil.which("python3.11") or sys.executable
    commands = [[base, "-m", "venv", str(venv)]] if not python.exists() else []
    commands += [[str(python), "-m", "pip", "install", "-q", *args] for args in PEER_INSTALL]
    commands.append([str(python), "-c", "import comgra.recorder, cockpit, backpack"])
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for cmd in commands:
            print(f"peers env: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            out.write(f"$ {shlex.join(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  env=worker_env(), check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`{shlex.join(cmd[1:])}` failed (exit {done.returncode}); "
                                   f"see {log}")
    (venv / ".installed-peers").write_text(json.dumps(PEER_INSTALL))
    return python


def worker_env() -> dict[str, str]:
    """Environment of the workload processes: one thread everywhere, no warnings on stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    return env


def run_worker(python: Path, specs: list[str], settings: Settings, paired: bool = False
               ) -> list[dict[str, Any]]:
    """Run `workload.py` once for `specs`; one record per spec."""
    with tempfile.TemporaryDirectory(prefix="deepscope-bench-") as workdir:
        script = DDP_WORKLOAD if any(s.startswith("ddp:") for s in specs) else WORKLOAD
        cmd = [str(python), str(script), "--steps", str(settings.steps), "--warmup",
               str(settings.warmup), "--max-seconds", str(settings.max_seconds), "--dir",
               workdir, *(["--paired"] if paired else []), *specs]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(),
                                  timeout=settings.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return [{"spec": s, "error": f"timed out after {settings.timeout_s:g} s"}
                    for s in specs]
    records = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["spec"]] = record
    tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    crash = f"process died (exit {done.returncode}): {tail[:300]}"
    return [records.get(s, {"spec": s, "error": crash}) for s in specs]


# --- measuring ----------------------------------------------------------------------------
Records = dict[str, list[dict[str, Any]]]  # spec -> one record per repeat


def measure_full(groups: Iterable[Group], settings: Settings, pythons: dict[str, Path | str]
                 ) -> dict[str, Records]:
    """Every configuration in its own process, interleaved within its group, per repeat."""
    out: dict[str, Records] = {}
    for group in groups:
        records: Records = {e.spec: [] for e in group.entries}
        repeats = max(settings.repeats, group.min_repeats)
        for r in range(repeats):
            order = group.entries if r % 2 == 0 else group.entries[::-1]
            for entry in order:
                runs = records[entry.spec]
                if runs and "error" in runs[0]:
                    continue  # failed once: the failure is deterministic, do not repeat it
                runs.append(measure_one(entry, settings, pythons,
                                        group.pairs(entry)))
                print(f"{group.name} [{r + 1}/{repeats}] {entry.label}: "
                      f"{describe(runs[-1], entry.stat)}", file=sys.stderr, flush=True)
        out[group.name] = records
    return out


def measure_one(entry: Entry, settings: Settings, pythons: dict[str, Path | str],
                paired: bool) -> dict[str, Any]:
    python = pythons[entry.tool]
    if isinstance(python, str):  # why this tool's environment is unavailable
        return {"spec": entry.spec, "error": python}
    return run_worker(python, [entry.spec], settings, paired)[0]


def measure_quick(groups: Iterable[Group], settings: Settings,
                  pythons: dict[str, Path | str]) -> dict[str, Records]:
    """Every spec once; one process per environment, the environments side by side."""
    groups = list(groups)
    batches: dict[tuple[Path, bool], list[str]] = {}  # (python, paired) -> specs
    found: dict[tuple[str, bool], dict[str, Any]] = {}
    keys = {g.name: [(e.spec, g.pairs(e)) for e in g.entries]
            for g in groups}
    for entry, key in ((e, k) for g in groups for e, k in zip(g.entries, keys[g.name])):
        python = pythons[entry.tool]
        if isinstance(python, str):
            found[key] = {"spec": entry.spec, "error": python}
        elif entry.spec not in batches.setdefault((python, key[1]), []):
            batches[(python, key[1])].append(entry.spec)
    with ThreadPoolExecutor(max_workers=max(1, len(batches))) as pool:
        jobs = [(paired, pool.submit(run_worker, py, specs, settings, paired))
                for (py, paired), specs in batches.items()]
        for paired, job in jobs:
            found.update(((rec["spec"], paired), rec) for rec in job.result())
    return {g.name: {spec: [found[(spec, paired)]] for spec, paired in keys[g.name]}
            for g in groups}


def measure_script(group: ScriptGroup, settings: Settings) -> dict[str, Any]:
    """Run a script group's script once; its JSON record, or {"error": one line}."""
    repeats = 1 if settings.quick else max(settings.repeats, group.min_repeats)
    cmd = [sys.executable, str(ROOT / "benchmarks" / group.script), *group.args,
           "--repeats", str(repeats), *(["--quick"] if settings.quick else [])]
    env = dict(worker_env(), PYTHONPATH=str(ROOT / "src"))  # this checkout's deepscope
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=settings.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {settings.timeout_s:g} s"}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return {"error": f"process died (exit {done.returncode}): {tail[:300]}"}


def summarize_script(group: ScriptGroup, record: dict[str, Any]) -> dict[str, Any]:
    """A script group's results entry: rows with medians, spreads and target verdicts."""
    out: dict[str, Any] = {"name": group.name, "title": group.title, "note": group.note,
                           "kind": "script", "memory": record.get("memory", {}), "rows": []}
    if "error" in record:
        out["error"] = record["error"]
        return out
    for row in record["rows"]:
        summary = {"label": row["label"], "status": "ok", "ms": row["ms"]}
        for metric, key in (("ratio", "ratios"), ("floor_ratio", "floor_ratios")):
            values = row.get(key) or []
            summary[metric] = statistics.median(values) if values else None
            summary[f"{metric}_range"] = [min(values), max(values)] if values else None
        summary["targets"] = [target_result(t, summary) for label, t in group.targets
                              if label == row["label"]]
        out["rows"].append(summary)
    return out


def check_failures(results: dict[str, Any]) -> list[str]:
    """The targets missed by more than the measured spread, one line each: a ratio target
    that even the most favourable repeat misses, any other target missed; and every group
    that could not be measured."""
    failures = []
    for group in results["groups"]:
        if group.get("error"):
            failures.append(f"{group['name']}: not measured ({group['error']})")
        for row in group["rows"]:
            for t in row.get("targets", []):
                if row["status"] != "ok" or t["ok"] is None:
                    continue
                spread = row.get(f"{t['metric']}_range")
                best = t["value"] if spread is None else spread[0] if t["upper"] else spread[1]
                if not Target(t["target"], t["metric"], t["limit"], t["upper"]).check(best):
                    shown = f" ({fmt(spread[0])}–{fmt(spread[1])})" if spread else ""
                    failures.append(f"{group['name']} | {row['label']} | {t['target']}: "
                                    f"measured {fmt(t['value'])}{shown}")
    return failures


def describe(record: dict[str, Any], stat: str) -> str:
    """A progress line for one measurement."""
    if "error" in record:
        return f"error: {record['error']}"
    return (f"{record[f'ms_{stat}']:.2f} ms/step ({stat}, {record['steps']} steps), "
            f"{record['peak_rss_mb']:.0f} MB")


# --- summarising ---------------------------------------------------------------------------
def summarize(group: Group, records: Records) -> list[dict[str, Any]]:
    """Per entry: status, ms/step, ratio to plain, memory, bytes, peer comparison, targets."""
    plain_runs = records[group.entries[0].spec]
    rows: dict[str, dict[str, Any]] = {}
    for entry in group.entries:
        runs = records[entry.spec]
        rows[entry.label] = row = {"label": entry.label, "spec": entry.spec,
                                   "stat": entry.stat, "peer": entry.peer}
        ok = [r for r in runs if "error" not in r]
        if not ok:
            reason = runs[0]["error"] if runs else "not measured"
            row["status"] = reason if reason.startswith("skipped") else f"error: {reason}"
            continue
        key = f"ms_{entry.stat}"
        ratios = []
        for r, p in zip(runs, plain_runs):
            # a paired record carries the plain step measured beside it
            base = r.get(f"plain_{key}") or p.get(key)
            if "error" not in r and base:
                ratios.append(r[key] / base)
        per_step = [r["bytes"] / r["stored_steps"] for r in ok if r["stored_steps"]]
        row.update(
            status="ok", ms=statistics.median(r[key] for r in ok),
            ratio=statistics.median(ratios) if ratios else None,
            ratio_range=[min(ratios), max(ratios)] if ratios else None,
            peak_rss_mb=max(r["peak_rss_mb"] for r in ok),
            bytes_per_step=statistics.median(per_step) if per_step else None,
            stored_steps=ok[0]["stored_steps"], close_s=statistics.median(r["close_s"] for r in ok),
            steps=ok[0]["steps"], warmup=ok[0]["warmup"], versions=ok[0]["versions"],
            repeats=[{k: r.get(k) for k in ("ms_median", "ms_mean", "plain_ms_median",
                                            "plain_ms_mean", "peak_rss_mb", "bytes",
                                            "stored_steps", "close_s", "error",
                                            "collective_ms")} for r in runs])
        collective = [r["collective_ms"] for r in ok if "collective_ms" in r]
        if collective:  # deepscope's own collectives (ddp group)
            row["collective_ms"] = statistics.median(collective)
            row["collectives"] = ok[0]["collectives"]
    for entry in group.entries:
        row = rows[entry.label]
        peer = rows.get(entry.peer) if entry.peer else None
        if row["status"] == "ok" and peer is not None and peer["status"] == "ok":
            row.update(peer_comparison(row, peer))
        row["targets"] = [target_result(t, row) for t in entry.targets]
    return list(rows.values())


def target_result(target: Target, row: dict[str, Any]) -> dict[str, Any]:
    """A target's verdict on the median, and for ratios whether the repeats agree: on this
    noisy machine a median near the limit can fall either side of it from run to run."""
    out = {"target": target.label, "metric": target.metric, "limit": target.limit,
           "upper": target.upper, "value": row.get(target.metric),
           "ok": target.check(row.get(target.metric))}
    spread = row.get(f"{target.metric}_range")
    if spread is not None and out["ok"] is not None:
        out["repeats_agree"] = {target.check(v) for v in spread} == {out["ok"]}
    return out


def peer_comparison(row: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """speedup: the peer's ms/step over ours; overhead_speedup: the time the peer adds to a
    plain step over the time deepscope adds (per recorded step); bytes_fraction: our bytes
    per recorded step over the peer's."""
    out: dict[str, float | None] = {"speedup": peer["ms"] / row["ms"],
                                    "overhead_speedup": None, "bytes_fraction": None}
    if row.get("ratio") is not None and peer.get("ratio") is not None:
        # in plain steps: each tool's own ratio, paired or not
        ours, theirs = row["ratio"] - 1, peer["ratio"] - 1
        out["overhead_speedup"] = theirs / ours if ours > 0 else float("inf")
    if row.get("bytes_per_step") and peer.get("bytes_per_step"):
        out["bytes_fraction"] = row["bytes_per_step"] / peer["bytes_per_step"]
    return out


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, Python and torch versions, load average."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem_kb = int(line.split()[1])
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
        text=True, check=False).stdout.strip() or "unknown"
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "logical_cpus": os.cpu_count(),
            "memory_gb": round(mem_kb / 2**20, 1), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch_version,
            "load_average_start": list(os.getloadavg())}


# --- writing -------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    if value == float("inf"):
        return "∞"
    return f"{value:,.{digits}f}"


def fmt_bytes(value: float | None) -> str:
    return "—" if value is None else f"{value / 1000:,.1f} kB"


def verdict(ok: bool | None, repeats_agree: bool = True) -> str:
    shown = {True: "✓", False: "✗ (missed)", None: "n/a"}[ok]
    if not repeats_agree:
        shown += " — not in every repeat" if ok else " — met in some repeats"
    return shown


def fmt_ratio(row: dict[str, Any], metric: str = "ratio") -> str:
    """The median ratio, with the lowest and highest repeat when there are several."""
    spread = row.get(f"{metric}_range")
    if row.get(metric) is None or spread is None or spread[0] == spread[1]:
        return fmt(row.get(metric))  # one repeat, or plain training itself
    return f"{fmt(row[metric])} ({fmt(spread[0])}–{fmt(spread[1])})"


def script_group_lines(group: dict[str, Any]) -> list[str]:
    """The table of a script group: ms/step, × plain and × floor per configuration, and
    the memory it measured."""
    if group.get("error"):
        return [f"error: {group['error']}"]
    lines = ["| configuration | ms/step | × plain | × floor |", "|---|---|---|---|"]
    lines += [f"| {row['label']} | {fmt(row['ms'])} | {fmt_ratio(row)} | "
              f"{fmt_ratio(row, 'floor_ratio')} |" for row in group["rows"]]
    if group.get("memory"):
        shown = ", ".join(f"{name} {value / 1e6:,.1f} MB" for name, value
                          in group["memory"].items())
        lines += ["", f"Peak memory of one step above its start: {shown}."]
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """results.md: how it was measured, the targets at a glance, one table per group."""
    m, s = results["machine"], results["settings"]
    lines = [
        "# deepscope benchmarks", "",
        f"Command: `{results['command']}`  ",
        f"Date: {results['date']} ({results['duration_s']:.0f} s)  ",
        f"Machine: {m['cpu']}, {m['cores']} cores usable ({m['logical_cpus']} logical), "
        f"{m['memory_gb']} GB; Python {m['python']}, torch {m['torch']}  ",
        f"Load average at start / end: {fmt(m['load_average_start'][0])} / "
        f"{fmt(m['load_average_end'][0])}  ",
        f"Peers: {results['peers']}  ",
    ]
    if results.get("note"):
        lines.append(f"Note: {results['note']}  ")
    lines += [
        "",
        f"Settings: {s['steps']} timed steps after {s['warmup']} warm-up steps, or fewer "
        f"for slow tools (timing stops after {s['max_seconds']:g} s, warm-up after a "
        f"quarter of that; at least 3 timed steps), {s['repeats']} interleaved repeats; every "
        "measurement a fresh process with 1 torch thread."
        + (" QUICK MODE: one process per environment, times mean nothing." if s["quick"]
           else ""),
        "",
        "ms/step: median over the timed steps (mean for schedules that record only some "
        "steps), median over repeats. × plain: median over repeats of the ratio to plain "
        "training measured back to back in the same repeat, in brackets the lowest and "
        "highest repeat; a target's verdict is the median's, and says so when some repeat "
        "falls on the other side of the limit. Close: seconds to close the "
        "tool's store after the last step (queued writes). Peak RSS: the process's maximum "
        "resident memory. Bytes: store size on disk over the steps that stored something "
        "(Cockpit keeps its values in memory; its bytes are the JSON `cockpit.write` makes at "
        "the end). Speed-up vs peer: the peer's ms/step over ours, and in brackets the time "
        "the peer adds to a plain step over the time deepscope adds (the per-recorded-step "
        "speed-up the targets use); below 1 means slower. Bytes ÷ peer: our bytes per "
        "stored step over the peer's.",
        "", "## Targets", "",
        "| group | configuration | target | measured | met |", "|---|---|---|---|---|",
    ]
    for group in results["groups"]:
        for row in group["rows"]:
            for t in row.get("targets", []):
                value = t["value"]
                shown = (f"{fmt(value, 3)}" if t["metric"] == "bytes_fraction" else
                         fmt_bytes(value) if t["metric"] == "bytes_per_step" else fmt(value))
                if row["status"] != "ok":
                    shown = "not measured"
                elif t["metric"] in ("ratio", "floor_ratio"):
                    shown = fmt_ratio(row, t["metric"])
                lines.append(f"| {group['name']} | {row['label']} | {t['target']} | {shown} | "
                             f"{verdict(t['ok'], t.get('repeats_agree', True))} |")
    for group in results["groups"]:
        lines += ["", f"## {group['title']}", ""]
        measured = group.get("measured", {})
        if measured.get("date") != results["date"]:  # merged from an earlier run
            lines += [f"Measured {measured.get('date')} by `{measured.get('command')}`.", ""]
        if group["note"]:
            lines += [group["note"], ""]
        if group.get("kind") == "script":
            lines += script_group_lines(group)
            continue
        lines += ["| configuration | ms/step | × plain | timed steps | close | peak RSS "
                  "| bytes / stored step | speed-up vs peer | bytes ÷ peer |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in group["rows"]:
            if row["status"] != "ok":
                lines.append(f"| {row['label']} | {row['status']} | | | | | | | |")
                continue
            stat = " (mean)" if row["stat"] == "mean" else ""
            vs = (f"{fmt(row['speedup'], 1)}× ({fmt(row['overhead_speedup'], 1)}×) vs "
                  f"{row['peer']}" if row.get("speedup") is not None else "")
            lines.append(f"| {row['label']} | {fmt(row['ms'])}{stat} | {fmt_ratio(row)} | "
                         f"{row['steps']} | {fmt(row['close_s'])} s | "
                         f"{fmt(row['peak_rss_mb'], 0)} MB | "
                         f"{fmt_bytes(row['bytes_per_step'])} | {vs} | "
                         f"{fmt(row.get('bytes_fraction'), 3)} |")
        lines += [f"\n{row['label']}: deepscope's collectives {fmt(row['collective_ms'])} ms per "
                  f"step ({fmt(row['collectives'], 0)} per step), median over repeats"
                  for row in group["rows"] if row.get("collective_ms") is not None]
    return "\n".join(lines) + "\n"


def merge_previous(results: dict[str, Any], previous: Path) -> dict[str, Any]:
    """`results` of an `--only` run, plus the other groups of the run stored in `previous`
    (same results version), in `GROUPS` order; each group keeps its own `measured`."""
    try:
        old = json.loads(previous.read_text())
    except (OSError, ValueError):
        return results
    if old.get("version") != RESULTS_VERSION:
        return results
    fresh = {g["name"]: g for g in results["groups"]}
    kept = {g["name"]: g for g in old.get("groups", []) if g.get("name") not in fresh}
    for group in kept.values():  # groups from before per-group provenance
        group.setdefault("measured", {k: old.get(k, "") for k in ("command", "date", "note")})
    merged = {**fresh, **kept}
    results["groups"] = [merged[name] for name in group_names() if name in merged]
    return results


def group_names() -> list[str]:
    """Every group's name, in the order of the results: `GROUPS`, then `SCRIPT_GROUPS`."""
    return [g.name for g in (*GROUPS, *SCRIPT_GROUPS)]


def command_line(argv: list[str]) -> str:
    """The command as typed from the repository root."""
    python = Path(sys.executable)
    shown = str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else str(python)
    return shlex.join([shown, "benchmarks/run.py", *argv])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="harness check: few steps, one repeat, no peers env needed")
    parser.add_argument("--steps", type=int, help="timed steps (default 60; quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 10; quick 0)")
    parser.add_argument("--max-seconds", type=float, default=10,
                        help="a measurement stops timing after this long, with at least 3 "
                             "timed steps; warm-up stops after a quarter of it (default 10)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; quick 1)")
    parser.add_argument("--only", nargs="+", metavar="GROUP", choices=group_names(),
                        help=f"run only these groups: {', '.join(group_names())}; "
                             "the other groups of the results already in --out are kept")
    parser.add_argument("--no-peers", action="store_true", help="do not run comgra and Cockpit")
    parser.add_argument("--out", type=Path,
                        help="results folder (default benchmarks/results; quick: "
                             "benchmarks/results/raw/quick)")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target is missed by more than the "
                             "measured spread (listed on stderr)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds one measurement may take (default 900)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"steps": (60, 1), "warmup": (10, 0), "repeats": (3, 1)}
    for name, (full, short) in defaults.items():
        value = getattr(args, name)
        if value is None:
            setattr(args, name, short if quick else full)
        elif value < (0 if "warmup" in name else 1):
            parser.error(f"--{name.replace('_', '-')} must be "
                         f"{'>= 0' if 'warmup' in name else '>= 1'}, got {value}")
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / ("raw/quick" if quick else "")
    return args


def peers_status(args: argparse.Namespace) -> Path | str:
    """The peers' python, or why the peers do not run (recorded as their result)."""
    if args.no_peers:
        return "skipped: --no-peers"
    if args.quick:
        if peers_ready(PEERS_VENV):
            return peers_python(PEERS_VENV)
        return f"skipped: {PEERS_VENV.name} missing (--quick does not create it)"
    try:
        return ensure_peers_env(PEERS_VENV, ROOT / "benchmarks" / "results" / "raw" /
                                "peers-install.log")
    except (RuntimeError, OSError) as exc:
        return f"peers env: {exc}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.time()
    settings = Settings(args.steps, args.warmup, args.max_seconds, args.repeats, args.quick,
                        args.timeout)
    groups = [g for g in GROUPS if args.only is None or g.name in args.only]
    scripted = [g for g in SCRIPT_GROUPS if args.only is None or g.name in args.only]
    info = machine()
    peers = peers_status(args)
    pythons: dict[str, Path | str] = {"plain": Path(sys.executable),
                                      "deepscope": Path(sys.executable),
                                      "ddp": Path(sys.executable)}
    pythons.update({tool: peers for tool in PEER_TOOLS})
    measure = measure_quick if args.quick else measure_full
    records = measure(groups, settings, pythons)
    script_results = []
    for group in scripted:
        script_results.append(summarize_script(group, measure_script(group, settings)))
        print(f"{group.name}: {script_results[-1].get('error', 'done')}", file=sys.stderr,
              flush=True)
    info["load_average_end"] = list(os.getloadavg())
    results = {
        "version": RESULTS_VERSION, "command": command_line(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
        "duration_s": time.time() - started, "machine": info, "note": args.note,
        "peers": str(peers) if isinstance(peers, str) else f"{peers.parent.parent.name} ok",
        "settings": {"steps": settings.steps, "warmup": settings.warmup,
                     "max_seconds": settings.max_seconds, "repeats": settings.repeats,
                     "quick": settings.quick, "torch_threads": 1},
        "groups": [{"name": g.name, "title": g.title, "note": g.note,
                    "rows": summarize(g, records[g.name])} for g in groups]
        + script_results,
    }
    for group in results["groups"]:
        group["measured"] = {k: results[k] for k in ("command", "date", "note")}
    if args.only is not None and not args.quick:
        results = merge_previous(results, args.out / "results.json")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = render_markdown(results)
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    print(f"results in {args.out}", file=sys.stderr)
    if args.check and not args.quick:
        now = {g.name for g in (*groups, *scripted)}  # merged groups were checked before
        failures = check_failures({"groups": [g for g in results["groups"] if g["name"] in now]})
        for line in failures:
            print(f"target missed: {line}", file=sys.stderr)
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
