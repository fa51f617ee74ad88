"""The dependency graph as cytoscape elements: a layered left-to-right layout computed here.

Layout: nodes are graph "nodes" (a tensor, or a module's tensors grouped); a node's layer is
its longest path from a source over lag-0 edges (edges from earlier iterations are drawn but
do not count, so recurrent graphs stay acyclic). Inputs sit in the first layer, losses in the
last; sources that are not inputs (parameters, constants) sit just left of their first user.
Within a layer, nodes are ordered by the mean position of their neighbours (barycentre
sweeps), which removes most crossings in the graphs people record.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

NODE_W, NODE_H = 150, 34
X_GAP, Y_GAP = 210, 58
# A graph too wide to show its labels at their size in the canvas (about CANVAS pixels at a
# 1600 px window) is wrapped into bands of layers stacked top to bottom, like lines of text,
# when that makes the fitted graph at least WRAP_GAIN times larger; BAND_GAP between bands.
CANVAS = (800, 440)
BAND_GAP = 70
WRAP_GAIN = 1.3

# Okabe-Ito hues, lightened so black labels stay readable; safe for colour-blind readers.
ROLE_COLOURS: dict[str, str] = {
    "input": "#9bd3f2",
    "target": "#c7a6e0",
    "activation": "#d7e9b9",
    "output": "#f6c27a",
    "loss": "#f29a8a",
    "parameter": "#d0d0d0",
}
ROLE_ORDER = ("input", "target", "parameter", "activation", "output", "loss")
MISSING_COLOUR = "#f4f4f4"


@dataclass
class GraphLayout:
    """What the view needs of one graph structure, computed once per structure."""

    positions: dict[str, tuple[float, float]]
    roles: dict[str, str]
    members: dict[str, list[str]]               # node -> its tensors
    edges: dict[tuple[str, str, bool], list[tuple[str, str]]]  # (src, dst, lagged) -> pairs
    preds: dict[str, set[str]] = field(default_factory=dict)   # over lag-0 edges
    succs: dict[str, set[str]] = field(default_factory=dict)
    has_dependency: set[str] = field(default_factory=set)     # any incoming edge
    has_dependent: set[str] = field(default_factory=set)      # any outgoing edge


def build_layout(graph: dict[str, Any]) -> GraphLayout:
    """Positions and adjacency of a graph from `Run.graph` (tensors, edges, nodes)."""
    node_of = {t["name"]: t["node"] for t in graph.get("tensors", [])}
    members = {n["id"]: list(n["tensors"]) for n in graph.get("nodes", [])}
    roles = {n["id"]: n["role"] for n in graph.get("nodes", [])}
    edges: dict[tuple[str, str, bool], list[tuple[str, str]]] = defaultdict(list)
    for e in graph.get("edges", []):
        src, dst = node_of.get(e["source"]), node_of.get(e["target"])
        if src is None or dst is None:
            continue
        lagged = bool(e.get("lag"))
        if src == dst and not lagged:
            continue  # a module's parameters feeding its own output: inside one node
        edges[(src, dst, lagged)].append((e["source"], e["target"]))
    preds: dict[str, set[str]] = {n: set() for n in members}
    succs: dict[str, set[str]] = {n: set() for n in members}
    has_dependency, has_dependent = set(), set()
    for src, dst, lagged in edges:
        has_dependent.add(src)
        has_dependency.add(dst)
        if not lagged:
            preds[dst].add(src)
            succs[src].add(dst)
    layers = _layers(list(members), roles, preds, succs)
    positions = _positions(layers, preds, succs)
    return GraphLayout(positions, roles, members, dict(edges), preds, succs, has_dependency,
                       has_dependent)


def _layers(nodes: list[str], roles: dict[str, str], preds: dict[str, set[str]],
            succs: dict[str, set[str]]) -> dict[str, int]:
    """Layer per node: longest path from a source, then inputs / losses / sources adjusted."""
    order = sorted(nodes, key=lambda n: (ROLE_ORDER.index(roles[n])
                                         if roles[n] in ROLE_ORDER else 3, n))
    indegree = {n: len(preds[n]) for n in nodes}
    layer = {n: 0 for n in nodes}
    ready = deque(n for n in order if indegree[n] == 0)
    seen: set[str] = set()
    unseen = iter(order)  # where to look for a node to break a cycle at: each looked at once
    while len(seen) < len(nodes):
        if not ready:  # a lag-0 cycle (manual connections can make one): break it
            ready.append(next(n for n in unseen if n not in seen))
        n = ready.popleft()
        if n in seen:
            continue
        seen.add(n)
        for s in sorted(succs[n]):
            layer[s] = max(layer[s], layer[n] + 1)
            indegree[s] -= 1
            if indegree[s] == 0 and s not in seen:
                ready.append(s)
    # Non-input sources (parameters, constants) go right before their first consumer.
    for n in nodes:
        if not preds[n] and succs[n] and roles[n] != "input":
            layer[n] = max(0, min(layer[s] for s in succs[n]) - 1)
    last = max(layer.values(), default=0)
    for n in nodes:
        isolated = not preds[n] and not succs[n]
        if roles[n] == "loss" and not succs[n]:
            layer[n] = max(last, 1 if len(nodes) > 1 else 0)
        elif isolated and roles[n] == "target":
            layer[n] = max(last - 1, 0)
    return layer


def _positions(layer: dict[str, int], preds: dict[str, set[str]],
               succs: dict[str, set[str]]) -> dict[str, tuple[float, float]]:
    """x from the layer; y from the order within the layer after barycentre sweeps."""
    by_layer: dict[int, list[str]] = defaultdict(list)
    for n in sorted(layer):
        by_layer[layer[n]].append(n)
    rank = {n: float(i) for col in by_layer.values() for i, n in enumerate(col)}
    layers = sorted(by_layer)
    for sweep in range(4):  # alternate left-to-right and right-to-left passes
        seq = layers if sweep % 2 == 0 else layers[::-1]
        for li in seq:
            col = by_layer[li]
            nbrs = preds if sweep % 2 == 0 else succs

            def centre(n: str, nbrs: dict[str, set[str]] = nbrs) -> float:
                ys = [rank[m] for m in nbrs[n]]
                return sum(ys) / len(ys) if ys else rank[n]
            col.sort(key=lambda n: (centre(n), n))
            for i, n in enumerate(col):
                rank[n] = float(i)
    tallest = max((len(c) for c in by_layer.values()), default=1)
    per_band = _layers_per_band(max(layers, default=0) + 1, tallest)
    band_height = (tallest - 1) * Y_GAP + NODE_H + BAND_GAP
    out = {}
    for li, col in by_layer.items():
        offset = (tallest - len(col)) / 2  # centre short layers vertically
        band, column = divmod(li, per_band)
        for i, n in enumerate(col):
            out[n] = (column * X_GAP, (i + offset) * Y_GAP + band * band_height)
    return out


def _layers_per_band(n_layers: int, tallest: int) -> int:
    """How many layers one band holds: all of them, unless the graph would be drawn smaller
    than its natural size and wrapping makes it `WRAP_GAIN` times larger."""
    def zoom(per_band: int) -> float:  # the scale that fits the graph into the canvas
        bands = -(-n_layers // per_band)
        width = (per_band - 1) * X_GAP + NODE_W
        height = bands * ((tallest - 1) * Y_GAP + NODE_H) + (bands - 1) * BAND_GAP
        return min(CANVAS[0] / width, CANVAS[1] / height)
    whole = zoom(n_layers)
    best = max(range(1, n_layers + 1), key=lambda k: (zoom(k), k))
    return best if whole < 1 and zoom(best) >= WRAP_GAIN * whole else n_layers


def closure(start: str, adjacency: dict[str, set[str]]) -> set[str]:
    """Every node reachable from `start` (not including it unless on a cycle)."""
    found: set[str] = set()
    stack = list(adjacency.get(start, ()))
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(adjacency.get(n, ()))
    return found


def elements(layout: GraphLayout, selected: str | None, tensor: str | None,
             colours: dict[str, str] | None = None,
             flags: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Cytoscape elements: nodes (positions, colour, classes) and edges (highlight classes).

    selected: the selected node; it, what it depends on and what depends on it (over lag-0
    edges, transitively) are highlighted, the rest faded. tensor: the selected tensor in that
    node; its own edges are drawn bold, edges only other tensors of the node have are thin.
    colours: node -> fill (default: role colours). flags: nodes with non-finite values (their
    label gets a warning sign).
    """
    colours = colours or {}
    flags = flags or {}
    upstream = closure(selected, layout.preds) if selected else set()
    downstream = closure(selected, layout.succs) if selected else set()
    lit = upstream | downstream | ({selected} if selected else set())
    out: list[dict[str, Any]] = []
    for n, (x, y) in layout.positions.items():
        role = layout.roles.get(n, "activation")
        size = len(layout.members.get(n, []))
        label = n if size <= 1 else f"{n}  [{size}]"
        if n in flags:
            label = f"⚠ {label}"
        classes = [f"role-{role}", _side_class(n not in layout.has_dependency,
                                               n not in layout.has_dependent)]
        if selected:
            classes.append("selected" if n == selected else "lit" if n in lit else "faded")
        if n in flags:
            classes.append("nonfinite")
        fill = colours.get(n, ROLE_COLOURS.get(role, MISSING_COLOUR))
        out.append({"data": {"id": n, "label": label, "colour": fill,
                             "text": text_colour(fill)},
                    "position": {"x": x, "y": y}, "classes": " ".join(classes)})
    up, down = upstream | {selected}, downstream | {selected}
    for (src, dst, lagged), pairs in layout.edges.items():
        classes = ["lagged"] if lagged else []
        if selected in (src, dst):
            own = tensor is None or any(tensor in pair for pair in pairs)
            classes.append("own" if own else "thin")
        elif selected:
            in_cone = (src in up and dst in up) or (src in down and dst in down)
            classes.append("lit" if in_cone and not lagged else "faded")
        out.append({"data": {"id": f"{src}->{dst}{'~' if lagged else ''}", "source": src,
                             "target": dst}, "classes": " ".join(classes)})
    return out


def _side_class(open_left: bool, open_right: bool) -> str:
    return {(False, False): "closed", (True, False): "open-left",
            (False, True): "open-right", (True, True): "open-both"}[(open_left, open_right)]


def _frame(open_left: bool, open_right: bool) -> str:
    """An SVG frame drawn over a node: a dotted left / right side marks no dependency /
    no dependent (cytoscape itself can only dot all four sides at once)."""
    w, h = NODE_W, NODE_H

    def side(x: float, dotted: bool) -> str:
        dash = ' stroke-dasharray="3 3" stroke-width="2.5"' if dotted else ""
        return f'<line x1="{x}" y1="0" x2="{x}" y2="{h}"{dash}/>'
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}"><g stroke="#333" stroke-width="2" fill="none">'
           f'<line x1="0" y1="1" x2="{w}" y2="1"/><line x1="0" y1="{h - 1}" x2="{w}" '
           f'y2="{h - 1}"/>{side(1, open_left)}{side(w - 1, open_right)}</g></svg>')
    return "data:image/svg+xml;utf8," + quote(svg)


def stylesheet() -> list[dict[str, Any]]:
    """The cytoscape stylesheet: roles, highlight states, dotted sides, lagged edges."""
    sheet: list[dict[str, Any]] = [
        {"selector": "node", "style": {
            "shape": "rectangle", "width": NODE_W, "height": NODE_H,
            "background-color": "data(colour)", "border-width": 0,
            "label": "data(label)", "font-size": 14, "text-valign": "center",
            "text-halign": "center", "text-wrap": "ellipsis", "text-max-width": NODE_W - 10,
            "color": "data(text)", "background-width": "100%", "background-height": "100%",
            "background-clip": "none"}},
        {"selector": "node.faded", "style": {"opacity": 0.35}},
        {"selector": "node.selected", "style": {
            "underlay-color": "#1f4e99", "underlay-opacity": 0.45, "underlay-padding": 6,
            "font-weight": "bold"}},
        {"selector": "node.nonfinite", "style": {"color": "#b00020", "font-weight": "bold"}},
        {"selector": "edge", "style": {
            "width": 1.5, "line-color": "#8a8a8a", "target-arrow-color": "#8a8a8a",
            "target-arrow-shape": "triangle", "curve-style": "bezier", "arrow-scale": 0.9}},
        {"selector": "edge.lagged", "style": {
            "line-style": "dashed", "curve-style": "unbundled-bezier",
            "control-point-distances": [60], "control-point-weights": [0.5]}},
        {"selector": "edge.faded", "style": {"opacity": 0.15}},
        {"selector": "edge.lit", "style": {"line-color": "#1f4e99",
                                           "target-arrow-color": "#1f4e99", "width": 2}},
        {"selector": "edge.own", "style": {"line-color": "#1f4e99",
                                           "target-arrow-color": "#1f4e99", "width": 3.5}},
        {"selector": "edge.thin", "style": {"line-color": "#1f4e99",
                                            "target-arrow-color": "#1f4e99", "width": 1}},
    ]
    for cls, (left, right) in (("closed", (False, False)), ("open-left", (True, False)),
                               ("open-right", (False, True)), ("open-both", (True, True))):
        sheet.append({"selector": f"node.{cls}", "style": {"background-image": _frame(left,
                                                                                         right)}})
    return sheet


# --- colour by a statistic or quantity ------------------------------------------------------
_VIRIDIS = ((0.0, (68, 1, 84)), (0.25, (59, 82, 139)), (0.5, (33, 145, 140)),
            (0.75, (94, 201, 98)), (1.0, (253, 231, 37)))


def _viridis(t: float) -> str:
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(_VIRIDIS, _VIRIDIS[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            rgb = (round(a + (b - a) * f) for a, b in zip(c0, c1))
            return "#{:02x}{:02x}{:02x}".format(*rgb)
    return "#fde725"


@dataclass
class ColourScale:
    """How node values were mapped to colours, for the legend."""

    low: float
    high: float
    log: bool

    def gradient_css(self) -> str:
        stops = ", ".join(f"{_viridis(t)} {t * 100:.0f}%" for t, _ in _VIRIDIS)
        return f"linear-gradient(to right, {stops})"


def text_colour(fill: str) -> str:
    """Black or white label text, whichever contrasts more with a "#rrggbb" fill (WCAG
    relative luminance; white on the dark end of viridis, black elsewhere)."""
    def linear(c: int) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (linear(int(fill[i:i + 2], 16)) for i in (1, 3, 5))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # contrast with black (L + 0.05) / 0.05 against white 1.05 / (L + 0.05)
    return "#111111" if (luminance + 0.05) ** 2 > 0.0525 else "#ffffff"


def colour_nodes(values: dict[str, float], bounds: tuple[float, float] | None = None
                 ) -> tuple[dict[str, str], ColourScale | None]:
    """Viridis fill per node from its value; log scale when positive values span > 2 decades.

    bounds: the (low, high) of the scale, e.g. over several runs so that one colour means
    one value in each (default: these values' own range; values beyond are clipped).
    Nodes without a finite value are left out (they keep the 'missing' fill).
    """
    finite = {n: v for n, v in values.items() if v is not None and math.isfinite(v)}
    if not finite:
        return {}, None
    lo, hi = bounds or (min(finite.values()), max(finite.values()))
    log = lo > 0 and hi / lo > 100
    f = math.log10 if log else (lambda v: v)
    a, b = f(lo), f(hi)
    span = (b - a) or 1.0
    return {n: _viridis((f(v) - a) / span) for n, v in finite.items()}, ColourScale(lo, hi, log)
