"""Layout and highlighting of the dependency graph (no browser)."""

from __future__ import annotations

from deepscope.gui import graph_view
from deepscope.gui.graph_view import GraphLayout, build_layout, colour_nodes, elements


def _graph(nodes: dict[str, tuple[str, list[str]]],
           edges: list[tuple[str, str, int | None]]) -> dict:
    """A `Run.graph`-shaped dict: nodes {id: (role, tensors)}, edges between tensors."""
    return {"tensors": [{"name": t, "role": role, "node": n}
                        for n, (role, ts) in nodes.items() for t in ts],
            "edges": [{"source": s, "target": t, "lag": lag, "manual": False}
                      for s, t, lag in edges],
            "nodes": [{"id": n, "role": role, "tensors": ts} for n, (role, ts) in nodes.items()]}


RNN = _graph(
    {"input": ("input", ["input"]), "cell": ("parameter", ["cell.weight", "cell.bias"]),
     "state": ("activation", ["state"]), "output": ("output", ["output"]),
     "target": ("target", ["target"]), "loss": ("loss", ["loss", "loss_per_sample"])},
    [("input", "state", 0), ("cell.weight", "state", None), ("cell.bias", "state", None),
     ("state", "state", 1), ("state", "output", 0), ("output", "loss_per_sample", 0),
     ("loss_per_sample", "loss", 0)])


def _column(layout: GraphLayout, node: str) -> int:
    return round(layout.positions[node][0] / graph_view.X_GAP)


def test_layers_run_left_to_right_inputs_first_losses_last() -> None:
    layout = build_layout(RNN)
    cols = {n: _column(layout, n) for n in layout.positions}
    assert cols["input"] == 0
    assert cols["state"] == 1 and cols["output"] == 2
    assert cols["loss"] == max(cols.values())
    # a parameter node sits right before its first consumer; an unconnected target sits
    # next to the loss
    assert cols["cell"] == cols["state"] - 1
    assert cols["target"] == cols["loss"] - 1
    # nodes of one column never overlap
    ys = [(cols[n], y) for n, (_, y) in layout.positions.items()]
    assert len(ys) == len(set(ys))


def test_lagged_edges_are_drawn_but_do_not_shape_the_layers() -> None:
    layout = build_layout(RNN)
    assert ("state", "state", True) in layout.edges       # the recurrent edge is kept
    assert "state" not in layout.preds["state"]           # ... but it is not a lag-0 edge
    # intra-node parameter edges vanish; the node-level edge from cell to state stays
    assert set(layout.edges[("cell", "state", False)]) == {("cell.weight", "state"),
                                                            ("cell.bias", "state")}


def test_a_lag0_cycle_still_gets_a_layout() -> None:
    g = _graph({"a": ("activation", ["a"]), "b": ("activation", ["b"])},
               [("a", "b", 0), ("b", "a", 0)])
    assert set(build_layout(g).positions) == {"a", "b"}


def test_dotted_sides_mark_missing_dependencies_and_dependents() -> None:
    by_id = {e["data"]["id"]: e for e in elements(build_layout(RNN), None, None)}
    assert "open-left" in by_id["input"]["classes"]        # depends on nothing
    assert "open-right" in by_id["loss"]["classes"]        # nothing depends on it
    assert "open-both" in by_id["target"]["classes"]
    assert "closed" in by_id["state"]["classes"]
    assert by_id["cell"]["data"]["label"] == "cell  [2]"   # a grouped node says its size


def test_selection_highlights_dependencies_and_dependents() -> None:
    layout = build_layout(RNN)
    els = {e["data"]["id"]: e["classes"].split() for e in elements(layout, "output", "output")}
    assert "selected" in els["output"]
    for upstream in ("state", "input", "cell"):
        assert "lit" in els[upstream]
    assert "lit" in els["loss"]                            # depends on the selection
    assert "faded" in els["target"]                        # unrelated
    assert "own" in els["state->output"]                   # an edge of the selected tensor
    assert "lit" in els["input->state"] and "faded" not in els["input->state"]


def test_edges_of_other_tensors_in_a_grouped_node_are_thin() -> None:
    g = _graph({"x": ("input", ["x"]), "m": ("activation", ["m.a", "m.b"]),
                "y": ("output", ["y"])},
               [("x", "m.a", 0), ("m.a", "y", 0), ("m.b", "y", 0)])
    els = {e["data"]["id"]: e["classes"].split() for e in elements(build_layout(g), "m", "m.b")}
    assert "thin" in els["x->m"]       # only m.a has this edge
    assert "own" in els["m->y"]        # m.b feeds y itself


def test_colour_scale_goes_logarithmic_over_two_decades() -> None:
    colours, scale = colour_nodes({"a": 1e-4, "b": 1.0, "c": float("nan")})
    assert set(colours) == {"a", "b"} and scale is not None and scale.log
    assert colours["a"] != colours["b"]
    colours, scale = colour_nodes({"a": -1.0, "b": 1.0})
    assert scale is not None and not scale.log
    assert colour_nodes({"a": float("inf")}) == ({}, None)
