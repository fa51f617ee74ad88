"""Turn whatever the selectors say into a valid selection, relaxing invalid combinations.

The user can ask for anything: a step that the new kind never recorded, an iteration beyond
this step's last, a node missing in this iteration's graph, a gradient of an input, sample 3
of a batch of 2. `resolve` keeps what is valid and moves everything else to the nearest
valid choice, so the output always shows something and never an error.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

from ..store import limits
from .data import ProjectData, RunData

BATCH_VIEWS = {"mean": "neuron_mean", "abs_max": "neuron_abs_max", "std": "neuron_std"}
_BATCH_LABELS = {"mean": "mean over batch", "abs_max": "abs-max over batch",
                 "std": "std over batch"}
_ROW_LABELS = {"mean": "mean per row (dim 0)", "abs_max": "abs-max per row (dim 0)",
               "std": "std per row (dim 0)"}
STEP_TRIGGERS = ("step-slider", "step-prev", "step-next", "over-steps")


@dataclass
class Request:
    """Raw selector values, which one changed, and what was clicked."""

    run: str | None = None
    kind: str | None = None
    slider: int | None = None
    iteration: int | None = None
    direction: str | None = None
    batch: str | None = None
    node: str | None = None
    tensor: str | None = None
    trigger: str | None = None
    picked_node: str | None = None   # tapped in the graph or chosen in the node list
    picked_step: int | None = None   # clicked in the over-steps chart
    # trigger "diagnosis" (a Diagnosis tab row): picked_node is the tensor, picked_step its step


@dataclass
class Selection:
    """A valid selection; `record_iteration` is where the tensor's record lives (parameters
    are recorded once per step, in iteration 0, while the graph shows any iteration)."""

    run: str
    kind: str | None = None
    step: int | None = None
    iteration: int = 0
    record_iteration: int = 0
    node: str | None = None
    tensor: str | None = None
    role_in_node: str | None = None
    direction: str = "forward"
    batch: str = "mean"
    follow: bool = True               # at the newest step: move on when a new one is written
    empty: bool = False               # the run has no recorded step yet (KPIs only)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Choices:
    """What each selector offers, for the selection it was resolved to."""

    kinds: list[dict[str, Any]] = field(default_factory=list)
    step_index: int = 0
    step_count: int = 0
    marks: dict[int, str] = field(default_factory=dict)
    step_label: str = ""
    iterations: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    directions: list[dict[str, Any]] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)


def nearest_index(values: list[int], target: int | None) -> int:
    """Index of the value closest to `target` in an ascending list (ties go left)."""
    if target is None or not values:
        return len(values) - 1
    i = bisect.bisect_left(values, target)
    if i == 0:
        return 0
    if i == len(values):
        return len(values) - 1
    return i if values[i] - target < target - values[i - 1] else i - 1


def _marks(steps: list[int], count: int = 6) -> dict[int, str]:
    if not steps:
        return {}
    n = len(steps)
    idx = sorted({round(k * (n - 1) / max(count - 1, 1)) for k in range(count)})
    return {i: str(steps[i]) for i in idx}


def _default_node(graph: dict[str, Any]) -> str | None:
    """The model output if there is one (what people look at first), else the first node."""
    nodes = graph.get("nodes", [])
    for role in ("output", "loss", "activation"):
        for n in nodes:
            if n["role"] == role:
                return n["id"]
    return nodes[0]["id"] if nodes else None


def _direction_order(d: str) -> tuple[int, str]:
    return (0 if d == "forward" else 1 if d == "grad" else 2, d)


def _direction_label(d: str) -> str:
    """"grad" reads "gradient"; "grad:<group>" (a `rec.gradients` snapshot) "gradient: group"."""
    return "gradient" + d[4:].replace(":", ": ", 1) if d.startswith("grad") else d


def resolve(project: ProjectData, req: Request, prev: dict[str, Any] | None
            ) -> tuple[Selection, Choices]:
    """The valid selection nearest to `req`, given the previous one (`prev`)."""
    prev = prev or {}
    runs = project.runs()
    if not runs:
        raise LookupError(f"no runs in {project.path}")
    run = next((r for r in (req.run, prev.get("run")) if r in runs), runs[0])
    rd = project.run(run)
    index = rd.step_index()
    if not index:
        return Selection(run, empty=True), Choices(step_label="no recorded steps yet")
    kinds = list(index)
    kind = next((k for k in (req.kind, prev.get("kind")) if k in kinds), kinds[0])
    if req.trigger == "diagnosis" and req.picked_step is not None:  # the kind recording it
        kind = min(kinds, key=lambda k: abs(
            index[k][0][nearest_index(index[k][0], req.picked_step)] - req.picked_step))
    steps, iterations = index[kind]
    last = len(steps) - 1

    prev_step = prev.get("step")
    if req.trigger == "step-slider" and req.slider is not None:
        idx = min(max(int(req.slider), 0), last)
    elif req.trigger in ("step-prev", "step-next"):
        idx = nearest_index(steps, prev_step) + (1 if req.trigger == "step-next" else -1)
        idx = min(max(idx, 0), last)
    elif req.trigger in ("over-steps", "diagnosis") and req.picked_step is not None:
        idx = nearest_index(steps, req.picked_step)
    elif prev.get("follow", True) or prev_step is None:
        idx = last
    else:
        idx = nearest_index(steps, prev_step)
    step = steps[idx]

    n_iter = max(iterations[idx], 1)
    asked = req.iteration if req.iteration is not None else prev.get("iteration", 0)
    iteration = min(max(int(asked or 0), 0), n_iter - 1)

    graph = rd.graph(step, iteration)
    nodes = {n["id"]: n for n in graph.get("nodes", [])}
    picked = req.picked_node if req.trigger in ("graph", "node-btn") else None
    if req.trigger == "diagnosis":  # it names a tensor: its node, and then the tensor
        picked = next((n for n, v in nodes.items() if req.picked_node in v["tensors"]),
                      req.picked_node)
    node = next((n for n in (picked, req.node, prev.get("node")) if n in nodes),
                _default_node(graph))

    info = rd.tensor_info()
    order = {name: i for i, name in enumerate(info)}  # registration order: weight, then bias
    members = sorted(nodes[node]["tensors"] if node in nodes else [],
                     key=lambda t: order.get(t, len(order)))
    role_of = {t: str(info[t]["role_in_node"]) if t in info else t for t in members}
    wanted_role = prev.get("role_in_node")
    asked_tensor = req.picked_node if req.trigger == "diagnosis" else req.tensor
    tensor = (asked_tensor if asked_tensor in members
              else next((t for t in members if role_of[t] == wanted_role), None)
              or (node if node in members else members[0] if members else None))

    direction, record_iteration, directions = _resolve_direction(rd, tensor, step, iteration,
                                                                 req.direction)
    batch, batches = _resolve_batch(rd, info.get(tensor) if tensor else None, req.batch)
    sel = Selection(run=run, kind=kind, step=step, iteration=iteration,
                    record_iteration=record_iteration, node=node, tensor=tensor,
                    role_in_node=role_of.get(tensor) if tensor else None, direction=direction,
                    batch=batch, follow=idx == last)
    choices = Choices(
        kinds=[{"label": k, "value": k} for k in sorted(kinds)], step_index=idx,
        step_count=len(steps), marks=_marks(steps),
        step_label=f"step {step}" + (" (latest)" if idx == last else "")
                   + f" · {idx + 1} of {len(steps)} recorded",
        iterations=[{"label": f"iteration {i}", "value": i} for i in range(n_iter)],
        nodes=[{"label": f"{n['id']} ({n['role']})", "value": n["id"]}
               for n in sorted(nodes.values(), key=lambda n: n["id"])],
        tensors=[{"label": f"{role_of[t]} — {t}", "value": t} for t in members],
        directions=[{"label": _direction_label(d), "value": d} for d in directions],
        batches=batches)
    return sel, choices


def _resolve_direction(rd: RunData, tensor: str | None, step: int, iteration: int,
                       asked: str | None) -> tuple[str, int, list[str]]:
    """The direction and record iteration to show; the directions stored there."""
    if tensor is None:
        return "forward", iteration, []
    records = rd.step_records(step)
    recs = records[records["tensor"] == tensor]
    its = sorted(set(int(i) for i in recs["iteration"]))
    record_iteration = its[nearest_index(its, iteration)] if its else iteration
    directions = sorted(set(recs[recs["iteration"] == record_iteration]["direction"]),
                        key=_direction_order)
    if asked in directions:
        return asked, record_iteration, directions
    if asked and asked.startswith("grad") and "grad" in directions:
        return "grad", record_iteration, directions
    return (directions[0] if directions else "forward"), record_iteration, directions


def _resolve_batch(rd: RunData, info: dict[str, Any] | None,
                   asked: str | None) -> tuple[str, list[dict[str, Any]]]:
    """Batch views for this tensor: over-batch summaries, then each stored batch item."""
    batch_dim = info["batch_dim"] if info else None
    if info is not None and not info["shape"]:  # a scalar: no rows, no batch items
        return "mean", [{"label": "the value (a scalar)", "value": "mean"}]
    labels = _BATCH_LABELS if batch_dim is not None else _ROW_LABELS
    options = [{"label": labels[k], "value": k} for k in BATCH_VIEWS]
    n_samples = 0
    if batch_dim is not None and batch_dim < len(info["shape"]):
        stored = limits.capped_int(rd.meta().get("max_samples", 0) or 0, limits.MAX_SAMPLES,
                                   "meta max_samples")
        n_samples = min(stored, int(info["shape"][batch_dim]))
    options += [{"label": f"sample {i}", "value": f"sample:{i}"} for i in range(n_samples)]
    if asked in {o["value"] for o in options}:
        return asked, options
    if asked and asked.startswith("sample:") and n_samples:
        return f"sample:{n_samples - 1}", options
    return "mean", options
