"""The Graph tab: selectors, the dependency graph, the selected record's outputs.

Flow per click: one round trip turns the selector values into a valid selection (kept in
the browser, per tab) and returns the selected record's table and charts, the graph and the
over-steps history with it; the graph's colouring and the history's statistic, overlay and
rank have callbacks of their own on that selection. Every panel is computed on its own, so
a failure stays in its panel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import dash
import dash_cytoscape as cyto
from dash import ALL, Input, Output, State, ctx, dcc, html

from ...store.schema import STAT_COLUMNS
from .. import graph_view, ids, panels, ranks
from ..data import LRU, ProjectData, RunData, fingerprint
from ..guard import contained, describe, error_box, error_figure, report
from ..selection import Request, nearest_index, resolve
from ..widgets import chart, dropdown, labelled
from . import Tab, gate
from .instruments import PER_LAYER

_LAYOUTS = LRU(128)  # graph structure fingerprint -> GraphLayout (pure function of the graph)
SHOWN = "graph-in"   # store: [run, versions] while the tab is shown (`tabs.gate`)
STATISTICS = [s for s in STAT_COLUMNS if s != "numel"]
COLOUR_OPTIONS = ([{"label": "role", "value": "role"}]
                  + [{"label": f"statistic: {s}", "value": f"stat:{s}"} for s in STATISTICS]
                  + [{"label": f"quantity: {q}", "value": f"q:{q}"} for q in PER_LAYER])


def layout(_run_options: list[dict[str, str]]) -> html.Div:
    """Graph and selectors on the left, the selected record's outputs on the right."""
    graph_card = html.Section([
        html.Div([
            labelled("Kind", dropdown("kind")),
            labelled("Iteration", dropdown("iteration")),
            labelled("Colour by", dropdown("colour-by", options=COLOUR_OPTIONS, value="role")),
            dcc.Checklist(id="colour-shared", value=["shared"], className="radio",
                          options=[{"label": "one scale for all runs", "value": "shared"}]),
        ], className="toolbar"),
        cyto.Cytoscape(
            id="graph", elements=[], stylesheet=graph_view.stylesheet(),
            layout={"name": "preset", "fit": True, "padding": 24},
            style={"width": "100%", "height": "46vh"}, minZoom=0.1, maxZoom=3,
            autoRefreshLayout=False, autounselectify=True, responsive=True,
            className="graph"),
        ranks.graph_warning(),
        html.Div(id="legend", className="legend"),
        html.Details([html.Summary("All nodes (keyboard access)"),
                      html.Div(id="node-list", className="node-list")],
                     className="node-list-wrap"),
    ], className="card graph-card")
    selectors = html.Section([
        html.Div([
            html.Button("◀", id="step-prev", className="step-btn", title="previous step (←)"),
            html.Div(dcc.Slider(id="step-slider", min=0, max=0, step=1, value=0, marks={},
                                updatemode="mouseup", allow_direct_input=False),
                     className="slider-wrap"),
            html.Button("▶", id="step-next", className="step-btn", title="next step (→)"),
            html.Span(id="step-label", className="step-label"),
        ], className="step-row"),
        html.Div([
            labelled("Node", dropdown("node", searchable=True)),
            labelled("Tensor (role in node)", dropdown("tensor")),
            labelled("Batch view", dropdown("batch")),
            labelled("Values", dcc.RadioItems(id="direction", options=[], inline=True,
                                              className="radio")),
        ], className="selector-grid"),
    ], className="card selectors")
    output = html.Section([
        html.Div(id="nonfinite-banner"),
        html.Div(id="stats-table", className="stats-table"),
        chart("values-chart", 240),
        chart("items-chart", 200),
        html.Div([
            labelled("Statistic over steps", dropdown(
                ids.STATISTIC, options=STATISTICS, value="norm")),
            labelled("Overlay runs", dropdown("overlay", multi=True, clearable=True,
                                              placeholder="add runs to compare")),
        ], className="toolbar"),
        chart("over-steps", 260),
    ], className="card output")
    return html.Div([html.Div([graph_card, selectors], className="col-left"),
                     html.Div(output, className="col-right")], className="explorer")


def register(app: dash.Dash, project: ProjectData) -> None:
    """The Graph tab's callbacks. A run switch or a new step while another tab is shown
    waits until the tab is shown again (a Diagnosis row's link selects at once)."""
    gate(app, ids.GRAPH_TAB, SHOWN, (ids.RUN, "value"), (ids.VERSION, "data"))
    _register_resolve(app, project)
    _register_graph(app, project)
    _register_outputs(app, project)


# --- selectors ----------------------------------------------------------------------------
_SELECTORS = ("kind", "iteration", "direction", "batch", "node", "tensor")
_CONTROLS = ((ids.RUN, "value"), ("kind", "options"), ("kind", "value"), ("step-slider", "max"),
             ("step-slider", "marks"), ("step-slider", "value"), ("step-label", "children"),
             ("iteration", "options"), ("iteration", "value"), ("direction", "options"),
             ("direction", "value"), ("batch", "options"), ("batch", "value"),
             ("node", "options"), ("node", "value"), ("tensor", "options"),
             ("tensor", "value"))


def _register_resolve(app: dash.Dash, project: ProjectData) -> None:
    # the run comes from the page's selector as it is now; SHOWN wakes this callback
    inputs = [State(ids.RUN, "value")] + [Input(i, "value") for i in _SELECTORS] + [
        Input("step-slider", "value"), Input("step-prev", "n_clicks"),
        Input("step-next", "n_clicks"), Input("graph", "tapNodeData"),
        Input({"type": "node-btn", "node": ALL}, "n_clicks"),
        Input("over-steps", "clickData"), Input(SHOWN, "data"),
        Input({"type": ids.GO, "step": ALL, "where": ALL}, "n_clicks")]

    # A Diagnosis row's link also shows this tab, in the same answer: the tab's own wake-up
    # (SHOWN) then finds the selection made and keeps it. The first call waits for SHOWN
    # (the tab shown with the runs' versions), as do the callbacks on the selection.
    @app.callback(*[Output(i, p) for i, p in _CONTROLS], Output(ids.SEL, "data"),
                  Output("controls-sent", "data"), *_RECORD_OUTPUTS, Output(ids.TABS, "value"),
                  *_dup(_GRAPH_OUTPUTS), *_dup(_HISTORY_OUTPUTS),
                  *inputs, State(ids.SEL, "data"), State("controls-sent", "data"),
                  State(ids.RANK, "value"), *_GRAPH_STATES, *_HISTORY_STATES,
                  prevent_initial_call=True)
    def _resolve(run: str | None, kind: str | None, iteration: int | None,
                 direction: str | None, batch: str | None, node: str | None,
                 tensor: str | None, slider: int | None, _prev: Any, _next: Any,
                 tap: dict | None, _buttons: list, click: dict | None, _shown: Any,
                 _diagnoses: list, previous: dict | None, sent: dict | None,
                 rank: str | None, colour_by: str | None, shared: list | None,
                 graph_known: dict | None, statistic: str | None, overlay: list | None,
                 history_drawn: str | None) -> tuple:
        trigger, picked_node, picked_step = _trigger(tap, click)
        if trigger is None and previous is not None and ctx.triggered_id is not None:
            raise dash.exceptions.PreventUpdate  # a node-list button appeared, not clicked
        req = Request(run=run, kind=kind, slider=slider, iteration=iteration,
                      direction=direction, batch=batch, node=node, tensor=tensor,
                      trigger=trigger, picked_node=picked_node, picked_step=picked_step)
        try:
            sel, ch = resolve(project, req, previous)
        except Exception as exc:  # e.g. a damaged run: say so, keep the page
            report("selection", exc)
            keep = [dash.no_update] * (len(_CONTROLS) + 2)   # controls, sel, controls-sent
            return (*keep, None, error_box(describe(exc)), dash.no_update, dash.no_update,
                    dash.no_update, *_unchanged(_GRAPH_OUTPUTS + _HISTORY_OUTPUTS))
        new = {
            (ids.RUN, "value"): sel.run, ("kind", "options"): ch.kinds,
            ("kind", "value"): sel.kind, ("step-slider", "max"): max(ch.step_count - 1, 0),
            ("step-slider", "marks"): ch.marks, ("step-slider", "value"): ch.step_index,
            ("step-label", "children"): ch.step_label,
            ("iteration", "options"): ch.iterations, ("iteration", "value"): sel.iteration,
            ("direction", "options"): ch.directions, ("direction", "value"): sel.direction,
            ("batch", "options"): ch.batches, ("batch", "value"): sel.batch,
            ("node", "options"): ch.nodes, ("node", "value"): sel.node,
            ("tensor", "options"): ch.tensors, ("tensor", "value"): sel.tensor}
        shown = {(ids.RUN, "value"): run, ("kind", "value"): kind,
                 ("iteration", "value"): iteration, ("direction", "value"): direction,
                 ("batch", "value"): batch, ("node", "value"): node,
                 ("tensor", "value"): tensor, ("step-slider", "value"): slider}
        # Send only what changed: Dash wakes every callback that listens to a property it
        # sets, even to the same value (the run selector alone feeds a dozen panels).
        before, sent = sent, dict(sent or {})
        out = []
        for key in _CONTROLS:
            name, value = ".".join(key), new[key]
            if key in shown:
                changed = shown[key] != value
            else:
                changed = sent.get(name) != fingerprint(value)
                sent[name] = fingerprint(value)
            out.append(value if changed else dash.no_update)
        data = sel.as_dict()
        # every property set costs the page a re-render pass, even to the same value
        sent = dash.no_update if sent == before else sent
        tab = ids.GRAPH_TAB if trigger == "diagnosis" else dash.no_update
        # The graph and the history come in this answer too (a second round trip after the
        # selection arrived cost a person ~100 ms per click); new steps of the run (SHOWN)
        # may extend the history of an unchanged selection.
        history = history_outputs(project, data, statistic, overlay, _shown, rank,
                                  history_drawn)
        if data == previous:
            return (*out, dash.no_update, sent, *_unchanged(_RECORD_OUTPUTS), tab,
                    *_unchanged(_GRAPH_OUTPUTS), *history)
        return (*out, data, sent, *record_panels(project, data, rank), tab,
                *graph_outputs(project, data, colour_by, shared, graph_known), *history)

    @app.callback(Output("nonfinite-banner", "children", allow_duplicate=True),
                  Output("stats-table", "children", allow_duplicate=True),
                  Input(ids.RANK, "value"), State(ids.SEL, "data"), State(ids.RUN, "value"),
                  prevent_initial_call=True)
    def _rank_changed(rank: str | None, sel: dict | None, run: str | None) -> tuple:
        """The selected record's statistics again when the rank changes (a distributed run's
        rank selector; `_resolve` draws them on every other change, and on a run change)."""
        if not sel or sel.get("empty") or not sel.get("tensor") or sel["run"] != run:
            raise dash.exceptions.PreventUpdate
        return contained(lambda: panels.stats_table(project.run(sel["run"]), sel, rank),
                         lambda msg: (None, error_box(msg)), "statistics table")


# The record's own panels, the graph and the history come back with the selection itself:
# one round trip per click. The graph's and the history's own callbacks (below) redraw them
# for their other inputs (colouring, statistic, overlay, rank).
_RECORD_OUTPUTS = (Output("nonfinite-banner", "children"), Output("stats-table", "children"),
                   Output("values-chart", "figure"), Output("items-chart", "figure"))
_GRAPH_OUTPUTS = (Output("graph", "elements"), Output("graph", "layout"),
                  Output("node-list", "children"), Output("legend", "children"),
                  Output("graph-key", "data"))
_GRAPH_STATES = (State("colour-by", "value"), State("colour-shared", "value"),
                 State("graph-key", "data"))
_HISTORY_OUTPUTS = (Output("over-steps", "figure"), Output("over-steps-key", "data"))
_HISTORY_STATES = (State(ids.STATISTIC, "value"), State("overlay", "value"),
                   State("over-steps-key", "data"))


def _dup(outputs: tuple[Output, ...]) -> list[Output]:
    """The same outputs, for a second callback that sets them."""
    return [Output(o.component_id, o.component_property, allow_duplicate=True)
            for o in outputs]


def _unchanged(outputs: tuple[Output, ...]) -> list[Any]:
    return [dash.no_update] * len(outputs)


def _ask(app: dash.Dash, store: str, *inputs: tuple[str, str]) -> None:
    """Copy the selection and `inputs` into `store` (a list) in the browser, unless the
    selection alone changed (`_resolve` drew the outputs with it): the callback on `store`
    then asks the server only for a change of its own inputs. Having the selection as an
    input, this waits for a selection on its way, so the list is never a stale mix."""
    app.clientside_callback(
        f"""function (...args) {{
            const fired = window.dash_clientside.callback_context.triggered;
            if (fired.every((t) => t.prop_id.startsWith({json.dumps(ids.SEL + ".")}))) {{
                return window.dash_clientside.no_update;
            }}
            return args;
        }}""",
        Output(store, "data"), Input(ids.SEL, "data"), *[Input(i, p) for i, p in inputs],
        prevent_initial_call=True)


def record_panels(project: ProjectData, sel: dict[str, Any], rank: str | None = None) -> tuple:
    """Banner, statistics table, values chart and per-item chart of the selected record;
    each computed on its own, so an error stays in its panel. rank: the rank selector's
    value (distributed runs; see `panels.stats_table`)."""
    if sel.get("empty") or not sel.get("tensor"):
        hint = html.P("No recorded tensor to show yet.", className="hint")
        return None, hint, dash.no_update, dash.no_update
    rd = project.run(sel["run"])
    banner, table = contained(lambda: panels.stats_table(rd, sel, rank),
                              lambda msg: (None, error_box(msg)), "statistics table")
    values = contained(lambda: panels.values_panel(rd, sel),
                       lambda msg: error_figure(msg, "values", 240), "values chart")
    items = contained(lambda: panels.items_panel(rd, sel),
                      lambda msg: error_figure(msg, "per batch item", 200), "items chart")
    return banner, table, values, items


def _trigger(tap: dict | None, click: dict | None) -> tuple[str | None, str | None, int | None]:
    """(which selector changed, node picked, step picked) from Dash's callback context."""
    tid = ctx.triggered_id
    if isinstance(tid, dict) and tid.get("type") == ids.GO:  # a Diagnosis tab row
        hit = ids.picked(tid, ctx.triggered)
        return ("diagnosis", *hit) if hit else (None, None, None)
    if isinstance(tid, dict):  # a node-list button: only a real click counts
        clicked = any(t.get("value") for t in ctx.triggered)
        return ("node-btn", tid.get("node"), None) if clicked else (None, None, None)
    if tid == "graph":
        return "graph", (tap or {}).get("id"), None
    if tid == "over-steps":
        points = (click or {}).get("points") or [{}]
        x = points[0].get("x")
        return "over-steps", None, int(x) if isinstance(x, (int, float)) else None
    return tid, None, None


# --- the graph ----------------------------------------------------------------------------
def _register_graph(app: dash.Dash, project: ProjectData) -> None:
    _ask(app, "graph-ask", ("colour-by", "value"), ("colour-shared", "value"))

    @app.callback(*_dup(_GRAPH_OUTPUTS), Input("graph-ask", "data"),
                  State("graph-key", "data"), prevent_initial_call=True)
    def _graph(ask: list, known: dict | None) -> tuple:
        sel, colour_by, shared = ask
        return graph_outputs(project, sel, colour_by, shared, known)


def graph_outputs(project: ProjectData, sel: dict | None, colour_by: str | None,
                  shared: list | None, known: dict | None) -> tuple:
    """Graph elements, cytoscape layout, node list, legend and graph key for a selection
    (no_update for those that did not change); an error shows in the legend."""
    return contained(lambda: _graph_outputs(project, sel, colour_by, shared, known),
                     lambda msg: (dash.no_update, dash.no_update, dash.no_update,
                                  error_box(msg), dash.no_update), "graph")


def _graph_outputs(project: ProjectData, sel: dict | None, colour_by: str | None,
                   shared: list | None, known: dict | None) -> tuple:
    if not sel or sel.get("empty"):
        msg = html.P("No recorded step yet: the graph appears with the first one.",
                     className="hint")
        return [], dash.no_update, [], msg, None
    rd = project.run(sel["run"])
    graph = rd.graph(sel["step"], sel["iteration"])
    key = fingerprint(graph)  # same structure in another run: keep the view as it is
    layout = _LAYOUTS.get(key, lambda: graph_view.build_layout(graph))
    others = [o for o in (contained(lambda r=r: project.run(r), lambda _msg: None,
                                    f"run {r}") for r in project.runs()
                          if shared and colour_by != "role" and r != sel["run"]) if o]
    colours, scale, flags, caption = node_colouring(rd, sel, layout, colour_by or "role",
                                                    others)
    elements = graph_view.elements(layout, sel["node"], sel["tensor"], colours, flags)
    drawn = fingerprint([elements, caption, scale and [scale.low, scale.high, scale.log]])
    known = known or {}
    if key == known.get("structure"):
        if drawn == known.get("drawn"):  # e.g. a step click with nothing to recolour
            return tuple(_unchanged(_GRAPH_OUTPUTS))
        return (elements, dash.no_update, dash.no_update, _legend(layout, scale, caption),
                {"structure": key, "drawn": drawn})
    ordered = sorted(layout.positions, key=lambda n: layout.positions[n])
    buttons = [html.Button(n, id={"type": "node-btn", "node": n}, className="node-btn",
                           **{"data-node": n}) for n in ordered]
    # A changed layout prop makes cytoscape re-run the preset layout and fit the view.
    cy_layout = {"name": "preset", "fit": True, "padding": 24, "structure": key}
    return (elements, cy_layout, buttons, _legend(layout, scale, caption),
            {"structure": key, "drawn": drawn})


def node_colouring(rd: RunData, sel: dict[str, Any], layout: graph_view.GraphLayout,
                   colour_by: str, others: Sequence[RunData] = ()
                   ) -> tuple[dict[str, str], graph_view.ColourScale | None,
                              dict[str, str], str]:
    """Node fills, their scale, non-finite flags and a legend caption for one step.

    others: runs whose values at their nearest step of the kind share the colour scale, so
    one colour means one value in every run compared (a run that cannot be read is left
    out of the scale, and the caption names the runs that are in it).
    """
    df = rd.step_records(sel["step"])
    bad = df[(df[["nan", "posinf", "neginf"]].fillna(0) > 0).any(axis=1)]
    node_of = {t: n for n, ts in layout.members.items() for t in ts}
    flags: dict[str, str] = {}
    for t in dict.fromkeys(bad["tensor"]):
        if t in node_of:
            flags[node_of[t]] = f"non-finite values in {t}"
    if colour_by == "role":
        return {}, None, flags, ""
    per_node, caption = _node_values(rd, sel, node_of, colour_by)
    if not per_node:
        return {}, None, flags, caption
    bounds, shared = None, []
    for other in others:
        values = contained(lambda other=other: _values_near(other, sel, node_of, colour_by),
                           lambda _msg: None, f"colour scale of {other.run.name}")
        if values:
            shared.append((other.run.name, values))
    if shared:
        pooled = [*per_node.values(), *(v for _, vs in shared for v in vs.values())]
        bounds = (min(pooled), max(pooled))
        caption += f"; one scale with {', '.join(name for name, _ in shared)}"
    colours, scale = graph_view.colour_nodes(per_node, bounds)
    missing = {n: graph_view.MISSING_COLOUR for n in layout.positions if n not in colours}
    return {**missing, **colours}, scale, flags, caption


def _values_near(rd: RunData, sel: dict[str, Any], node_of: dict[str, str],
                 colour_by: str) -> dict[str, float]:
    """A run's node values at its recorded step of the kind nearest to the selected one."""
    steps = rd.steps(sel["kind"])
    if not steps:
        return {}
    return _node_values(rd, {**sel, "step": steps[nearest_index(steps, sel["step"])]},
                        node_of, colour_by)[0]


def _node_values(rd: RunData, sel: dict[str, Any], node_of: dict[str, str],
                 colour_by: str) -> tuple[dict[str, float], str]:
    """Finite value per node (max over its tensors) of a statistic ("stat:<name>") or a
    per-layer quantity ("q:<name>") at the selected step, and a caption."""
    per_tensor: dict[str, float] = {}
    if colour_by.startswith("stat:"):
        stat = colour_by[5:]
        df = rd.step_records(sel["step"])
        rows = df[df["direction"] == sel["direction"]]
        # Parameters are recorded in iteration 0 only: prefer this iteration, else any.
        rows = rows.assign(pref=(rows["iteration"] != sel["iteration"]).astype(int))
        for t, g in rows.sort_values("pref").groupby("tensor", sort=False):
            per_tensor[t] = float(g[stat].iloc[0])
        caption = f"{stat} of {sel['direction']} values at step {sel['step']}"
    else:
        name = colour_by[2:]
        q = rd.quantities(name)
        q = q[(q["step"] <= sel["step"]) & (q["layer"] != "")]
        if q.empty:
            return {}, f"{name}: not tracked per layer up to this step"
        at = int(q["step"].max())
        for layer, value in q[q["step"] == at][["layer", "value"]].itertuples(index=False):
            per_tensor[layer] = value  # a quantity's layer is the recorded parameter name
        caption = f"{name} at step {at}"
    per_node: dict[str, float] = {}
    for t, v in per_tensor.items():
        n = node_of.get(t)
        if n is not None and v is not None and math.isfinite(v):
            per_node[n] = max(per_node.get(n, -math.inf), v)
    return per_node, caption + " (node: max over its tensors)"


def _legend(layout: graph_view.GraphLayout, scale: graph_view.ColourScale | None,
            caption: str) -> list[Any]:
    roles = [r for r in graph_view.ROLE_ORDER if r in set(layout.roles.values())]
    # the role swatches only while the fills are role colours
    items: list[Any] = [html.Span([html.I(className="swatch",
                                          style={"background": graph_view.ROLE_COLOURS[r]}),
                                   r], className="legend-item") for r in roles
                        if not caption]
    items.append(html.Span("dotted side: no dependency (left) / no dependent (right); "
                           "dashed edge: from an earlier iteration", className="hint"))
    if caption:
        bar: list[Any] = [html.Span(caption, className="hint")]
        if scale is not None:
            bar = [html.Span(f"{scale.low:.3g}"),
                   html.I(className="colourbar", style={"background": scale.gradient_css()}),
                   html.Span(f"{scale.high:.3g}" + (" (log)" if scale.log else "")),
                   *bar, html.Span([html.I(className="swatch", style={
                       "background": graph_view.MISSING_COLOUR}), "no value"],
                       className="legend-item")]
        items.append(html.Div(bar, className="colour-legend"))
    return items


# --- outputs ------------------------------------------------------------------------------
def _register_outputs(app: dash.Dash, project: ProjectData) -> None:
    @app.callback(Output("overlay", "options"), Input(SHOWN, "data"),
                  prevent_initial_call=True)
    def _overlay_options(shown: list | None) -> list:
        # the selected run is always drawn; offer only the others
        run, versions = shown or (None, None)
        return [{"label": r, "value": r} for r in (versions or {}) if r != run]

    # Moving the step marker needs no server round trip and no replot of the points.
    app.clientside_callback(
        """function (sel, fig) {
            const shapes = fig && fig.layout && fig.layout.shapes;
            if (!sel || sel.step === null || !shapes || !shapes.length) {
                return window.dash_clientside.no_update;
            }
            return new window.dash_clientside.Patch()
                .assign(["layout", "shapes", 0, "x0"], sel.step)
                .assign(["layout", "shapes", 0, "x1"], sel.step).build();
        }""",
        Output("over-steps", "figure", allow_duplicate=True), Input(ids.SEL, "data"),
        State("over-steps", "figure"), prevent_initial_call=True)

    _ask(app, "history-ask", (ids.STATISTIC, "value"), ("overlay", "value"),
         (ids.RANK, "value"))

    @app.callback(*_dup(_HISTORY_OUTPUTS), Input("history-ask", "data"), State(SHOWN, "data"),
                  State("over-steps-key", "data"), prevent_initial_call=True)
    def _history(ask: list, shown: list | None, drawn: str | None) -> tuple:
        sel, statistic, overlay, rank = ask
        return history_outputs(project, sel, statistic, overlay, shown, rank, drawn)


def history_outputs(project: ProjectData, sel: dict | None, statistic: str | None,
                    overlay: list | None, shown: list | None, rank: str | None,
                    drawn: str | None) -> tuple:
    """The over-steps figure and its key, or no_update for both when what it would show is
    drawn already (only the step moved: the browser moves the marker); an error shows in
    the chart."""
    if not sel or sel.get("empty") or not sel.get("tensor"):
        return tuple(_unchanged(_HISTORY_OUTPUTS))
    versions = (shown or (None, None))[1]
    runs = list(dict.fromkeys([sel["run"], *(overlay or [])]))
    statistic = statistic or "norm"
    key = fingerprint([runs, sel["tensor"], sel["direction"], sel["record_iteration"],
                       sel["kind"], statistic, [(versions or {}).get(r) for r in runs], rank])
    if key == drawn:
        return tuple(_unchanged(_HISTORY_OUTPUTS))
    return contained(lambda: (panels.history(project, runs, sel, statistic, rank=rank), key),
                     lambda msg: (error_figure(msg, "over steps"), None), "history")


TAB = Tab("Graph", ids.GRAPH_TAB, layout, register,
          stores=(ids.SEL, "graph-key", "over-steps-key", "controls-sent", SHOWN, "graph-ask",
                  "history-ask"))
