"""The dependency graph: exact nodes and edges on several architectures."""

from __future__ import annotations

import torch
from torch import nn

import deepscope
from tests.helpers import edges, train_mlp
from tests.zoo.models import BasicBlock  # ResNet's: conv-bn-relu(inplace)-conv-bn, += x


def test_mlp_graph_exact(tmp_path):
    with deepscope.Scope(tmp_path, "mlp", schedule=deepscope.every(1)) as scope:
        train_mlp(scope, steps=2)
    g = deepscope.open_run(tmp_path / "mlp").graph(1)
    assert edges(g) == {
        ("input", "h1"), ("l1.weight", "h1"), ("l1.bias", "h1"),
        ("h1", "h2"), ("l2.weight", "h2"), ("l2.bias", "h2"),
        ("h2", "output"), ("l3.weight", "output"), ("l3.bias", "output"),
        ("output", "loss_per_sample"), ("target", "loss_per_sample"),
        ("loss_per_sample", "loss"),
    }
    nodes = {n["id"]: sorted(n["tensors"]) for n in g["nodes"]}
    assert nodes == {
        "input": ["input"], "target": ["target"], "h1": ["h1"], "h2": ["h2"],
        "output": ["output"], "loss": ["loss", "loss_per_sample"],
        "l1": ["l1.bias", "l1.weight"], "l2": ["l2.bias", "l2.weight"],
        "l3": ["l3.bias", "l3.weight"],
    }
    roles = {t["name"]: t["role"] for t in g["tensors"]}
    assert roles["l1.weight"] == "parameter" and roles["input"] == "input"


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def test_cnn_graph_with_module_activations(tmp_path):
    model = CNN()
    with deepscope.Scope(tmp_path, "cnn", schedule=deepscope.every(1)) as scope:
        scope.watch(model, activations=True)
        with scope.step(0) as rec:
            x = torch.randn(4, 1, 8, 8)
            rec.tensor("input", x, role="input")
            out = model(x)
            out.sum().backward()
    run = deepscope.open_run(tmp_path / "cnn")
    g = run.graph(0)
    assert edges(g) == {
        ("input", "conv"), ("conv.weight", "conv"), ("conv.bias", "conv"),
        ("conv", "pool"), ("pool", "fc"), ("fc.weight", "fc"), ("fc.bias", "fc"),
        ("fc", "model"),  # the root's output is fc's output under a second name
    }
    assert run.tensors().set_index("name").loc["model", "role"] == "output"
    # the root module's output is the same tensor as fc's: both names are recorded
    assert {"conv", "pool", "fc", "model"} <= set(run.tensors()["name"])
    # gradients of activations are recorded through hooks, inputs stay untouched
    assert not x.requires_grad
    assert set(run.stats("conv")["direction"]) == {"forward", "grad"}
    assert set(run.stats("input")["direction"]) == {"forward"}


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mem = nn.Linear(2, 4), nn.Linear(4, 4)

    def forward(self, xs, rec):
        h = torch.zeros(xs.shape[1], 4)
        for t in range(xs.shape[0]):
            with rec.iteration():
                rec.tensor("x", xs[t], role="input")
                h = torch.tanh(self.inp(xs[t]) + self.mem(h))
                rec.tensor("h", h)
        return h


def test_recurrent_three_iterations_lagged_edges(tmp_path):
    model = Recurrent()
    with deepscope.Scope(tmp_path, "rnn", schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        with scope.step(0) as rec:
            h = model(torch.randn(3, 5, 2), rec)
            rec.tensor("out", h.sum(1), role="output")
            h.sum().backward()
    run = deepscope.open_run(tmp_path / "rnn")
    assert run.step_table()["iterations"].tolist() == [3]
    first, later = run.graph(0, iteration=0), run.graph(0, iteration=2)
    assert ("h", "h") not in edges(first)
    lagged = [e for e in later["edges"] if (e["source"], e["target"]) == ("h", "h")]
    assert lagged and lagged[0]["lag"] == 1
    assert {("x", "h"), ("inp.weight", "h"), ("mem.weight", "h"), ("h", "out")} <= edges(later)
    # per-iteration statistics
    assert sorted(run.stats("h", direction="forward", statistic="mean")["iteration"]) == [0, 1, 2]


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = self.a(x)
        return {"feat": h, "logits": self.b(h)}


def test_dict_outputs_named_by_key(tmp_path):
    model = DictNet()
    with deepscope.Scope(tmp_path, "dict", schedule=deepscope.every(1)) as scope:
        scope.watch(model, activations=True, name="net")
        with scope.step(0):
            out = model(torch.randn(4, 3))
            out["logits"].sum().backward()
    g = deepscope.open_run(tmp_path / "dict").graph(0)
    names = {t["name"] for t in g["tensors"]}
    assert {"net.feat", "net.logits", "net.a", "net.b", "net.a.weight"} <= names
    assert ("net.a", "net.b") in edges(g)
    assert ("net.b", "net.logits") in edges(g)


def test_registered_after_use_and_connect_bridges_detach(tmp_path):
    lin1, lin2 = nn.Linear(3, 3), nn.Linear(3, 1)
    with deepscope.Scope(tmp_path, "late", schedule=deepscope.every(1)) as scope:
        scope.watch(nn.ModuleDict({"lin1": lin1, "lin2": lin2}))
        with scope.step(0) as rec:
            x = torch.randn(4, 3)
            rec.tensor("x", x, role="input")
            a = lin1(x)
            b = lin2(a.detach())        # autograd cannot see a -> b
            out = b * 2
            rec.tensor("out", out, role="output")
            rec.tensor("a", a)          # registered after it was used
            rec.tensor("b", b)
            rec.connect("a", "b")
            (out.sum() + a.sum()).backward()
    g = deepscope.open_run(tmp_path / "late").graph(0)
    e = edges(g)
    assert ("b", "out") in e and ("x", "a") in e and ("lin1.weight", "a") in e
    assert ("a", "b") in e
    assert [m["manual"] for m in g["edges"] if (m["source"], m["target"]) == ("a", "b")] == [True]
    # without connect, autograd alone would not link a to b
    assert ("a", "out") not in e


def test_graph_structure_cached_not_rewalked(tmp_path, monkeypatch):
    import deepscope.recorder.step as step_mod
    calls = []
    real = step_mod.build_graphs
    monkeypatch.setattr(step_mod, "build_graphs", lambda *a: calls.append(1) or real(*a))
    with deepscope.Scope(tmp_path, "cache", schedule=deepscope.every(1)) as scope:
        train_mlp(scope, steps=5)
    assert len(calls) == 1
    run = deepscope.open_run(tmp_path / "cache")
    assert edges(run.graph(0)) == edges(run.graph(4))


def _module_edges(model: nn.Module, x: torch.Tensor, tmp_path, name: str) -> set:
    """Edges between activations (parameters left out) of one recorded step of `model`."""
    with deepscope.Scope(tmp_path, name, schedule=deepscope.every(1)) as scope:
        scope.watch(model, activations=True)
        with scope.step(0) as rec:
            rec.tensor("input", x, role="input")
            out = model(x)
            if out.requires_grad:
                out.sum().backward()
    g = deepscope.open_run(tmp_path / name).graph(0)
    return {e for e in edges(g) if not e[0].endswith((".weight", ".bias"))}


def test_inplace_relu_is_a_link_not_a_dead_end(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    assert _module_edges(model, torch.randn(3, 4), tmp_path, "seq") == {
        ("input", "0"), ("0", "1"), ("1", "2"), ("2", "model")}


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.block = BasicBlock(3)
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.head(self.block(self.act(self.stem(x))).flatten(1))


# The exact edges of a basic block; ReLU is called twice, so its second output is "relu#2".
RESNET_BLOCK_EDGES = {
    ("input", "stem"), ("stem", "act"),
    ("act", "block.conv1"), ("block.conv1", "block.bn1"), ("block.bn1", "block.relu"),
    ("block.relu", "block.conv2"), ("block.conv2", "block.bn2"),
    ("block.bn2", "block.relu#2"), ("act", "block.relu#2"),  # out += identity, then relu
    ("block.relu#2", "block"), ("block.relu#2", "head"), ("head", "model"),
}


def test_resnet_basic_block_edges_exact_through_inplace_ops(tmp_path):
    edges_ = _module_edges(TinyResNet(), torch.randn(2, 1, 4, 4), tmp_path, "resnet")
    assert edges_ == RESNET_BLOCK_EDGES


def test_view_of_tensor_changed_in_place_keeps_its_consumers(tmp_path):
    l1, l2 = nn.Linear(4, 4), nn.Linear(4, 2)
    with deepscope.Scope(tmp_path, "view", schedule=deepscope.every(1)) as scope:
        with scope.step(0) as rec:
            x = torch.randn(3, 4)
            rec.tensor("x", x, role="input")
            h = l1(x)
            rec.tensor("h", h)
            w = h.view(3, 2, 2)
            rec.tensor("w", w)
            h.relu_()                   # changes w too: w's grad_fn is rebuilt
            out = l2(h)
            rec.tensor("out", out)
            out2 = (w * 3).sum()
            rec.tensor("out2", out2)
            (out.sum() + out2).backward()
    g = deepscope.open_run(tmp_path / "view").graph(0)
    assert {e for e in edges(g) if "." not in e[0]} == {
        ("x", "h"), ("h", "w"), ("h", "out"), ("w", "out2")}


def test_frozen_block_keeps_its_edges(tmp_path):
    # A frozen block on an input without gradient has no autograd node at all; the next
    # Linear sees 3-D input and saves a 2-D view of the block's output.
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    assert _module_edges(model, torch.randn(2, 3, 4), tmp_path, "frozen") == {
        ("input", "0.0"), ("0.0", "0.1"), ("0.1", "0"),   # the frozen block, from its hooks
        ("0.1", "1"),                                      # block1 -> block2 (a saved view)
        ("1", "model")}
    g = deepscope.open_run(tmp_path / "frozen").graph(0)
    assert {e for e in edges(g) if e[0].endswith((".weight", ".bias"))} == {
        ("0.0.weight", "0.0"), ("0.0.bias", "0.0"), ("1.weight", "1"), ("1.bias", "1")}


def test_frozen_layer_between_trainable_ones_shows_its_parameters(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)     # its output still has a gradient, its weights none
    _module_edges(model, torch.randn(3, 4), tmp_path, "middle")
    g = deepscope.open_run(tmp_path / "middle").graph(0)
    assert {e for e in edges(g) if e[1] == "1"} == {("0", "1"), ("1.weight", "1"),
                                                     ("1.bias", "1")}
