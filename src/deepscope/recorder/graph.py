"""The dependency graph between named tensors, simplified from PyTorch's autograd graph.

After a recorded step we walk `grad_fn.next_functions` from every named tensor back to the
nearest named tensors or watched parameters, skipping the unnamed operations in between. Walking
at the end of the step (not at registration) means a tensor registered after it was used still
gets its incoming edges. Edges into a later iteration carry `lag` = iteration difference.

Each named tensor is identified by the autograd node it had when it was registered, not by the
one it has at the end of the step: an in-place operation (`ReLU(inplace=True)`, `out += x`)
replaces a tensor's `grad_fn` but keeps the old node as its input, so the registration-time node
keeps the graph right through in-place operations. The node it has at the end of the step also
leads to it unless another named tensor was registered with that node (the in-place op's own
output, e.g. the ReLU module's): later users of the changed tensor are its consumers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    grad_fn: Any = None  # the tensor's autograd node when registered (in-place ops replace it)
    output_nr: int = 0
    requires_grad: bool = False

    @classmethod
    def of(cls, name: str, iteration: int, tensor: torch.Tensor, role: str,
           node: str) -> Named:
        """Register `tensor` now: its autograd node is taken before later in-place changes."""
        return cls(name, iteration, tensor, role, node, tensor.grad_fn, tensor.output_nr,
                   tensor.requires_grad)


Region = tuple[int, int, int]


class ModuleCall(NamedTuple):
    """What a module's forward hook saw that autograd cannot show for its output.

    inputs: `memory_region` of each input tensor (for outputs without gradient; addresses, so
    the inputs themselves can be freed). frozen: ids of the module's own parameters without
    gradient (autograd has no edge from them).
    """

    inputs: tuple[Region | None, ...]
    frozen: tuple[int, ...]


def memory_region(t: torch.Tensor) -> Region | None:
    """(storage address, first byte, end byte) of the memory `t` reads, None if it has none."""
    if t.layout != torch.strided or t.numel() == 0 or t.device.type == "meta":
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return base, start, start + extent * t.element_size()


class _NoGradSources:
    """Named tensors without gradient, found again from tensors autograd saved.

    An operation saves its input or a view of it (`Linear` on 3-D input saves the input
    reshaped to 2-D), so a saved tensor belongs to the named tensor whose memory contains the
    saved tensor's memory; the smallest such tensor wins, then the first registered (a module's
    output registered again as its parent's output).
    """

    def __init__(self, named: list[Named]) -> None:
        self.by_storage: dict[int, list[tuple[int, int, int, Source]]] = {}
        for order, rec in enumerate(named):
            if rec.grad_fn is None and not rec.requires_grad:
                region = memory_region(rec.tensor)
                if region is not None:
                    base, start, end = region
                    self.by_storage.setdefault(base, []).append(
                        (end - start, order, start, (rec.name, rec.iteration)))
        for entries in self.by_storage.values():
            entries.sort()

    def __bool__(self) -> bool:
        return bool(self.by_storage)

    def find(self, region: Region | None, before: int | None = None) -> Source | None:
        """The named tensor holding `region` (one registered before number `before`)."""
        if region is None:
            return None
        base, start, end = region
        for size, order, first, source in self.by_storage.get(base, ()):
            if first <= start and end <= first + size and (before is None or order < before):
                return source
        return None


def _saved_sources(node, sources: _NoGradSources) -> set:
    """Named tensors without gradient (inputs, targets) that `node` saved for its backward.

    Autograd has no edge for a tensor that does not require grad, but the operation that used
    it usually saved it (or a view of it). Saved tensors are gone once backward has run through
    the node, so this is tried before backward.
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
            if isinstance(t, torch.Tensor):
                hit = sources.find(memory_region(t))
                if hit is not None:
                    found.add(hit)
    return found


def saved_attachments(named: list[Named]) -> dict:
    """{autograd node: {(name, iteration)}} of named no-grad tensors each node saved.

    Run before backward (saved tensors are freed by it); the node objects themselves survive
    backward, so the walk at the end of the step can still use these attachments.
    """
    sources = _NoGradSources(named)
    found: dict = {}
    if not sources:
        return found
    seen = set()
    # The registration-time nodes, and the current ones: an in-place change after
    # registration adds nodes that only the current `grad_fn` leads to.
    stack = [n for r in named for n in (r.grad_fn, r.tensor.grad_fn) if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        hits = _saved_sources(node, sources)
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


def _no_grad_sources(named: list[Named], calls: dict[Source, ModuleCall]
                     ) -> dict[Source, set]:
    """Incoming edges of named tensors without gradient (the outputs of frozen modules).

    Autograd records nothing for them, so edges come from the module's inputs seen by its
    forward hook: each input whose memory belongs to an earlier named no-grad tensor is a
    source. The same tensor under a second name (a container's output) gets one edge from its
    first name, as with tensors that have gradients.
    """
    sources = _NoGradSources(named)
    firsts: dict[tuple, Source] = {}
    found: dict[Source, set] = {}
    for order, rec in enumerate(named):
        if rec.grad_fn is not None or rec.requires_grad:
            continue
        key = (rec.name, rec.iteration)
        t = rec.tensor
        same = (memory_region(t), tuple(t.shape), t.stride(), t.dtype)
        if same[0] is not None and same in firsts:
            found[key] = {firsts[same]}
            continue
        firsts.setdefault(same, key)
        call = calls.get(key)
        hits = {sources.find(r, before=order) for r in (call.inputs if call else ())}
        found[key] = hits - {None}
    return found


def build_graphs(named: list[Named], params: dict[str, torch.Tensor], param_nodes: dict[str, str],
                 manual: list[tuple[str, str, int]], attachments: dict,
                 module_calls: dict[Source, ModuleCall] | None = None) -> dict[int, dict]:
    """Return one graph body per iteration: {"tensors": [...], "edges": [...]}.

    tensors: {"name", "role", "node"}; edges: {"source", "target", "lag", "manual"} where lag is
    the number of iterations between source and target (0 within an iteration, None for
    parameters). `manual` holds (source, target, iteration) from `rec.connect`;
    `attachments` comes from `saved_attachments` (edges from inputs and targets);
    `module_calls` {(name, iteration): ModuleCall} of module outputs (edges from frozen
    modules' inputs and parameters).
    """
    calls = module_calls or {}
    tensor_map: dict = {}
    leaf_map: dict[int, Source] = {id(p): (n, None) for n, p in params.items()}
    aliases: dict[Source, Source] = {}  # the same tensor under a second name (module output)
    for rec in named:
        if rec.grad_fn is not None:
            key = (rec.grad_fn, rec.output_nr)
            if key in tensor_map:
                aliases[(rec.name, rec.iteration)] = tensor_map[key]
            else:
                tensor_map[key] = (rec.name, rec.iteration)
        elif rec.requires_grad:
            leaf_map[id(rec.tensor)] = (rec.name, rec.iteration)
    for rec in named:
        # Changed in place after registration (or a view whose base was): operations that
        # used the changed tensor point to its current node; they used the named tensor.
        current = rec.tensor.grad_fn
        if current is not None and current is not rec.grad_fn:
            tensor_map.setdefault((current, rec.tensor.output_nr), (rec.name, rec.iteration))
    memo: dict = {}
    info = {(r.name, r.iteration): r for r in named}
    no_grad = _no_grad_sources(named, calls)
    by_iteration: dict[int, dict] = {}
    for rec in named:
        g = by_iteration.setdefault(rec.iteration, {"tensors": {}, "edges": {}})
        g["tensors"][rec.name] = {"name": rec.name, "role": rec.role, "node": rec.node}
        alias = aliases.get((rec.name, rec.iteration))
        if rec.grad_fn is None:
            sources = no_grad.get((rec.name, rec.iteration), set())
        elif alias is not None:
            sources = {alias}
        else:
            sources = _frontier(rec.grad_fn, tensor_map, leaf_map, attachments, memo)
        call = calls.get((rec.name, rec.iteration))
        if call is not None and alias is None:
            sources = set(sources) | {leaf_map[i] for i in call.frozen if i in leaf_map}
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
