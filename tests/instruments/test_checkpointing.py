"""torch.utils.checkpoint changes no instrument value, or says why one is missing.

A checkpointed block's forward runs again inside backward; with use_reentrant=True its
gradients arrive in a backward pass of their own (nested in the loss's). The per-sample
gradients and every first-order quantity are those of the same model trained without
checkpointing (same seeds and batches; that run's values are checked against brute-force
references in the other instrument tests). The curvature (Hessian-vector products by
torch.autograd.grad, which cannot run a reentrant checkpoint's pass) is missing with the
reason at use_reentrant=True, and unchanged at use_reentrant=False. The recorder's records
(every module's output and gradient) are those without checkpointing, and its parameter
gradients `.grad`, in every case.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import deepscope

FIRST_ORDER = ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Alpha", "Distance",
               "UpdateSize", "Loss")
CURVATURE = ("HessTrace", "TICDiag", "HessMaxEV")


class _Net(nn.Module):
    """inp -> block -> head; `first`: the checkpoint holds inp too. A reentrant checkpoint's
    parameters are then out of autograd.grad's sight (no error: they are simply unreached);
    in the middle, autograd.grad runs into the checkpoint and fails."""

    def __init__(self, reentrant: bool | None, first: bool) -> None:
        super().__init__()
        self.reentrant, self.first = reentrant, first  # reentrant None: no checkpoint
        self.inp = nn.Linear(6, 12)
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(12, 12), nn.Tanh())
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.head(self.block(self.inp(x)))
        if self.first:
            h = checkpoint(lambda t: self.block(self.inp(t)), x.requires_grad_(),
                           use_reentrant=self.reentrant)
        else:
            h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


def _train(tmp_path, reentrant: bool | None, first: bool = False):
    torch.manual_seed(0)
    model = _Net(reentrant, first)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    run = f"r{reentrant}{first}"
    with deepscope.Scope(tmp_path, run, schedule=deepscope.every(1), instruments="full",
                         instrument_options={"curvature": "exact", "max_ev_every": 1}) as scope:
        scope.watch(model, optimizer=opt, activations=True)
        for step in range(3):
            x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
            with scope.step(step) as rec:
                losses = F.cross_entropy(model(x), y, reduction="none")
                loss = losses.mean()
                rec.loss(loss, per_sample=losses)
                opt.zero_grad()
                loss.backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
    return deepscope.open_run(tmp_path / run), grads


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"), None)


@pytest.mark.parametrize("first", [False, True], ids=["middle", "first"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_changes_no_value_or_says_why(tmp_path, plain, reentrant, first):
    (want_run, _), (run, grads) = plain, _train(tmp_path, reentrant, first)
    want, got = want_run.quantities(), run.quantities()
    compared = 0
    for name in FIRST_ORDER + (CURVATURE if not reentrant else ()):
        a = want[want["name"] == name].sort_values(["step", "layer"])
        b = got[got["name"] == name].sort_values(["step", "layer"])
        assert len(a) == len(b) > 0, name
        assert b["value"].notna().all(), (name, b["meta"].tolist()[:1])
        assert b["value"].tolist() == pytest.approx(a["value"].tolist(), rel=1e-5, abs=1e-9), name
        compared += len(a)
    assert compared > 60
    for q in ("GradHist1d", "GradHist2d"):  # the exact counts
        for step in range(3):
            assert (run.histogram(q, step).counts == want_run.histogram(q, step).counts).all(), q
    if reentrant:
        for name in CURVATURE:
            rows = got[got["name"] == name]
            assert len(rows) and rows["value"].isna().all(), name
            reason = rows["meta"].iloc[0]["reason"]
            # first: unreached, said by deepscope; middle: torch's own error
            assert ("gets its gradient from a backward pass of its own" in reason) == first, (
                name, reason)
            assert "use_reentrant=True" in reason, name
    # the recorder: every module's output and its gradient, once (a recomputation inside
    # backward is neither a record nor a new iteration), as without checkpointing
    key = ["step", "iteration", "tensor", "direction"]
    a, b = (r.stats_wide().sort_values(key).reset_index(drop=True) for r in (want_run, run))
    assert b[key].values.tolist() == a[key].values.tolist()
    assert b["norm"].tolist() == pytest.approx(a["norm"].tolist(), rel=1e-5, abs=1e-9)
    assert {"block.1", "head"} <= set(b[b["direction"] == "grad"]["tensor"])
    for step, g in enumerate(grads):  # the recorder: .grad, whichever pass delivered it
        for name, v in g.items():
            row = run.stats_wide(name, direction="grad", step=step).iloc[0]
            assert row["norm"] == pytest.approx(float(v.double().norm()), rel=1e-5), name
