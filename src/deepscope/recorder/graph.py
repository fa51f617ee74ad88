"""The dependency graph between named tensors, simplified from PyTorch's autograd graph.

After a recorded step we walk `grad_fn.next_functions` from every named tensor back to the
nearest named tensors or watched parameters, skipping the unnamed operations in between. Walking
at the end of the step (not at registration) means a tensor registered after it was used still
gets its incoming edges. Edges into a later iteration carry `lag` = iteration difference.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

Source = tuple[str, "int | None"]  # (tensor name, iteration); parameters have iteration None


@dataclass(frozen=True)
class Named:
    """A named tensor registered in one iteration of the step."""

    name: str
    iteration: int
    tensor: torch.Tensor
    role: str
    node: str


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _saved_sources(node, saved_map: dict) -> set:
    """Named tensors without gradient (inputs, targets) that `node` saved for its backward.

    Autograd has no edge for a tensor that does not require grad, but the operation that used
    it usually saved it; we match saved tensors by storage, shape and strides. Saved tensors
    are gone once backward has run through the node, so this is tried before backward.
    """
    found = set()
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a backward pass already
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                hit = saved_map.get(_storage_key(t))
                if hit is not None:
                    found.add(hit)
    return found


def saved_attachments(named: list[Named]) -> dict:
    """{autograd node: {(name, iteration)}} of named no-grad tensors each node saved.

    Run before backward (saved tensors are freed by it); the node objects themselves survive
    backward, so the walk at the end of the step can still use these attachments.
    """
    saved_map: dict[tuple, Source] = {}
    for rec in named:
        t = rec.tensor
        if t.grad_fn is None and not t.requires_grad and t.layout == torch.strided:
            saved_map[_storage_key(t)] = (rec.name, rec.iteration)
    found: dict = {}
    if not saved_map:
        return found
    seen = set()
    stack = [r.tensor.grad_fn for r in named if r.tensor.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        hits = _saved_sources(node, saved_map)
        if hits:
            found[node] = hits
        stack.extend(c for c, _ in node.next_functions
                     if c is not None and c not in seen and not hasattr(c, "variable"))
    return found


def _frontier(start, tensor_map: dict, leaf_map: dict, attachments: dict,
              memo: dict) -> frozenset:
    """Named sources reachable from autograd node `start` without crossing another named tensor.

    Iterative post-order with memoisation: each autograd node is expanded once per step, and
    deep (unrolled recurrent) graphs cannot hit Python's recursion limit.
    """
    stack = [(start, False)]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        children = [(c, nr) for c, nr in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            for child, nr in children:
                if ((child, nr) not in tensor_map and child not in memo
                        and not hasattr(child, "variable")):
                    stack.append((child, False))
            continue
        found: set = set(attachments.get(node, ()))
        for child, nr in children:
            hit = tensor_map.get((child, nr))
            if hit is not None:
                found.add(hit)
            elif hasattr(child, "variable"):  # AccumulateGrad: a leaf tensor
                leaf = leaf_map.get(id(child.variable))
                if leaf is not None:
                    found.add(leaf)
            else:
                found |= memo.get(child, frozenset())
        memo[node] = frozenset(found)
    return memo[start]


def build_graphs(named: list[Named], params: dict[str, torch.Tensor], param_nodes: dict[str, str],
                 manual: list[tuple[str, str, int]], attachments: dict) -> dict[int, dict]:
    """Return one graph body per iteration: {"tensors": [...], "edges": [...]}.

    tensors: {"name", "role", "node"}; edges: {"source", "target", "lag", "manual"} where lag is
    the number of iterations between source and target (0 within an iteration, None for
    parameters). `manual` holds (source, target, iteration) from `rec.connect`;
    `attachments` comes from `saved_attachments` (edges from inputs and targets).
    """
    tensor_map: dict = {}
    leaf_map: dict[int, Source] = {id(p): (n, None) for n, p in params.items()}
    aliases: dict[Source, Source] = {}  # the same tensor under a second name (module output)
    for rec in named:
        t = rec.tensor
        if t.grad_fn is not None:
            key = (t.grad_fn, t.output_nr)
            if key in tensor_map:
                aliases[(rec.name, rec.iteration)] = tensor_map[key]
            else:
                tensor_map[key] = (rec.name, rec.iteration)
        elif t.requires_grad:
            leaf_map[id(t)] = (rec.name, rec.iteration)
    memo: dict = {}
    info = {(r.name, r.iteration): r for r in named}
    by_iteration: dict[int, dict] = {}
    for rec in named:
        g = by_iteration.setdefault(rec.iteration, {"tensors": {}, "edges": {}})
        g["tensors"][rec.name] = {"name": rec.name, "role": rec.role, "node": rec.node}
        if rec.tensor.grad_fn is None:
            continue
        alias = aliases.get((rec.name, rec.iteration))
        sources = ({alias} if alias is not None
                   else _frontier(rec.tensor.grad_fn, tensor_map, leaf_map, attachments, memo))
        for src_name, src_iter in sources:
            if src_iter is None:
                lag = None
                g["tensors"].setdefault(src_name, {"name": src_name, "role": "parameter",
                                                   "node": param_nodes.get(src_name, src_name)})
            else:
                lag = rec.iteration - src_iter
                src = info[(src_name, src_iter)]
                g["tensors"].setdefault(src_name, {"name": src_name, "role": src.role,
                                                   "node": src.node})
            g["edges"][(src_name, rec.name)] = {"source": src_name, "target": rec.name,
                                                "lag": lag, "manual": False}
    for src, dst, iteration in manual:
        g = by_iteration.setdefault(iteration, {"tensors": {}, "edges": {}})
        g["edges"].setdefault((src, dst), {"source": src, "target": dst, "lag": 0,
                                           "manual": True})
    return {i: {"tensors": sorted(g["tensors"].values(), key=lambda t: t["name"]),
                "edges": sorted(g["edges"].values(), key=lambda e: (e["source"], e["target"]))}
            for i, g in by_iteration.items()}


def graph_hash(body: dict) -> str:
    """Content hash of a graph body: identical structures are stored once."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]
