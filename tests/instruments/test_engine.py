"""The per-sample gradient engine against a brute-force reference.

The reference runs the model on each sample alone and takes ∇θ ℓᵢ with
torch.autograd.grad in float64; every engine statistic is compared with the same
statistic of those explicit per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from deepscope.instruments.engine import PerSampleEngine
from deepscope.instruments.rules import GenericRule, rule_for
from deepscope.instruments.rules.base import RankOne
from deepscope.instruments.rules.linear import OuterProductGrads

B = 5
RTOL = 1e-6

LossFn = Callable[[Tensor, Tensor], Tensor]  # (output, target) -> (B,) per-sample losses


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def sq_err(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (out - y).square().flatten(1).sum(1)


# -- models (float64), each with inputs, targets and a per-sample loss --------------------
class CNN(nn.Module):
    """Conv1d/2d/3d with stride, dilation, groups, 'same' and non-zero padding modes."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 8, 3)  # 4x4 -> 2x2: Gram path
        self.c3 = nn.Conv2d(8, 4, 4)  # 4x4 -> 1x1: outer-product path
        self.branch = nn.Conv2d(
            2, 4, 3, stride=2, dilation=2, groups=2, padding=1, padding_mode="circular"
        )
        self.c1d = nn.Conv1d(3, 4, 4, padding="same", padding_mode="reflect")  # pads (1, 2)
        self.c3d = nn.Conv3d(1, 2, 2, stride=(1, 2, 2))
        self.head = nn.Linear(8 + 4 + 16 + 4 + 2, 3)

    def forward(self, img: Tensor, seq: Tensor, vol: Tensor) -> Tensor:
        h = F.max_pool2d(torch.relu(self.gn(self.c1(img))), 2)
        parts = [
            torch.tanh(self.c2(h)).flatten(1)[:, :8],
            self.c3(h).flatten(1),
            torch.tanh(self.branch(img)).flatten(1)[:, :16],
            torch.tanh(self.c1d(seq)).mean(2),
            self.c3d(vol).mean((2, 3, 4)),
        ]
        return self.head(torch.cat(parts, 1))


class Attention(nn.Module):
    """Embedding + LayerNorm + two MultiheadAttention (batch first or not) + GELU."""

    def __init__(self, vocab: int = 7, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        self.att2 = nn.MultiheadAttention(d, 2)  # sequence-first
        self.ff = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.ln(self.emb(tokens))
        h = h + self.att(h, h, h, need_weights=False)[0]
        s = h.transpose(0, 1)
        h = h + self.att2(s, s, s, key_padding_mask=tokens == 0)[0].transpose(0, 1)
        return self.head(F.gelu(self.ff(h)).mean(1))


class Shared(nn.Module):
    """One Linear called twice, and an embedding tied to the output layer."""

    def __init__(self, vocab: int = 6, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.lin(torch.tanh(self.lin(self.emb(tokens))))
        return self.out(h).mean(1)


class Custom(nn.Module):
    """Parameters used in a custom way: only the generic rule can handle this."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.mix = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + torch.sin(x @ self.mix)


class Branchy(nn.Module):
    """Data-dependent control flow (always the same branch here): vmap cannot run it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w if bool((x.abs() < 1e6).all()) else x


class Gained(nn.Module):
    """A parameter of its own and a child: the generic rule re-runs the child too."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.gain


class Cube(torch.autograd.Function):
    """x³ with a backward only: neither vmap nor forward-mode AD can run it."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class Cubic(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return Cube.apply(x * self.w)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4)  # sequence-first
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x.transpose(0, 1))
        return self.head(out[-1])


def bn_eval_model() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.BatchNorm1d(48),
        nn.Linear(48, 2),
    ).double()
    with torch.no_grad():  # give the running statistics non-trivial values
        for _ in range(3):
            model(torch.randn(8, 1, 6, 6, dtype=torch.double) * 2 + 1)
    return model.eval()


def tokens(vocab: int, length: int = 5) -> Tensor:
    t = torch.randint(0, vocab, (B, length))
    t[:, 0] = torch.randint(1, vocab, (B,))  # never a fully padded row
    t[:, 1] = t[:, 2]  # repeated indices within a sample
    return t


def rand(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.double)


def cases() -> dict[str, Callable[[], tuple[nn.Module, tuple, Tensor, LossFn]]]:
    """name -> factory of (model, inputs, target, per-sample loss)."""
    return {
        "linear": lambda: (nn.Linear(5, 3).double(), (rand(B, 5),), rand(B, 3), sq_err),
        "mlp": lambda: (
            nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3)),
            (rand(B, 6),),
            torch.randint(0, 3, (B,)),
            ce,
        ),
        "cnn": lambda: (
            CNN(),
            (rand(B, 2, 8, 8), rand(B, 3, 10), rand(B, 1, 3, 4, 4)),
            torch.randint(0, 3, (B,)),
            ce,
        ),
        # 6 positions: a sequence-first layer with T == B makes the others ambiguous (missing)
        "attention": lambda: (Attention(), (tokens(7, 6),), torch.randint(0, 3, (B,)), ce),
        "shared": lambda: (Shared(), (tokens(6),), torch.randint(0, 6, (B,)), ce),
        # (B, 3, 2, 16): 6 positions per sample; the first layer takes the Gram path,
        # the second (16 -> 2) materialises
        "sequence": lambda: (
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)),
            (rand(B, 3, 2, 16),),
            rand(B, 3, 2, 2),
            sq_err,
        ),
        "bn_eval": lambda: (bn_eval_model(), (rand(B, 1, 6, 6),), torch.randint(0, 2, (B,)), ce),
        "custom": lambda: (
            nn.Sequential(nn.Linear(4, 6), Custom(6), nn.RMSNorm(6), nn.Linear(6, 2)),
            (rand(B, 4),),
            torch.randint(0, 2, (B,)),
            ce,
        ),
        "recurrent": lambda: (Recurrent(), (rand(B, 4, 3),), torch.randint(0, 2, (B,)), ce),
    }


# -- the brute-force reference -----------------------------------------------------------
def reference(model: nn.Module, inputs: tuple, target: Tensor, loss: LossFn) -> dict[str, Tensor]:
    """name -> (B, *shape) per-sample gradients, each sample run alone."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        li = loss(model(*(x[i : i + 1] for x in inputs)), target[i : i + 1])[0]
        grads = torch.autograd.grad(li, [p for _, p in named], allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)])
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def run_engine(model, inputs, target, loss, reduction, **kwargs) -> PerSampleEngine:
    engine = PerSampleEngine(model, **kwargs)
    engine.start()
    losses = loss(model(*inputs), target)
    (losses.mean() if reduction == "mean" else losses.sum()).backward()
    engine.stop()
    engine.set_scale(B if reduction == "mean" else 1)
    return engine


def close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}"
    err = float((actual - expected).norm())
    scale = float(expected.norm())
    assert err <= RTOL * scale + 1e-12, f"{what}: error {err:.3e} vs norm {scale:.3e}"


def check_all(engine: PerSampleEngine, ref: dict[str, Tensor], dots_first: bool) -> None:
    """Every statistic of the engine against the same statistic of the reference.

    dots_first: ask for dots, grad_mean and second moments before the norms (the paths
    that avoid per-sample gradients run first), else the norms first (which may keep
    per-sample gradients that later calls reuse).
    """
    assert engine.param_names == list(ref)
    vectors = {n: torch.randn_like(g[0]) for n, g in ref.items()}
    subset = {n: v for k, (n, v) in enumerate(vectors.items()) if k % 2 == 0}
    if dots_first:
        dots, mean, m2, sq = (
            engine.dots(vectors),
            engine.grad_mean(),
            engine.second_moments(),
            engine.sq_norms(),
        )
    else:
        sq, mean, m2, dots = (
            engine.sq_norms(),
            engine.grad_mean(),
            engine.second_moments(),
            engine.dots(vectors),
        )
    dots_subset = engine.dots(subset)
    assert set(dots_subset) == set(subset)
    both = engine.dots_many([subset, vectors])
    assert [set(d) for d in both] == [set(subset), set(vectors)]
    per_sample = dict(engine.per_sample_grads())
    parts: dict[str, list[Tensor]] = {}
    for name, part in engine.per_sample_parts():  # RankOne parts materialised to compare
        parts.setdefault(name, []).append(
            part.materialise(0, part.samples).reshape(-1, *ref[name].shape[1:])
            if isinstance(part, RankOne) else part)
    for name, g in ref.items():
        flat = g.flatten(1)
        close(sq[name], flat.square().sum(1), f"sq_norms[{name}]")
        close(mean[name], g.mean(0), f"grad_mean[{name}]")
        close(m2[name], g.square().sum(0), f"second_moments[{name}]")
        close(dots[name], flat @ vectors[name].flatten(), f"dots[{name}]")
        close(both[1][name], flat @ vectors[name].flatten(), f"dots_many[{name}]")
        if name in subset:
            close(dots_subset[name], flat @ subset[name].flatten(), f"dots subset [{name}]")
            close(both[0][name], flat @ subset[name].flatten(), f"dots_many subset [{name}]")
        close(per_sample[name], g, f"per_sample_grads[{name}]")
        close(torch.cat(parts[name]), g, f"per_sample_parts[{name}]")


# -- the matrix: models x reductions x (chunked, nothing kept) / (one chunk, kept) -------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(cases()))
def test_engine_matches_per_sample_reference(case: str, reduction: str) -> None:
    model, inputs, target, loss = cases()[case]()
    model = model.double()
    ref = reference(model, inputs, target, loss)
    # mean: chunks of 2 samples and no kept per-sample gradients; sum: the other paths
    kwargs = {"chunk_size": 2, "cache_bytes": 0} if reduction == "mean" else {}
    engine = run_engine(model, inputs, target, loss, reduction, **kwargs)
    check_all(engine, ref, dots_first=reduction == "mean")
    assert engine.warnings == []  # (LSTM: its closed form, no vmap fallback)
    assert engine.unavailable == {}


def test_weight_sharing_names_and_rules() -> None:
    model = Shared().double()
    engine = PerSampleEngine(model)
    assert engine.param_names == ["emb.weight", "lin.weight", "lin.bias"]  # tied: once


@pytest.mark.parametrize(
    "cls, args, kwargs, make_input, out_shape",
    [
        (nn.Linear, (6, 4), {}, lambda: rand(B, 3, 6), (B, 3, 4)),
        (
            nn.Conv2d,
            (4, 6, 3),
            {"stride": 2, "groups": 2, "padding": 1},
            lambda: rand(B, 4, 5, 5),
            (B, 6, 3, 3),
        ),
        (nn.Embedding, (5, 3), {"padding_idx": 1}, lambda: tokens(5, 4), (B, 4, 3)),
        (nn.LayerNorm, ((2, 3),), {}, lambda: rand(B, 4, 2, 3), (B, 4, 2, 3)),
    ],
    ids=["linear", "conv2d", "embedding", "layernorm"],
)
def test_closed_form_and_generic_rule_agree(cls, args, kwargs, make_input, out_shape) -> None:
    closed = cls(*args, **kwargs).double()
    with torch.no_grad():  # non-trivial affine parameters for LayerNorm
        for p in closed.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    # same layer with its own forward: the registry must pick the generic rule for it
    wrapped = type("Wrapped", (cls,), {"forward": lambda self, x: cls.forward(self, x)})
    generic = wrapped(*args, **kwargs).double()
    generic.load_state_dict(closed.state_dict())
    assert rule_for(closed) is not GenericRule and rule_for(generic) is GenericRule
    x, target = make_input(), rand(*out_shape)
    ours, theirs = (run_engine(m, (x,), target, sq_err, "mean") for m in (closed, generic))
    vectors = {n: torch.randn_like(p) for n, p in closed.named_parameters()}
    for name in ours.param_names:
        close(ours.sq_norms()[name], theirs.sq_norms()[name], f"sq_norms {name}")
        close(ours.dots(vectors)[name], theirs.dots(vectors)[name], f"dots {name}")
        close(ours.grad_mean()[name], theirs.grad_mean()[name], f"grad_mean {name}")
        close(ours.second_moments()[name], theirs.second_moments()[name], f"m2 {name}")
    for (n1, g1), (n2, g2) in zip(ours.per_sample_grads(), theirs.per_sample_grads()):
        assert n1 == n2
        close(g1, g2, f"per_sample {n1}")
    assert ours.warnings == theirs.warnings == []


def test_stop_removes_every_hook_and_inputs_are_untouched() -> None:
    model, (x,), target, loss = cases()["attention"]()
    model = model.double()
    features = rand(B, 6)
    mlp = nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    for m, inp, tgt in ((model, x, target), (mlp, features, torch.randint(0, 2, (B,)))):
        engine = PerSampleEngine(m)
        engine.start()
        out = m(inp)
        engine.stop()  # before backward: output hooks must go too
        loss(out, tgt).sum().backward()
        with pytest.raises(ValueError, match="no gradients were captured"):
            engine.sq_norms()
        for module in m.modules():
            assert not module._forward_hooks and not module._forward_pre_hooks
            assert not module._backward_hooks
        for p in m.parameters():
            assert not p._backward_hooks
        assert not inp.requires_grad and inp.grad is None
    features.requires_grad_(False)
    engine = run_engine(mlp, (features,), torch.randint(0, 2, (B,)), ce, "mean")
    assert not features.requires_grad and features.grad is None


def test_results_after_in_place_optimizer_step_are_pre_step() -> None:
    # Gained's re-run reads its child's parameters as they were at forward time too
    model = nn.Sequential(Attention(), Custom(3), Gained(3), nn.LayerNorm(3)).double()
    x, target = tokens(7, 6), rand(B, 3)  # T ≠ B (see cases)
    ref = reference(model, (x,), target, sq_err)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine = PerSampleEngine(model)
    engine.start()
    opt.zero_grad()
    sq_err(model(x), target).mean().backward()
    engine.stop()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    engine.set_scale(B)
    check_all(engine, ref, dots_first=True)
    assert engine.warnings == []


@pytest.mark.parametrize("dots_first", [True, False])
def test_vmap_and_jvp_failures_fall_back_and_say_so(dots_first: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 4), Branchy(4), Cubic(4), nn.Linear(4, 2)).double()
    x, target = rand(B, 3), torch.randint(0, 2, (B,))
    ref = reference(model, (x,), target, ce)
    engine = run_engine(model, (x,), target, ce, "mean", chunk_size=2, cache_bytes=0)
    check_all(engine, ref, dots_first=dots_first)
    assert len(engine.warnings) == 2, engine.warnings
    assert all("vmap failed" in w for w in engine.warnings)
    assert sorted(w.split(":")[0] for w in engine.warnings) == ["Branchy '1'", "Cubic '2'"]


def test_unsupported_closed_form_config_uses_generic_rule() -> None:
    model = nn.Sequential(
        nn.Embedding(6, 3, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 2)
    ).double()
    x, target = tokens(6, 4), torch.randint(0, 2, (B,))
    ref = reference(model, (x,), target, ce)  # frequencies within each sample alone
    engine = run_engine(model, (x,), target, ce, "sum")
    assert "Embedding '0': scale_grad_by_freq" in engine.warnings[0]
    assert "generic rule" in engine.warnings[0]
    check_all(engine, ref, dots_first=True)


def test_batchnorm_train_mode_warns_and_gives_additive_shares() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    x, target = rand(B, 3), torch.randint(0, 2, (B,))
    engine = run_engine(model, (x,), target, ce, "mean")
    # the shares add up to the true (batch-coupled) gradient of the mean loss
    for name, p in model.named_parameters():
        close(engine.grad_mean()[name], p.grad, f"grad_mean {name}")
        close(next(g for n, g in engine.per_sample_grads() if n == name).mean(0), p.grad, name)
    assert any("BatchNorm1d '1'" in w and "train mode" in w for w in engine.warnings)


def test_randomness_in_a_generic_module_is_reported() -> None:
    class Noisy(Custom):
        def forward(self, x: Tensor) -> Tensor:
            return F.dropout(super().forward(x), 0.5, training=True)

    model = nn.Sequential(nn.Linear(3, 4), Noisy(4)).double()
    engine = run_engine(model, (rand(B, 3),), rand(B, 4), sq_err, "mean")
    engine.sq_norms()
    assert any("did not reproduce its recorded output" in w for w in engine.warnings)


def test_parameter_used_outside_its_module_is_nan_and_explained() -> None:
    class Orphan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.proj = nn.Linear(3, 4)  # never called: its weight is read directly

        def forward(self, x: Tensor) -> Tensor:
            return F.linear(self.lin(x), self.proj.weight)

    model = Orphan().double()
    engine = run_engine(model, (rand(B, 3),), torch.randint(0, 4, (B,)), ce, "mean")
    sq = engine.sq_norms()
    assert torch.isnan(sq["proj.weight"]).all()
    assert torch.equal(sq["proj.bias"], torch.zeros(B, dtype=torch.double))  # no gradient: 0
    assert not torch.isnan(sq["lin.weight"]).any()
    assert set(engine.unavailable) == {"proj.weight"}
    assert any("proj.weight" in w and "recursive = True" in w for w in engine.warnings)


def test_module_input_without_batch_dim_is_nan_and_explained() -> None:
    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(5, 3)
            self.pos = nn.Embedding(4, 3)
            self.out = nn.Linear(3, 1)

        def forward(self, t: Tensor) -> Tensor:
            return self.out(self.tok(t) + self.pos(torch.arange(t.shape[1]))).sum(1)

    model = Positional().double()
    engine = run_engine(model, (tokens(5, 4),), rand(B, 1), sq_err, "mean")
    sq = engine.sq_norms()
    assert torch.isnan(sq["pos.weight"]).all() and not torch.isnan(sq["tok.weight"]).any()
    assert set(engine.unavailable) == {"pos.weight"}
    assert "batch size is 4" in engine.unavailable["pos.weight"]


def test_bad_input_errors() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        PerSampleEngine("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        PerSampleEngine(nn.Linear(2, 2), chunk_size=0)
    engine = PerSampleEngine(nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="no forward pass was captured"):
        engine.sq_norms()
    with pytest.raises(ValueError, match="scale"):
        engine.set_scale(0)
    with pytest.raises(TypeError, match="scale"):
        engine.set_scale("8")  # type: ignore[arg-type]
    engine = run_engine(nn.Linear(2, 2).double(), (rand(B, 2),), rand(B, 2), sq_err, "sum")
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        engine.dots({"nope": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        engine.dots({"weight": torch.zeros(3)})


@pytest.mark.parametrize("edit", ["none", "penalty", "clip", "scale_grad"])
def test_delivered_gradients_are_used_only_when_they_are_the_sum(monkeypatch, edit) -> None:
    """ḡ comes from the gradients autograd delivered when Freivalds' check accepts them;
    a penalty on θ in the loss or an in-place edit of the gradient must not leak into ḡ."""
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, target = rand(B, 6), torch.randint(0, 3, (B,))
    ref = reference(model, (x,), target, ce)
    accepted: list[bool] = []
    original = OuterProductGrads._sums_and_check

    def spy(self, candidate):
        sums = original(self, candidate)
        if candidate is not None:
            accepted.append(sums.get(self.weight) is candidate)
        return sums

    monkeypatch.setattr(OuterProductGrads, "_sums_and_check", spy)
    engine = PerSampleEngine(model)
    engine.start()
    out = model(x)
    loss = ce(out, target).mean()
    if edit == "penalty":  # reaches the weights directly, not through the layers' outputs
        loss = loss + 0.1 * sum(p.square().sum() for p in model.parameters())
    loss.backward()
    engine.stop()
    engine.set_scale(B)
    if edit == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    if edit == "scale_grad":  # an edit of the very tensors autograd delivered
        for kept, _ in engine._observed.values():
            kept.mul_(3.0)
    mean = engine.grad_mean()
    for name, g in ref.items():
        close(mean[name], g.mean(0), f"grad_mean[{name}]")
    if edit == "none":
        assert accepted == [True, True]
    elif edit == "penalty":
        assert accepted == [False, False]
    elif edit == "scale_grad":  # version counters changed: never offered
        assert accepted == []


@pytest.mark.parametrize("with_loss", [False, True])
def test_no_module_with_a_batch_says_why(with_loss) -> None:
    """An RNN on a PackedSequence, alone: the error names it, not a missing backward."""
    gru = nn.GRU(3, 4, batch_first=True).double()
    packed = pack_padded_sequence(rand(B, 4, 3), torch.tensor([4, 2, 3, 1, 4]),
                                  batch_first=True, enforce_sorted=False)
    engine = PerSampleEngine(gru)
    engine.start()
    out, _ = pad_packed_sequence(gru(packed)[0], batch_first=True)
    losses = out.square().flatten(1).mean(1)
    if with_loss:
        engine.add_loss(losses.mean(), B, per_sample=losses)
    losses.mean().backward()
    engine.stop()
    with pytest.raises(ValueError, match="GRU .*its first input is PackedSequence"):
        engine.sq_norms()
